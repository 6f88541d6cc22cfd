"""The worked example a user copies (examples/shapes_quiz): its own data file with mixed answer types and
two-image questions, its own column names and extra column, its own reward file, through `vlmrl run` with the
demo policy. What must hold: every row accounted for, every answer type and the two-image rows kept, and the
user rewards in the training metrics, the records, the comparison and the report."""

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
USER_REWARDS = ("brevity", "hard_bonus")


def _make_data(out: Path) -> Path:
    spec = importlib.util.spec_from_file_location("make_data", EXAMPLE / "make_data.py")
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
