"""Watching a run (issue 20): trackers, validation during training, plain progress lines, a finished run left
alone, files others can read, and `config validate` refusing what training would refuse, in one line each."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vlmrl.cli.app import app
from vlmrl.common.io import read_jsonl
from vlmrl.config.schema import ConfigError, load_config
from vlmrl.pipeline import prepare_with_budget

runner = CliRunner()
# The "done when": the demo policy (its real rewards), 4 steps, validation every 2, TensorBoard on.
SETS = ["data.num_synthetic=40", "data.holdout_size=6", "eval.batch_size=4", "train.max_steps=4",
        "train.per_device_train_batch_size=8", "train.save_steps=2", "train.report_to=[tensorboard]",
        "train.eval_every_steps=2", "train.eval_subset=4"]


def cli(*args: str):
    return runner.invoke(app, list(args))


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_watched_run_leaves_tracker_events_validation_rows_and_reruns_as_a_no_op(
    tmp_path: Path, vlmrl_cache: Path, monkeypatch
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("VLMRL_CACHE", str(vlmrl_cache))
    sets = [*SETS, f"run.output_dir={tmp_path}"]
    config = load_config("demo", sets)
    prepare_with_budget(config, config.run_dir)
    args = [arg for s in sets for arg in ("--set", s)]
    old = os.umask(0o022)
    try:
        first = cli("train", "demo", *args)
        assert first.exit_code == 0, first.output
        train_dir = config.run_dir / "train"

        rows = read_jsonl(train_dir / "validation.jsonl")
        assert [r["step"] for r in rows] == [2, 4]
        for row in rows:
            assert row["n"] == 4
            lo, hi = row["accuracy"]["ci95"]
            assert lo <= row["accuracy"]["mean"] <= hi

        events = list((train_dir / "tensorboard").glob("events.out.tfevents.*"))
        assert events
        acc = EventAccumulator(str(train_dir / "tensorboard"))
        acc.Reload()
        tags = acc.Tags()["scalars"]
        assert "train/reward" in tags and "eval/accuracy" in tags
        assert [e.step for e in acc.Scalars("eval/accuracy")] == [2, 4]
        assert [e.value for e in acc.Scalars("eval/accuracy")] == pytest.approx(
            [r["accuracy"]["mean"] for r in rows])

        # plain progress, one line per step: no control characters, nothing wrapped
        lines = [line for line in first.output.splitlines() if line.startswith("step ")]
        assert [line.split()[1] for line in lines] == ["1/4", "2/4", "3/4", "4/4"]
        assert all("eta" in line and "s/step" in line and "reward" in line and "format" in line for line in lines)
        assert "\x1b" not in first.output and "\r" not in first.output
        summary = json.loads((train_dir / "summary.json").read_text())
        assert summary["provenance"]["vlmrl_version"] and summary["provenance"]["finished_at"]

        before = snapshot(config.run_dir)
        second = cli("train", "demo", *args)
        assert second.exit_code == 0, second.output
        assert "nothing to do" in second.output and "step 5" not in second.output
        assert snapshot(config.run_dir) == before

        report = cli("report", str(config.run_dir))
        assert report.exit_code == 0, report.output
        html = (config.run_dir / "report.html")
        assert html.stat().st_mode & 0o777 == 0o644
        assert (train_dir / "final" / "adapter_model.safetensors").stat().st_mode & 0o777 == 0o644
        assert "Validation during training" in html.read_text()
    finally:
        os.umask(old)


@pytest.mark.parametrize(("override", "named"), [
    ("train.trl_overrides.lr_scheduler_type=cosin", "train.trl_overrides.lr_scheduler_type"),
    ("train.optim=adamw_nope", "train.optim"),
    ("train.max_steps=-3", "train.max_steps"),
    ("train.trl_overrides={no_such_knob: 1}", "no_such_knob"),
    ("train.trl_overrides={learning_rate: 0.1}", "train.learning_rate"),
    # before: accepted, and TRL's weights then silently replaced the rewards: list's
    ("train.trl_overrides={reward_weights: [1.0, 1.0]}", "top-level rewards: list"),
    ("train.trl_overrides={report_to: [wandb]}", "train.report_to"),
])
def test_config_validate_refuses_what_training_would_in_one_line(override: str, named: str) -> None:
    result = runner.invoke(app, ["config", "validate", "demo", "--set", override])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert len([line for line in result.output.splitlines() if named in line]) == 1, result.output


def test_config_validate_accepts_the_presets_with_a_tracker() -> None:
    result = runner.invoke(app, ["config", "validate", "demo", "--set", "train.report_to=[tensorboard]"])
    assert result.exit_code == 0, result.output


def test_a_flat_trl_name_is_pointed_to_its_section() -> None:
    with pytest.raises(ConfigError, match="did you mean 'train.report_to'"):
        from vlmrl.config.schema import validate_config

        validate_config({"report_to": ["tensorboard"]})


def test_report_to_is_not_part_of_any_fingerprint() -> None:
    from vlmrl.run.layout import checkpoint_fingerprint, train_fingerprint

    a, b = load_config("demo"), load_config("demo", ["train.report_to=[tensorboard]"])
    assert a.fingerprint() == b.fingerprint()
    assert train_fingerprint(a) == train_fingerprint(b)
    assert checkpoint_fingerprint(a) == checkpoint_fingerprint(b)


def test_a_missing_tracker_package_is_one_line_naming_what_to_install(monkeypatch) -> None:
    from vlmrl.train import trackers

    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    result = runner.invoke(app, ["config", "validate", "demo", "--set", "train.report_to=[wandb]"])
    assert result.exit_code == 2 and "pip install wandb" in result.output


def test_best_checkpoint_needs_validation() -> None:
    with pytest.raises(ConfigError, match="eval_every_steps"):
        load_config("demo", ["export.checkpoint=best"])


def test_version_and_short_help() -> None:
    version = runner.invoke(app, ["--version"])
    assert version.exit_code == 0 and version.output.startswith("vlmrl ")
    helped = runner.invoke(app, ["train", "-h"], env={"COLUMNS": "200"})
    assert helped.exit_code == 0
    assert "ddp|fsdp|zero2|zero3" in helped.output and "<bool>" not in helped.output
    tiny = runner.invoke(app, ["tiny-model", "-h"], env={"COLUMNS": "200"})
    assert "qwen3_vl|qwen2_5_vl|gemma3" in tiny.output
    evaluate = runner.invoke(app, ["eval", "-h"], env={"COLUMNS": "200"})
    assert "baseline|after" in evaluate.output


def test_the_gspo_dr_grpo_choice_is_explained_once_and_trls_warning_filtered() -> None:
    import logging

    from vlmrl.train.args import gspo_loss_note, quiet_trl_gspo_warning

    assert "loss_type=grpo" in gspo_loss_note(load_config("demo"))
    quiet_trl_gspo_warning()
    quiet_trl_gspo_warning()
    logger = logging.getLogger("trl.trainer.grpo_trainer")
    assert len(logger.filters) == 1
    drop = logging.LogRecord("trl", logging.WARNING, "", 0, "[RANK 0] When using `importance_sampling_level='sequence'`, x",
                             None, None)
    keep = logging.LogRecord("trl", logging.WARNING, "", 0, "something else", None, None)
    assert logger.filters[0].filter(drop) is False and logger.filters[0].filter(keep) is True


def _state(step: int, max_steps: int = 4):
    from transformers import TrainerState

    state = TrainerState()
    state.global_step, state.max_steps = step, max_steps
    return state


def test_train_progress_off_a_terminal_is_one_plain_line_per_step() -> None:
    import io as _io

    from rich.console import Console

    from vlmrl.train.callbacks import TrainProgress

    lines: list[str] = []
    progress = TrainProgress(Console(file=_io.StringIO(), width=40), lines.append)  # not a terminal
    args = type("Args", (), {"num_generations": 2})()
    progress.on_train_begin(args, _state(0), None)
    progress.recorder = type("R", (), {"last_batch": [
        {"rewards": {"format_reward": 2.0}, "degenerate": False},
        {"rewards": {"format_reward": 0.0}, "degenerate": False}]})()
    progress.on_log(args, _state(1), None, logs={"reward": 0.5, "loss": 0.25})
    progress.on_log(args, _state(1), None, logs={"train_runtime": 3.0})  # the end-of-run row: no line
    assert len(lines) == 1
    assert lines[0].startswith("step 1/4 (25%)  eta ") and "reward 0.500  format 0.50  loss 0.2500" in lines[0]


def test_train_progress_on_a_terminal_draws_a_bar_not_lines() -> None:
    import io as _io

    from rich.console import Console

    from vlmrl.train.callbacks import TrainProgress

    out = _io.StringIO()
    lines: list[str] = []
    progress = TrainProgress(Console(file=out, force_terminal=True, width=120), lines.append)
    args = type("Args", (), {"num_generations": 2})()
    progress.on_train_begin(args, _state(0), None)
    progress.on_log(args, _state(2), None, logs={"reward": 0.5})
    progress.on_train_end(args, _state(2), None)
    assert lines == [] and "2/4" in out.getvalue() and "reward 0.500" in out.getvalue()


def test_eval_progress_off_a_terminal_prints_plain_lines() -> None:
    import io as _io

    from rich.console import Console

    from vlmrl.common.progress import EvalProgress

    out = _io.StringIO()
    bar = EvalProgress(Console(file=out, width=30), "baseline", every=3600)
    bar(0, 8, 0)
    bar(4, 8, 40)
    bar(8, 8, 80)
    text = out.getvalue()
    assert "\x1b" not in text and text.splitlines()[-1].startswith("eval baseline: 8/8  elapsed ")
