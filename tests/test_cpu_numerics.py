"""The CPU kernels are pinned so that a CPU run (the demo) gives the same digits on every x86-64 host with AVX2:
the variables are set on import unless the user set them, torch then dispatches to AVX2, and a CPU model load
pins the thread count."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from vlmrl.common import cpu_numerics


def test_pinning_sets_only_what_the_user_left_unset():
    env = {"MKL_CBWR": "COMPATIBLE"}
    chosen = cpu_numerics.pin_cpu_kernels(env)
    assert env["MKL_CBWR"] == "COMPATIBLE" and "MKL_CBWR" not in chosen
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    native = {"VLMRL_CPU_KERNELS": "native"}
    assert cpu_numerics.pin_cpu_kernels(native) == {} and set(native) == {"VLMRL_CPU_KERNELS"}


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the pinning concerns x86-64 hosts")
def test_a_process_that_imports_vlmrl_computes_with_the_pinned_kernels():
    """As the `vlmrl` command does (the suite itself runs with VLMRL_CPU_KERNELS=native: conftest)."""
    env = {k: v for k, v in os.environ.items() if k not in (*cpu_numerics.PINNED, "VLMRL_CPU_KERNELS")}
    probe = "import vlmrl, torch; torch.ones(2) @ torch.ones(2); print(torch.backends.cpu.get_cpu_capability())"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    if out.strip() == "DEFAULT":
        pytest.skip("this host has no AVX2: it runs torch's default kernels")
    assert out.strip() == "AVX2"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the thread count is pinned for CPU runs only")
def test_a_cpu_model_source_pins_the_thread_count(monkeypatch):
    from vlmrl.models.loading import resolve_model_source

    before = torch.get_num_threads()
    monkeypatch.delenv("VLMRL_CPU_KERNELS", raising=False)
    try:
        torch.set_num_threads(1)
        assert resolve_model_source("org/some-model") == "org/some-model"
        assert torch.get_num_threads() == cpu_numerics.CPU_THREADS
        torch.set_num_threads(1)
        monkeypatch.setenv("VLMRL_CPU_KERNELS", "native")
        resolve_model_source("org/some-model")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
