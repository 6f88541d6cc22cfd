"""torch.compile's caches under vlmrl's cache folder (vlmrl.engine.rollout.compile_cache): where they go, who wins, and that a
second process really reads what the first wrote (a real CPU compile through inductor)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vlmrl.engine.rollout.compile_cache import INDUCTOR_ENV, TRITON_ENV, use_compile_cache


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    monkeypatch.delenv(INDUCTOR_ENV, raising=False)
    monkeypatch.delenv(TRITON_ENV, raising=False)
    monkeypatch.setenv("VLMRL_CACHE", str(tmp_path / "vlmrl-cache"))
    monkeypatch.delenv("VLMRL_CPU_KERNELS", raising=False)  # the pinned kernels, as a user runs vlmrl
    return tmp_path


def test_the_hosts_own_kernels_compile_into_a_folder_of_their_own(clean_env, monkeypatch):
    """Inductor's cache does not tell AVX2 builds from the host's own: a kernel built under one aborted a process
    running the other, so each gets its folder."""
    monkeypatch.setenv("VLMRL_CPU_KERNELS", "native")
    use_compile_cache()
    assert os.environ[INDUCTOR_ENV] == str(clean_env / "vlmrl-cache" / "compile-native" / "inductor")


def test_default_goes_under_the_vlmrl_cache(clean_env):
    cache = use_compile_cache()
    root = clean_env / "vlmrl-cache" / "compile"
    assert os.environ[INDUCTOR_ENV] == str(root / "inductor")
    assert os.environ[TRITON_ENV] == str(root / "triton")
    assert (cache.source, cache.cold, cache.files_at_start) == ("vlmrl", True, 0)


def test_the_users_variables_are_kept(clean_env, monkeypatch):
    mine = clean_env / "mine"
    (mine / "fxgraph").mkdir(parents=True)
    (mine / "fxgraph" / "entry").write_text("x")
    monkeypatch.setenv(INDUCTOR_ENV, str(mine))
    cache = use_compile_cache()
    assert os.environ[INDUCTOR_ENV] == str(mine)  # untouched
    assert os.environ[TRITON_ENV] == str(clean_env / "vlmrl-cache" / "compile" / "triton")  # only the unset one
    assert (cache.source, cache.cold, cache.files_at_start) == ("user env", False, 1)


def test_an_explicit_folder_wins_and_reports_warm(clean_env, monkeypatch):
    monkeypatch.setenv(INDUCTOR_ENV, str(clean_env / "mine"))
    folder = clean_env / "bench-cache"
    (folder / "triton" / "0").mkdir(parents=True)
    (folder / "triton" / "0" / "kernel.so").write_text("x")
    cache = use_compile_cache(folder)
    assert cache.inductor_dir == str(folder.resolve() / "inductor")
    assert (cache.source, cache.cold, cache.files_at_start) == ("explicit", False, 1)


SCRIPT = textwrap.dedent("""
    import json, sys
    from vlmrl.engine.rollout.compile_cache import use_compile_cache
    cache = use_compile_cache()  # before torch compiles anything
    import torch
    from torch._dynamo.utils import counters
    torch.compile(lambda x: torch.sin(x) * 2 + 1)(torch.randn(8))
    print(json.dumps({**cache.as_dict(), "hits": counters["inductor"]["fxgraph_cache_hit"]}))
""")


@pytest.mark.slow
def test_a_second_process_compiles_from_the_cache(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (INDUCTOR_ENV, TRITON_ENV, "VLMRL_CPU_KERNELS")}
    env["VLMRL_CACHE"] = str(tmp_path / "vlmrl-cache")

    def run() -> dict:
        out = subprocess.run([sys.executable, "-c", SCRIPT], check=False, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert (first["cold"], first["hits"]) == (True, 0)
    assert (second["cold"], second["hits"]) == (False, 1)  # inductor's FX graph cache served the compile
    assert Path(first["inductor_dir"]) == tmp_path / "vlmrl-cache" / "compile" / "inductor"
    assert any((tmp_path / "vlmrl-cache" / "compile" / "inductor").rglob("*"))
