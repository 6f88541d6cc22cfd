"""benchmarks/gpu_scaling.py, issue 41's plan, on the CPU: the jobs for hosts of 1 to 8 GPUs, every bench command
one the CLI takes, the scheduler (GPUs shared out, dependencies, timeouts), and the whole plan rehearsed for a
pretend 2-GPU host (the evaluation jobs for real with 2 gloo processes, the bench jobs by a stand-in), combined."""

from __future__ import annotations

import importlib.util
import json
import shlex
import shutil
import sys
import tarfile
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


def test_the_scheduler_shares_out_gpus_keeps_order_and_skips_what_cannot_run(tmp_path, monkeypatch):
    Job = gpu_scaling.Job
    monkeypatch.setenv("VLMRL_SCALING_STATE", str(tmp_path))
    record = 'echo "$CUDA_VISIBLE_DEVICES $(date +%s.%N)" > "$JOB_OUT/gpus"'
    jobs = [Job("two", 2, 1, f"{record}; sleep 2", 1), Job("one", 1, 1, record, 1),
            Job("after_two", 3, 1, record, 1, after=["two"]),
            Job("fails", 1, 1, "exit 3", 1), Job("after_fails", 1, 1, record, 1, after=["fails"]),
            Job("needs", 1, 1, record, 1, needs="no_such_module_here"),
            Job("slow", 1, 1, "sleep 60", 1, timeout_minutes=0.05)]
    _plan(tmp_path, jobs)
    gpu_scaling.schedule(tmp_path, 3)
    rec = {j.name: json.loads((tmp_path / "jobs" / f"{j.name}.json").read_text()) for j in jobs}
    seen = {name: (tmp_path / "out" / name / "gpus").read_text().split() for name in ("two", "one", "after_two")}
    assert seen["two"][0] == "0,1" and seen["one"][0] == "2"  # side by side, on different GPUs
    assert seen["after_two"][0] == "0,1,2" and float(seen["after_two"][1]) > float(seen["two"][1]) + 1.5
    assert (rec["fails"]["status"], rec["fails"]["rc"]) == ("ended", 3)
    assert rec["after_fails"]["status"] == "skipped" and "fails" in rec["after_fails"]["error"]
    assert rec["needs"]["status"] == "skipped" and "not installed" in rec["needs"]["error"]
    assert rec["slow"]["rc"] != 0 and "timed out" in rec["slow"]["error"]
    assert all(r.get("status") in ("ended", "skipped") for r in rec.values())


def test_the_plan_rehearsed_on_the_cpu_gives_a_record(tmp_path, monkeypatch):
    """Evaluation on 2 gloo processes gives the one-process records; the bench stand-ins' rows are combined with
    efficiency, prediction and communication share; a later failed run of a job does not replace a good one."""
    monkeypatch.setenv("VLMRL_SCALING_STATE", str(tmp_path / "state"))
    out = tmp_path / "out"
    assert gpu_scaling.rehearse(out) == 0
    assert sorted(p.name for p in out.iterdir()) == ["h200_multi_gpu.json", "h200_multi_gpu.md", "scaling.tar.gz"]
    result = json.loads((out / "h200_multi_gpu.json").read_text())
    assert result["evaluation"]["ids_equal"] and result["evaluation"]["identical"] == 32  # 8 batches of 4
    rows = {r["job"]: r for r in result["rows"]}
    assert set(rows) >= {"ddp_bf16_g1", "ddp_bf16_g2", "fsdp_bf16_g2", "zero2_bf16_g2", "fsdp_32b_g2_cap80"}
    assert rows["ddp_bf16_g1"]["efficiency"] == 1.0 and 0.9 < rows["ddp_bf16_g2"]["efficiency"] < 1.0
    assert rows["ddp_bf16_g2"]["comm_share"] > rows["ddp_bf16_g2"]["exposed_share"] > 0
    assert rows["fsdp_32b_g2_cap80"]["predicted_peak_gib"] < rows["ddp_32b_g1"]["predicted_peak_gib"]
    # the code that ran, named also where there is no git (a digest of src/vlmrl; others may edit it meanwhile)
    assert len(result["meta"]["source_digest"]) == 12 and result["meta"]["not_run"] == []
    assert "32 of 32" in (out / "h200_multi_gpu.md").read_text()

    first, second = tmp_path / "first", tmp_path / "second"
    for folder in (first, second):
        with tarfile.open(out / "scaling.tar.gz") as tar:
            tar.extractall(folder, filter="data")
    failed = json.loads((second / "jobs" / "ddp_bf16_g2.json").read_text()) | {"rc": 1}
    (second / "jobs" / "ddp_bf16_g2.json").write_text(json.dumps(failed))
    shutil.rmtree(second / "out" / "ddp_bf16_g2")
    again = gpu_scaling.combine([first, second], tmp_path / "combined" / "h200_multi_gpu")
    assert {r["job"]: r for r in again["rows"]}["ddp_bf16_g2"]["samples_per_second"] > 0


def test_start_selects_by_pattern_with_dependencies_and_leaves_out_what_ended_well(tmp_path):
    jobs = gpu_scaling.plan(2)
    names = lambda chosen: [j.name for j in chosen]
    assert names(gpu_scaling.select(jobs, tmp_path, "eval_g*", None)) == ["eval_prep", "eval_g1", "eval_g2"]
    assert "ddp_4bit_g1" not in names(gpu_scaling.select(jobs, tmp_path, None, "*4bit*"))
    gpu_scaling.write_json(tmp_path / "jobs" / "ddp_bf16_g1.json", {"job": "ddp_bf16_g1", "rc": 0})
    gpu_scaling.write_json(tmp_path / "jobs" / "ddp_bf16_g2.json", {"job": "ddp_bf16_g2", "rc": 1})
    assert names(gpu_scaling.select(jobs, tmp_path, "ddp_bf16_*", None)) == ["ddp_bf16_g2"]
