"""`vlmrl run`, end to end through the CLI: every stage, every artifact; a second run skips what is done; a
different config in the same run directory is refused without --force.

The quick run uses a tiny random-weight model (in-process, through typer's CliRunner) with a length-based
stand-in for the correctness reward: a random model never earns the real one, so no advantage would be
non-zero, the adapter would stay at zero, and the export check (rightly) fails. The slow test runs the real
default, `vlmrl run` with nothing but an output folder, as a user on a fresh machine would.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.helpers import flat, quick_args, varied_reward
from vlmrl.cli.app import app
from vlmrl.common.io import read_json, read_jsonl
from vlmrl.config.schema import load_config

runner = CliRunner()
STAGES = ("doctor", "prepare", "eval baseline", "train", "eval after", "compare", "export", "report")
RESUMABLE = ("prepare", "eval baseline", "train", "eval after")  # skipped when their outputs match the config
ARTIFACTS = (
    "config.yaml", "env.json", "data/summary.json", "data/train.jsonl", "data/holdout.jsonl",
    "baseline_records.jsonl", "baseline_summary.json", "train/metrics.jsonl", "train/rollouts.jsonl",
    "train/health.jsonl", "train/summary.json", "train/final/adapter_config.json", "after_records.jsonl",
    "after_summary.json", "comparison.json", "adapter/adapter_config.json",
    "adapter/adapter_model.safetensors", "export.json", "report.html",
)  # fmt: skip


def invoke(args: list[str]):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("vlmrl.grading.rewards.correctness_reward", varied_reward)
        return runner.invoke(app, args)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("e2e")
    started = time.perf_counter()
    result = invoke(quick_args(output_dir))
    return result, output_dir / "demo", time.perf_counter() - started


def check_artifacts(run_dir: Path) -> None:
    missing = [name for name in ARTIFACTS if not (run_dir / name).exists()]
    assert missing == []
    holdout = read_jsonl(run_dir / "data" / "holdout.jsonl")
    for stage in ("baseline", "after"):
        records = read_jsonl(run_dir / f"{stage}_records.jsonl")
        assert sorted(r["id"] for r in records) == sorted(i["id"] for i in holdout)
        assert read_json(run_dir / f"{stage}_summary.json")["n"] == len(holdout)
    assert read_json(run_dir / "comparison.json")["n_paired"] == len(holdout)
    export = read_json(run_dir / "export.json")
    assert export["all_passed"] is True, [c for c in export["checks"] if c["passed"] is False]
    assert (run_dir / "report.html").stat().st_size > 1000


def test_run_completes_every_stage_through_the_cli(first_run) -> None:
    result, run_dir, seconds = first_run
    assert result.exit_code == 0, result.output
    out = flat(result.output)
    for stage in STAGES:
        assert f"[run] {stage}" in out, stage
    assert "[skip]" not in out
    assert re.search(rf"done in \d+ s: {re.escape(str(run_dir))}", out)
    check_artifacts(run_dir)
    summary = read_json(run_dir / "train" / "summary.json")
    assert summary["steps"] == 2 and summary["resumed_from_step"] == 0
    # config.yaml is the fully resolved config that produced the run
    config = load_config(str(run_dir / "config.yaml"))
    assert config.model.name == "tiny:qwen3_vl" and config.train.max_steps == 2
    assert seconds < 120


def test_second_invocation_skips_every_stage_already_done(first_run) -> None:
    result, run_dir, _ = first_run
    assert result.exit_code == 0, result.output
    kept = ["baseline_records.jsonl", "after_records.jsonl", "train/summary.json", "train/metrics.jsonl",
            "train/rollouts.jsonl", "data/holdout.jsonl"]  # fmt: skip
    before = {name: (run_dir / name).read_bytes() for name in kept}

    again = invoke(quick_args(run_dir.parent))
    assert again.exit_code == 0, again.output
    out = flat(again.output)
    for stage in RESUMABLE:
        assert f"[skip] {stage}" in out, stage
        assert f"[run] {stage}" not in out, stage
    assert {name: (run_dir / name).read_bytes() for name in kept} == before
    check_artifacts(run_dir)


def test_a_different_config_in_the_same_run_dir_is_refused_without_force(first_run) -> None:
    result, run_dir, _ = first_run
    assert result.exit_code == 0, result.output
    config_yaml = (run_dir / "config.yaml").read_bytes()

    refused = invoke(quick_args(run_dir.parent, "train.learning_rate=0.002"))
    assert refused.exit_code != 0
    out = flat(refused.output)
    assert "--force" in out and str(run_dir) in out
    assert "[run]" not in out  # refused before any stage
    assert (run_dir / "config.yaml").read_bytes() == config_yaml
    check_artifacts(run_dir)


def test_a_bad_override_exits_2_before_anything_runs(tmp_path: Path) -> None:
    result = invoke(quick_args(tmp_path, "train.num_generatons=4"))
    assert result.exit_code == 2
    assert "train.num_generatons" in flat(result.output)
    assert not (tmp_path / "demo").exists()


# ---------------------------------------------------------------------------------------------------------------
# the real default


@pytest.mark.slow
def test_default_run_on_a_fresh_machine(demo_run: dict, vlmrl_cache: Path) -> None:
    result, seconds = demo_run["result"], demo_run["seconds"]
    print(f"vlmrl run (default): {seconds:.0f} s")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    run_dir = demo_run["run_dir"]
    assert re.search(rf"done in \d+ s: {re.escape(str(run_dir))}", flat(result.stdout))
    check_artifacts(run_dir)
    assert read_json(run_dir / "train" / "summary.json")["steps"] == load_config("demo").train.max_steps
    assert any(vlmrl_cache.glob("demo-policy-*/demo_policy.json"))
    assert seconds < 600, f"the default run took {seconds:.0f} s"
