"""The CPU kernels are pinned so that a CPU run (the demo) gives the same digits on every x86-64 host with AVX2:
the variables are set on import unless the user set them, torch dispatches to AVX2 in this process, and a CPU
model load pins the thread count."""

from __future__ import annotations

import platform

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
def test_this_process_computes_with_the_pinned_kernels():
    """conftest imports vlmrl before torch computes anything, as the `vlmrl` command does."""
    import vlmrl  # noqa: F401

    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "DEFAULT":
        pytest.skip("this host has no AVX2: it runs torch's default kernels")
    assert capability == "AVX2", cpu_numerics.cpu_kernels()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the thread count is pinned for CPU runs only")
def test_a_cpu_model_source_pins_the_thread_count(monkeypatch):
    from vlmrl.models.loading import resolve_model_source

    before = torch.get_num_threads()
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
