"""benchmarks/gpu_scaling.py's plan, on the CPU: the jobs for hosts of 1 to 8 GPUs, and every bench command one
the CLI takes. Its GPU-loan scheduler is lab tooling, not the product, and has no tests here
(`gpu_scaling.py rehearse OUT` still rehearses the plan for a pretend 2-GPU host)."""

from __future__ import annotations

import importlib.util
import json
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vlmrl.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_scaling", ROOT / "benchmarks" / "gpu_scaling.py")
gpu_scaling = importlib.util.module_from_spec(spec)
sys.modules["gpu_scaling"] = gpu_scaling  # its dataclass looks its module up
spec.loader.exec_module(gpu_scaling)


@pytest.mark.parametrize("total", [1, 2, 4, 8])
def test_the_plan_covers_the_issue_first_and_fits_the_host(total):
    jobs = gpu_scaling.plan(total)
    names = [j.name for j in jobs]
    assert len(set(names)) == len(names) and all(1 <= j.gpus <= total for j in jobs)
    counts = [c for c in (1, 2, 4, 8) if c <= total]
    tier1 = {j.name for j in jobs if j.tier == 1}
    assert {f"ddp_bf16_g{c}" for c in counts} <= tier1  # DDP at every count the host has
    assert {"eval_prep", "eval_g1", "ddp_32b_g1"} <= tier1
    if total > 1:  # FSDP and ZeRO-2 at the largest count, the 32B under FSDP on two 80 GiB GPUs, eval on all GPUs
        assert {f"fsdp_bf16_g{total}", f"zero2_bf16_g{total}", "fsdp_32b_g2_cap80", f"eval_g{total}"} <= tier1
    assert {f"ddp_4bit_g{c}" for c in counts} <= set(names)
    tiers = [j.tier for j in jobs]
    assert tiers == sorted(tiers)  # what the issue's "done when" needs starts first
    for i, job in enumerate(jobs):  # a job's dependencies start before it
        assert set(job.after) <= set(names[:i])


def test_every_bench_command_is_one_the_cli_takes():
    """The vlmrl part of each job parses (this machine then stops at its missing GPU); a launched job names the
    shipped config of its strategy and one process per GPU."""
    runner = CliRunner()
    jobs = [j for j in gpu_scaling.plan(8) if j.meta["kind"] == "bench"]
    assert {j.meta["strategy"] for j in jobs} == {"ddp", "fsdp", "zero2"}
    for job in jobs:
        words = shlex.split(job.command.replace('"$JOB_OUT"', "out"))
        vlmrl = words[words.index("vlmrl.cli") + 1:]
        assert vlmrl[0] == "bench" and vlmrl[-2:] == ["--out", "out"]
        if job.gpus > 1:
            config = Path(words[words.index("--config_file") + 1])
            assert config.is_file() and config.name.startswith(job.meta["strategy"].replace("zero", "deepspeed_zero"))
            assert words[words.index("--num_processes") + 1] == str(job.gpus) and "--comm-profile" in vlmrl
        result = runner.invoke(app, vlmrl)
        assert result.exit_code == 2 and "needs a CUDA GPU" in result.output, (job.name, result.output)


def _plan(state: Path, jobs: list) -> None:
    for sub in ("jobs", "logs", "out"):
        (state / sub).mkdir(parents=True, exist_ok=True)
    (state / "plan.json").write_text(json.dumps([asdict(j) for j in jobs]))
