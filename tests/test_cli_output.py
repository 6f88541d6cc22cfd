"""What the CLI prints: help and tables whole when stdout is a pipe (and folded, never cut, in a narrow
terminal), one line where a stage used to print its whole summary, a preset's note once and only for a preset,
and `--debug` after the command as before it. In process (CliRunner, whose stdout is not a terminal) or through
the `show_*` functions; nothing here trains a model.
"""

from __future__ import annotations

import errno
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from vlmrl.cli import show
from vlmrl.cli.app import app
from vlmrl.config.schema import load_config

runner = CliRunner()
NO_WIDTH = {"COLUMNS": None}  # no width from the environment: stdout alone decides


# ---- widths: the terminal's, or WIDE when piped; a value is never cut -------------------------------------

def test_help_is_whole_when_stdout_is_a_pipe() -> None:
    out = runner.invoke(app, ["train", "--help"], env=NO_WIDTH).output
    assert "<ddp|fsdp|zero2|zero3>" in out  # at 80 columns: `<ddp|fsdp|zero2|zer` / `o3>`
    assert "vlmrl/config/accelerate/" in out and "<output_dir>/<name>" in out
    assert "…" not in out


def test_help_in_a_narrow_terminal_folds_and_cuts_nothing() -> None:
    out = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "80"}).output
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "<ddp|fsdp|zero2|zero3>" in out  # names and types stay whole; the help column folds
    assert "…" not in out


def test_the_console_is_the_terminals_width_or_wide_when_piped(monkeypatch) -> None:
    class Stream:
        def __init__(self, tty: bool) -> None:
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

    monkeypatch.delenv("COLUMNS", raising=False)
    assert show.pipe_width(Stream(True)) is None and show.pipe_width(Stream(False)) == show.WIDE
    monkeypatch.setenv("COLUMNS", "100")
    assert show.pipe_width(Stream(False)) is None  # a width the user set is kept


def test_tables_are_whole_when_piped(capsys, monkeypatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    show.show_preflight(load_config("seed"), {"cuda": {"devices": []}}, 384)
    out = capsys.readouterr().out
    # the title was cut at its table's width (`...-unsl` / `oth-bnb-4bit`)
    assert "memory preflight: unsloth/Qwen3-VL-8B-Instruct-unsloth-bnb-4bit (prompt 384 tokens)" in out
    value = {"files": {"model": "gguf/demo-policy-merged-16bit-q8_0.gguf", "mmproj": "gguf/mmproj-demo-f16.gguf"},
             "read_back": {"problems": [], "blocks": 28}, "max_abs_diff": 0.000123}
    show.show_export_checks({"checks": [{"name": "gguf", "passed": True, "value": value, "detail": "read back"}]})
    out = capsys.readouterr().out
    assert all(word in out for word in str(value).split()), out  # at 80 columns: the file names cut with `…`
    long = {"ids": "q" * 400}  # one word longer than any console: folded onto more lines
    show.show_export_checks({"checks": [{"name": "gguf", "passed": None, "value": long, "detail": "not asked"}]})
    out = capsys.readouterr().out
    assert "…" not in out and out.count("q") == 400


# ---- one line where a stage's whole summary was printed ---------------------------------------------------

def _summary(drops: list[dict]) -> dict:
    return {"fingerprint": "f", "source": "synthetic", "counts": {"input_rows": 40, "train": 32, "holdout": 6,
            "dropped": sum(d["count"] for d in drops)}, "drops": drops, "by_category": {"a": 1},
            "train_by_category": {"bar": 20, "pie": 12}, "holdout_by_category": {"bar": 6},
            "answer_types": {"integer": 38}, "images": {"size": 448}, "comparable_to_published": None, "message": None}


def test_prepare_prints_one_line_naming_the_summary_file(tmp_path: Path, capsys) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "summary.json").write_text(json.dumps(_summary([])))
    show.show_prepared(tmp_path)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"prepared 32 train and 6 held-out items from 40 rows (0 dropped): {tmp_path}/data/summary.json"]


def test_prepare_adds_one_line_per_drop_reason(tmp_path: Path, capsys) -> None:
    drop = {"reason": "missing_image", "count": 2, "example_id": "a.csv:3", "example": "no image", "fix": "map it"}
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "summary.json").write_text(json.dumps(_summary([drop])))
    show.show_prepared(tmp_path)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and "(2 dropped)" in lines[0]
    assert lines[2] == "  missing_image: 2, e.g. a.csv:3: no image -> fix: map it"


def test_train_prints_one_line_naming_the_adapter_and_the_summary(tmp_path: Path, capsys) -> None:
    from vlmrl.train.stage import TrainResult

    summary = {"steps": 2, "train_seconds": 6.3, "train_loss": 0.0123, "lora": {"r": 16}, "notes": ["x"] * 5,
               "provenance": {"vlmrl": "0.1.0"}, "health_warnings": 4}
    show.show_trained(TrainResult(tmp_path / "train" / "final", summary), tmp_path)
    lines = capsys.readouterr().out.splitlines()
    line = f"trained 2 steps in 6 s, loss 0.0123: adapter {tmp_path}/train/final, summary {tmp_path}/train/summary.json"
    assert lines == [line]


# ---- the GSPO note: for a preset named on the command line, once -------------------------------------------

NOTE = "note: train.algorithm=gspo with train.loss_type=dr_grpo"


@pytest.fixture
def stub_run(monkeypatch):
    """`vlmrl run` with its checks and stages stubbed: what the command itself prints, in a second."""
    from vlmrl.pipeline import RunOutcome

    monkeypatch.setattr("vlmrl.cli.app.check_needs", lambda *a, **k: None)
    # the progress display (transformers' callbacks, seconds to import) is handed to the stubbed stages only
    monkeypatch.setitem(sys.modules, "vlmrl.train.callbacks", SimpleNamespace(TrainProgress=lambda *a: None))
    monkeypatch.setattr("vlmrl.cli.app._refuse_untrainable", lambda *a, **k: None, raising=False)
    calls = []

    def run_all(config, **kwargs):
        calls.append(config)
        return RunOutcome(config.run_dir)

    monkeypatch.setattr("vlmrl.pipeline.run_all", run_all)
    return calls


def _run(*args: str):
    return runner.invoke(app, ["run", *args], env=NO_WIDTH)


def test_the_gspo_note_is_said_once_for_a_preset_and_not_for_a_users_config(tmp_path: Path, stub_run) -> None:
    preset = _run("demo", "--set", f"run.output_dir={tmp_path}")
    assert preset.exit_code == 0, preset.output
    assert preset.output.count(NOTE) == 1 and "demo and seed presets keep this on purpose" in preset.output
    note = next(line for line in preset.output.splitlines() if NOTE in line)
    assert note.endswith("(preset gspo-paper).")  # one line
    mine = tmp_path / "mine.yaml"  # gspo and dr_grpo are the defaults: the user's config did not choose them
    mine.write_text(f"run: {{name: mine, output_dir: {tmp_path}}}\nmodel: {{name: tiny:qwen3_vl}}\n")
    own = _run(str(mine))
    assert own.exit_code == 0, own.output
    assert NOTE not in own.output and len(stub_run) == 2


def test_the_gspo_note_is_not_said_when_training_is_done(tmp_path: Path, stub_run, monkeypatch) -> None:
    monkeypatch.setattr("vlmrl.run.layout.is_trained", lambda config, run_dir: True)
    done = _run("demo", "--set", f"run.output_dir={tmp_path}")
    assert done.exit_code == 0, done.output
    assert NOTE not in done.output


# ---- --debug after the command -----------------------------------------------------------------------------

def test_debug_after_the_command_shows_the_traceback(tmp_path: Path, stub_run, monkeypatch) -> None:
    def denied(config, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "x"))

    monkeypatch.setattr("vlmrl.pipeline.run_all", denied)
    plain = _run("demo", "--set", f"run.output_dir={tmp_path}")
    assert plain.exit_code == 2 and f"error: Permission denied: {tmp_path / 'x'}" in plain.output
    for args in (["run", "--debug", "demo"], ["run", "demo", "--debug"], ["--debug", "run", "demo"]):
        shown = runner.invoke(app, [*args, "--set", f"run.output_dir={tmp_path}"], env=NO_WIDTH)
        assert isinstance(shown.exception, PermissionError), (args, shown.output)  # raised: the traceback
    # after `--`, a token is an argument, not the option
    assert runner.invoke(app, ["run", "--", "--debug"], env=NO_WIDTH).exit_code == 2
