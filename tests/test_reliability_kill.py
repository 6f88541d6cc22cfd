"""Crash safety end to end: a real `vlmrl run` is SIGKILLed at several points, re-run with the same command,
and the run directory must end exactly as an uninterrupted run would: one record per held-out id, one
metrics/health row per step, one rollout group per (step, item), summaries matching their records.

Kill points, each in a fresh process on the same run directory (a point is reached by polling the files,
not by sleeping, so it is hit on a slow or a fast machine alike):
  1. prepare      as soon as the first normalised image is stored;
  2. baseline     once baseline_records.jsonl holds a record but not all of them;
  3. train        once metrics.jsonl has a step past the last checkpoint (those rows must be trimmed);
  4. checkpoint   the moment a new checkpoint folder appears (usually mid-save: trainer_state.json missing);
  5. after        once after_records.jsonl holds a record but not all of them;
  6. export       once comparison.json exists (compare done, export under way).
then one last run to the end.

Why the run ends at export with an error: the model is the tiny random-weight Qwen3-VL (fast enough to
kill six times in a test), which never writes the answer structure, so every reward is 0, every advantage
is 0 and the LoRA B matrices never move; export's `lora_b_nonzero` check then (rightly) refuses the
adapter. A model with reward signal (the demo policy) costs minutes to build on 2 cores. So the test checks
everything up to and including compare, plus that export failed for exactly that reason and no other, and
that the rollouts indeed carried no signal. Should a random completion ever score, the run passes export
and the test accepts that too.

The refusals (a run directory of another config, a holdout that overlaps train) are tested below it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vlmrl.cli.app import app
from vlmrl.common.io import read_jsonl, write_jsonl_atomic
from vlmrl.config.schema import ConfigError, load_config
from vlmrl.pipeline import claim_run_dir, settings_fingerprint
from vlmrl.run import layout
from vlmrl.train.callbacks import trim_records_after
from vlmrl.train.resume import last_complete_checkpoint

MAX_STEPS, SAVE_STEPS, HOLDOUT, GENERATIONS, BATCH = 6, 2, 16, 4, 8
OVERRIDES = [
    "model.name=tiny:qwen3_vl", "data.num_synthetic=48", f"data.holdout_size={HOLDOUT}", "eval.batch_size=4",
    "eval.max_new_tokens=12", "eval.do_sample=false", "train.max_completion_length=12",
    f"train.max_steps={MAX_STEPS}", f"train.save_steps={SAVE_STEPS}", f"train.per_device_train_batch_size={BATCH}",
]
SET_ARGS = [arg for item in OVERRIDES for arg in ("--set", item)]
VLMRL = str(Path(sys.executable).parent / "vlmrl")


def _lines(path: Path) -> int:
    return len(read_jsonl(path)) if path.exists() else 0


def _checkpoints(run: Path) -> set[str]:
    folder = run / "train" / "checkpoints"
    return {p.name for p in folder.glob("checkpoint-*")} if folder.is_dir() else set()


def _kill_points(run: Path) -> list[tuple[str, Callable[[set[str]], bool]]]:
    """(name, predicate on the run directory); the predicate gets the checkpoints present at process start."""
    return [
        ("prepare", lambda _: any((run / "data" / "images").glob("*.png"))),
        ("baseline", lambda _: 0 < _lines(run / "baseline_records.jsonl") < HOLDOUT),
        ("train", lambda _: any(r.get("step", 0) % SAVE_STEPS == 1 and r.get("step", 0) > 1
                                for r in read_jsonl(run / "train" / "metrics.jsonl"))),
        ("checkpoint", lambda before: bool(_checkpoints(run) - before)),
        ("after", lambda _: 0 < _lines(run / "after_records.jsonl") < HOLDOUT),
        ("export", lambda _: (run / "comparison.json").exists()),
    ]


def _run_until(command: list[str], log: Path, predicate: Callable[[], bool], timeout: float) -> tuple[bool, int]:
    """Start `command`; SIGKILL it as soon as `predicate()` holds. Returns (killed, returncode)."""
    with open(log, "ab") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "200"})
        deadline = time.monotonic() + timeout
        try:
            while process.poll() is None and time.monotonic() < deadline:
                try:
                    hit = predicate()
                except (OSError, ValueError):  # a file mid-write: look again
                    hit = False
                if hit:
                    os.kill(process.pid, signal.SIGKILL)
                    return True, process.wait()
                time.sleep(0.01)
        finally:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
                process.wait()
    return False, process.returncode


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_sigkill_at_every_stage_then_rerun_loses_and_duplicates_nothing(tmp_path):
    command = [VLMRL, "run", "demo", "--set", f"run.output_dir={tmp_path}", *SET_ARGS]
    run, log = tmp_path / "demo", tmp_path / "runs.log"
    faults, landed = 0, []
    started = time.perf_counter()
    for name, predicate in _kill_points(run):
        before = _checkpoints(run)
        killed, code = _run_until(command, log, lambda p=predicate, b=before: p(b), timeout=180)
        assert killed, f"kill point {name!r} never reached (exit {code}); see {log}:\n{log.read_text()[-3000:]}"
        faults += 1
        newest = max(_checkpoints(run), key=lambda n: int(n.split("-")[1]), default=None)
        torn = newest and not (run / "train" / "checkpoints" / newest / "trainer_state.json").exists()
        landed.append(f"{name}: killed (newest checkpoint {newest}{', incomplete' if torn else ''})")
    final = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"},
                           timeout=300, check=False)
    output = final.stdout + final.stderr
    seconds = time.perf_counter() - started

    # the last run skipped what was done and resumed the rest
    assert "[skip] prepare" in output and "[skip] eval baseline" in output and "[skip] eval after" in output

    # evaluation: exactly one record per held-out id, in both stages, summaries computed from them
    holdout = [r["id"] for r in read_jsonl(run / "data" / "holdout.jsonl")]
    assert len(holdout) == len(set(holdout)) == HOLDOUT
    lost = 0
    for stage in ("baseline", "after"):
        records = read_jsonl(run / f"{stage}_records.jsonl")
        ids = [r["id"] for r in records]
        lost += len(set(holdout) - set(ids)) + (len(ids) - len(set(ids)))
        assert sorted(ids) == sorted(holdout), f"{stage}: missing or duplicated ids"
        summary = json.loads((run / f"{stage}_summary.json").read_text())
        assert summary["n"] == HOLDOUT
        assert summary["accuracy"]["mean"] == pytest.approx(sum(r["correct"] for r in records) / HOLDOUT)
        assert summary["format_compliance"]["mean"] == pytest.approx(sum(r["format_ok"] for r in records) / HOLDOUT)

    # training: one metrics row and one health row per step 1..max_steps, one rollout group per (step, item)
    train = run / "train"
    steps = list(range(1, MAX_STEPS + 1))
    metrics = read_jsonl(train / "metrics.jsonl")
    assert [r["step"] for r in metrics if "loss" in r] == steps
    assert len([r for r in metrics if "train_runtime" in r]) == 1
    assert [r["step"] for r in read_jsonl(train / "health.jsonl")] == steps
    rollouts = read_jsonl(train / "rollouts.jsonl")
    groups = Counter((r["step"], r["id"]) for r in rollouts)
    assert sorted({step for step, _ in groups}) == steps
    assert set(groups.values()) == {GENERATIONS}, "a (step, item) group was duplicated or cut"
    assert len(rollouts) == MAX_STEPS * BATCH
    lost += MAX_STEPS * BATCH - len(rollouts)
    summary = json.loads((train / "summary.json").read_text())
    assert summary["steps"] == MAX_STEPS and summary["resumed_from_step"] > 0
    # train_loss covers every step, not only those the resumed process ran (logging_steps=1: one loss per step)
    losses = [r["loss"] for r in metrics if "loss" in r]
    assert summary["train_loss"] == pytest.approx(sum(losses) / len(losses))
    for folder in (train / "checkpoints").glob("checkpoint-*"):  # no half-saved checkpoint survives
        assert (folder / "trainer_state.json").is_file(), folder
    assert last_complete_checkpoint(train / "checkpoints").name == f"checkpoint-{MAX_STEPS}"

    # compare paired every item; export ran to its verdict
    comparison = json.loads((run / "comparison.json").read_text())
    assert comparison["n_paired"] == HOLDOUT and not comparison["ids_missing_a_pair"]
    export = json.loads((run / "export.json").read_text())
    failed = [c["name"] for c in export["checks"] if c["passed"] is False]
    if final.returncode == 0:
        assert failed == [] and (run / "report.html").exists()
    else:
        assert failed == ["lora_b_nonzero"] and "export verification failed (lora_b_nonzero)" in output, output
        assert all(r["advantage"] == 0 for r in rollouts), "zero B is only right when no step had signal"

    print(f"\nfaults injected: {faults}; records lost: {lost}; duplicated: 0; seconds: {seconds:.0f}; "
          f"last run exit {final.returncode} (export checks failed: {failed or 'none'})")
    print("\n".join(landed))
    assert lost == 0


# --- resume helpers, without a process to kill ------------------------------------------------------------


def _checkpoint(folder: Path, step: int, *, state: str | None = '{"global_step": 0}') -> Path:
    path = folder / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "adapter_model.safetensors").write_bytes(b"weights")
    if state is not None:
        (path / "trainer_state.json").write_text(state)
    return path


def test_last_complete_checkpoint_skips_and_removes_half_saved_ones(tmp_path):
    _checkpoint(tmp_path, 2)
    good = _checkpoint(tmp_path, 10)  # numeric order: 10 is newer than 4
    _checkpoint(tmp_path, 12, state=None)  # killed before trainer_state.json
    _checkpoint(tmp_path, 14, state='{"global_st')  # killed while writing it
    (tmp_path / "README.md").write_text("not a checkpoint")
    assert last_complete_checkpoint(tmp_path) == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "checkpoint-10", "checkpoint-2"]


def test_last_complete_checkpoint_none(tmp_path):
    assert last_complete_checkpoint(tmp_path / "absent") is None
    _checkpoint(tmp_path, 2, state=None)
    assert last_complete_checkpoint(tmp_path) is None


def test_trim_records_after_drops_rows_past_the_checkpoint_and_the_end_summary(tmp_path):
    train = tmp_path / "train"
    train.mkdir()
    write_jsonl_atomic(train / "metrics.jsonl", [{"step": s, "loss": 0.1} for s in (1, 2, 3)]
                       + [{"step": 3, "train_runtime": 9.0}])
    write_jsonl_atomic(train / "rollouts.jsonl", [{"step": s, "id": "a"} for s in (1, 2, 2, 3)])
    with open(train / "health.jsonl", "w") as handle:
        handle.write('{"step": 1}\n{"step": 2}\n{"step": 3, "war')  # torn by the kill
    trim_records_after(tmp_path, 2)
    assert [r["step"] for r in read_jsonl(train / "metrics.jsonl")] == [1, 2]
    assert [r["step"] for r in read_jsonl(train / "rollouts.jsonl")] == [1, 2, 2]
    assert (train / "health.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    trim_records_after(tmp_path, 0)  # no checkpoint: the restarted run owns every row
    assert read_jsonl(train / "metrics.jsonl") == []


# --- refusals ----------------------------------------------------------------------------------------------


def _cfg(tmp_path: Path, *extra: str):
    return load_config("demo", [*OVERRIDES, f"run.output_dir={tmp_path}", *extra])


def test_run_dir_of_another_config_is_refused_without_force(tmp_path):
    config = _cfg(tmp_path)
    claim_run_dir(config, config.run_dir, force=False)
    (config.run_dir / "baseline_records.jsonl").write_text('{"id": "x"}\n')
    claim_run_dir(config, config.run_dir, force=False)  # the same config may resume
    layout.mark_finished(config.run_dir, settings_fingerprint(config))  # finished: only --force replaces it
    other = _cfg(tmp_path, "train.learning_rate=0.01")
    with pytest.raises(ConfigError) as info:
        claim_run_dir(other, other.run_dir, force=False)
    assert str(config.run_dir) in str(info.value) and "--force" in str(info.value)
    assert (config.run_dir / "baseline_records.jsonl").exists()  # untouched
    assert load_config(str(config.run_dir / "config.yaml")).fingerprint() == config.fingerprint()

    claim_run_dir(other, other.run_dir, force=True)  # --force: the old run is gone, the new config is in
    assert not (config.run_dir / "baseline_records.jsonl").exists()
    assert load_config(str(config.run_dir / "config.yaml")).fingerprint() == other.fingerprint()


def test_run_dir_with_a_damaged_config_yaml_is_refused(tmp_path):
    config = _cfg(tmp_path)
    config.run_dir.mkdir(parents=True)
    (config.run_dir / "config.yaml").write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="--force"):
        claim_run_dir(config, config.run_dir, force=False)


def test_vlmrl_run_refuses_another_configs_run_dir_before_any_work(tmp_path):
    config = _cfg(tmp_path)
    claim_run_dir(config, config.run_dir, force=False)
    layout.mark_finished(config.run_dir, settings_fingerprint(config))  # a finished run
    args = ["run", "demo", *SET_ARGS, "--set", f"run.output_dir={tmp_path}", "--set", "train.max_steps=7"]
    result = CliRunner().invoke(app, args, terminal_width=300)
    assert result.exit_code == 2
    assert "different config" in result.output and "--force" in result.output
    # nothing ran: only the run's mark, its lock file, the config and the stage record are there
    assert sorted(p.name for p in config.run_dir.iterdir()) == [".vlmrl-run", ".vlmrl.lock", "config.yaml",
                                                                "stages.json"]


def test_vlmrl_train_refuses_a_train_set_that_contains_a_holdout_item(tmp_path):
    """A hand-edited train.jsonl that holds a held-out item is refused before any model is loaded."""
    from vlmrl.data.prepare import prepare_data

    config = _cfg(tmp_path)
    prepare_data(config, config.run_dir)  # no token counter: no model needed
    data = config.run_dir / "data"
    leaked = read_jsonl(data / "holdout.jsonl")[0]
    write_jsonl_atomic(data / "train.jsonl", read_jsonl(data / "train.jsonl") + [leaked])
    result = CliRunner().invoke(app, ["train", "demo", *SET_ARGS, "--run-dir", str(config.run_dir)],
                                terminal_width=300)
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert "train and holdout overlap" in message and leaked["id"] in message
    assert "vlmrl prepare" in message  # and how to fix it
    assert not (config.run_dir / "base-model").exists() and not (config.run_dir / "train").exists()
