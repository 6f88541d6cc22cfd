"""The worked examples a user copies, each through `vlmrl run`.

examples/shapes_quiz: its own data file with mixed answer types and two-image questions, its own column names
and extra column, its own reward file, with the demo policy. What must hold: every row accounted for, every
answer type and the two-image rows kept, and the user rewards in the training metrics, the records, the
comparison and the report.

examples/count_think: EasyR1's Parquet layout (train/test files, `images` as {bytes, path} records, `problem`
with <image>), the `think` contract and `trl.rewards` functions as they are, on a tiny random model. What must
hold: the held-out set is the file's own test split, LaTeX answers kept as expressions, TRL's accuracy_reward
scoring a correct well-formed completion 1.0 at the check, and every reward's before/after row in
comparison.json."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vlmrl.cli.app import app
from vlmrl.common.io import read_json, read_jsonl

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "shapes_quiz"
THINK_EXAMPLE = EXAMPLE.parent / "count_think"
USER_REWARDS = ("brevity", "hard_bonus")


def _make_data(out: Path, example: Path = EXAMPLE) -> Path:
    spec = importlib.util.spec_from_file_location("make_data", example / "make_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(out)


@pytest.mark.slow
def test_the_worked_example_runs_and_shows_the_user_rewards(tmp_path: Path, vlmrl_cache: Path, monkeypatch) -> None:
    monkeypatch.setenv("VLMRL_CACHE", str(vlmrl_cache))
    task = tmp_path / "shapes_quiz"  # a user's copy of the example folder
    task.mkdir()
    for name in ("config.yaml", "rewards.py"):
        shutil.copy(EXAMPLE / name, task / name)
    data = _make_data(task / "data")
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert {r["kind"] for r in rows} == {"integer", "float", "choice", "expression", "text"}
    assert any(len(r["pictures"]) == 2 for r in rows)

    monkeypatch.chdir(tmp_path)  # the config's relative paths resolve beside it, not here
    result = CliRunner().invoke(app, ["run", str(task / "config.yaml"), "--set", f"run.output_dir={tmp_path / 'runs'}",
                                      "--set", "train.max_steps=3"], terminal_width=200)
    assert result.exit_code == 0, result.output
    run = tmp_path / "runs" / "shapes-quiz"

    summary = read_json(run / "data" / "summary.json")["counts"]
    assert summary["input_rows"] == len(rows) == summary["train"] + summary["holdout"] + summary["dropped"]
    kept = read_jsonl(run / "data" / "train.jsonl") + read_jsonl(run / "data" / "holdout.jsonl")
    assert {k["answer_type"] for k in kept} == {"integer", "float", "choice", "expression", "text"}
    assert any(len(k["images"]) == 2 and len(k["image_sha256"]) == 2 for k in kept)
    assert all("level" in k["extra"] for k in kept)  # the file's extra column, kept for the rewards

    metrics = [r for r in read_jsonl(run / "train" / "metrics.jsonl") if "reward" in r]
    assert metrics and all(f"rewards/{name}/mean" in metrics[0] for name in USER_REWARDS)
    for stage in ("baseline", "after"):
        records = read_jsonl(run / f"{stage}_records.jsonl")
        assert len(records) == summary["holdout"]
        for record in records:
            words = len(record["completion"].split())
            assert record["rewards"]["brevity"] == pytest.approx(max(-1.0, -0.05 * max(0, words - 24)))
    levels = {k["id"]: k["extra"]["level"] for k in kept}
    for record in read_jsonl(run / "after_records.jsonl"):  # None (not scored) below level 3, as the file says
        assert (record["rewards"]["hard_bonus"] is None) == (levels[record["id"]] != 3)
    comparison = read_json(run / "comparison.json")
    for name in USER_REWARDS:
        assert {"before", "after", "delta", "delta_ci95"} <= set(comparison["metrics"][name])
    report = (run / "report.html").read_text()
    assert all(name in report for name in USER_REWARDS)


@pytest.mark.slow
def test_the_easyr1_example_runs_with_trl_rewards_under_the_think_contract(tmp_path: Path, monkeypatch) -> None:
    task = tmp_path / "count_think"  # a user's copy of the example folder
    task.mkdir()
    for name in ("config.yaml", "rewards.py"):
        shutil.copy(THINK_EXAMPLE / name, task / name)
    _make_data(task / "data", THINK_EXAMPLE)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["run", str(task / "config.yaml"), "--set", f"run.output_dir={tmp_path / 'runs'}",
                                      "--set", "train.max_steps=1", "--set", "eval.max_new_tokens=16"],
                             terminal_width=200)
    assert result.exit_code == 0, result.output
    run = tmp_path / "runs" / "count-think"

    summary = read_json(run / "data" / "summary.json")
    assert summary["counts"] == {"input_rows": 32, "train": 24, "holdout": 8, "dropped": 0}
    assert summary["answer_types"]["expression"] > 0  # the \\frac answers, read off the gold
    assert summary["comparable_to_published"] is None  # not MathVista: no claim either way
    holdout = read_jsonl(run / "data" / "holdout.jsonl")
    assert {h["id"].split(":")[0] for h in holdout} == {"test.parquet"}  # the file's own split, named by file and row
    assert all("<think>" in h["prompt"] and "\\boxed{}" in h["prompt"] for h in holdout)

    check = read_json(run / "baseline_summary.json")["reward_check"]  # TRL's rewards, unchanged, at the check
    assert check["accuracy_reward"]["well_formed"] == 1.0 and check["think_format_reward"]["well_formed"] == 1.0
    assert check["accuracy_reward"]["empty"] == 0.0
    metrics = [r for r in read_jsonl(run / "train" / "metrics.jsonl") if "reward" in r]
    assert metrics and "rewards/accuracy_reward/mean" in metrics[0]
    comparison = read_json(run / "comparison.json")["metrics"]
    for name in ("accuracy_reward", "think_format_reward", "format_reward", "varied_tokens"):
        assert {"before", "after", "delta", "delta_ci95"} <= set(comparison[name])
    assert {r["contract"] for r in read_jsonl(run / "after_records.jsonl")} == {"think"}
    card = (run / "adapter" / "README.md").read_text()
    assert "https://github.com/)" not in card and "tiny:qwen3_vl" in card and "`data`" in card
