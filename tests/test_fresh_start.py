"""A fresh start is fresh, and a resume resumes only its own training (issue 37).

Before: `vlmrl train --no-resume` left the old run's checkpoints and `train/best/`; killed after its first
checkpoint, a plain `vlmrl train` then resumed the *old* run's last checkpoint (`step 7/6 (117%)`, steps lost from
metrics.jsonl), and `export.checkpoint: best` exported the old run's adapter. TensorBoard plotted the re-done
steps of a resumed run twice.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers import quick_config
from vlmrl.common.io import read_json, read_jsonl, write_json_atomic
from vlmrl.data.prepare import prepare_data
from vlmrl.run import layout
from vlmrl.run.claim import ensure_marked, remove_vlmrl_outputs
from vlmrl.train.resume import CheckpointStamp, ResumeError, discard_after, resume_point
from vlmrl.train.stage import train

# the small run (tests/helpers.py) for the demo preset's number of steps, validating 2 items after every step
# and keeping the best one
VALIDATED = (
    "model.name=tiny:qwen3_vl", "data.num_synthetic=40", "data.holdout_size=6", "train.max_completion_length=12",
    "train.per_device_train_batch_size=8", "train.save_steps=1",
    "train.eval_every_steps=1", "train.eval_subset=2", "eval.max_new_tokens=8", "export.checkpoint=best",
)


def steps(path: Path) -> list[int]:
    return [row["step"] for row in read_jsonl(path) if "train_runtime" not in row]


def test_no_resume_moves_the_old_training_aside_and_a_resume_continues_only_the_new_one(tmp_path):
    two = quick_config(tmp_path, "train.max_steps=2", base=VALIDATED)
    prepare_data(two, two.run_dir)
    run_dir = two.run_dir
    train(two, run_dir)
    said: list[str] = []
    # the new run, as if killed after its first checkpoint
    one = quick_config(tmp_path, "train.max_steps=1", base=VALIDATED)
    train(one, run_dir, resume=False, console_callback=said.append)

    (aside,) = [p for p in run_dir.iterdir() if p.name.startswith(layout.SET_ASIDE)]
    assert [line for line in said if "moved aside" in line] == [
        f"train: starting over; the earlier training was moved aside to {aside}"]
    assert (aside / "checkpoints" / "checkpoint-2").is_dir() and steps(aside / "metrics.jsonl") == [1, 2]
    assert sorted(p.name for p in (run_dir / layout.CHECKPOINTS).glob("checkpoint-*")) == ["checkpoint-1"]
    best = layout.best_checkpoint(run_dir, one)
    assert best["step"] == 1 and best["fingerprint"] == layout.checkpoint_fingerprint(one)

    result = train(two, run_dir)  # a plain `vlmrl train`: the new run's checkpoint, not the old run's step 2
    assert (result.summary["resumed_from_step"], result.summary["steps"]) == (1, 2)
    assert steps(run_dir / layout.METRICS) == [1, 2] and steps(run_dir / layout.VALIDATION) == [1, 2]
    stamp = read_json(run_dir / layout.CHECKPOINTS / "checkpoint-2" / layout.CHECKPOINT_STAMP)
    assert stamp == {"fingerprint": layout.checkpoint_fingerprint(two), "step": 2}


# --- which checkpoint is resumed ---------------------------------------------------------------------------------


def checkpoint(checkpoints: Path, step: int, stamp: dict | None = None, *, complete: bool = True) -> Path:
    folder = checkpoints / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    if complete:
        write_json_atomic(folder / "trainer_state.json", {"global_step": step})
    if stamp is not None:
        write_json_atomic(folder / layout.CHECKPOINT_STAMP, stamp)
    return folder


def test_a_checkpoint_is_resumed_only_under_its_own_stamp_and_never_past_max_steps(tmp_path):
    checkpoints = tmp_path / layout.CHECKPOINTS
    for step in (1, 2, 3, 4):
        checkpoint(checkpoints, step, {"fingerprint": "A", "step": step})
    checkpoint(checkpoints, 5)  # complete but unstamped: killed between transformers' save and the stamp
    checkpoint(checkpoints, 6, {"fingerprint": "A", "step": 6}, complete=False)  # killed mid-save
    assert resume_point(checkpoints, "A", 0) == checkpoints / "checkpoint-4"
    assert resume_point(checkpoints, "A", 3) == checkpoints / "checkpoint-3"  # 4 lies past max_steps=3
    discard_after(tmp_path, 3, "A")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    with pytest.raises(ResumeError, match=r"checkpoint-3: written by another training config .*--no-resume"):
        resume_point(checkpoints, "B", 0)
    write_json_atomic(checkpoints / "checkpoint-3" / layout.CHECKPOINT_STAMP, {"fingerprint": "A", "step": 2})
    with pytest.raises(ResumeError):  # a stamp for another step: a copied or renamed folder
        resume_point(checkpoints, "A", 0)


def test_an_unstamped_checkpoint_is_not_resumed(tmp_path):
    checkpoints = tmp_path / layout.CHECKPOINTS
    checkpoint(checkpoints, 2)
    assert resume_point(checkpoints, "A", 0) is None


def test_a_resumed_step_past_the_last_one_is_refused_before_training(tmp_path):
    """With an epoch count instead of max_steps, the last step is known only when training begins."""
    stamp = CheckpointStamp("A")
    with pytest.raises(ResumeError, match="step 7, past this config's last step \\(6\\)"):
        stamp.on_train_begin(None, SimpleNamespace(global_step=7, max_steps=6), None)
    stamp.on_train_begin(None, SimpleNamespace(global_step=6, max_steps=6), None)  # killed before the summary
    args = SimpleNamespace(output_dir=str(tmp_path))
    stamp.on_save(args, SimpleNamespace(global_step=3, is_world_process_zero=True), None)
    assert read_json(tmp_path / "checkpoint-3" / layout.CHECKPOINT_STAMP) == {"fingerprint": "A", "step": 3}


# --- best/ ---------------------------------------------------------------------------------------------------


def keep_best(run_dir: Path, record: dict) -> None:
    best = run_dir / layout.BEST
    best.mkdir(parents=True, exist_ok=True)
    (best / layout.ADAPTER_CONFIG).write_text("{}")
    write_json_atomic(best / layout.BEST_RECORD, record)


def test_a_best_step_of_another_training_is_ignored_and_one_past_the_resume_point_is_dropped(tmp_path):
    from vlmrl.export.stage import ExportError, _chosen_checkpoint

    config = quick_config(tmp_path, base=VALIDATED)
    run_dir = tmp_path / "run"
    mine = {"step": 2, "metric": "accuracy", "value": 0.5, "fingerprint": layout.checkpoint_fingerprint(config)}
    for stale in ({**mine, "fingerprint": "another"}, {k: v for k, v in mine.items() if k != "fingerprint"}):
        keep_best(run_dir, stale)
        assert layout.best_checkpoint(run_dir) == stale and layout.best_checkpoint(run_dir, config) is None
        with pytest.raises(ExportError, match="kept by another training config"):
            _chosen_checkpoint(config, run_dir)  # before: exported it, and export.json said all_passed
    keep_best(run_dir, mine)
    assert _chosen_checkpoint(config, run_dir)["step"] == 2
    discard_after(run_dir, 2, mine["fingerprint"])
    assert layout.best_checkpoint(run_dir, config) == mine  # at the resume point: kept
    discard_after(run_dir, 1, mine["fingerprint"])
    assert not (run_dir / layout.BEST).exists()  # made by steps training is about to redo


def test_force_removes_trainings_moved_aside(tmp_path):
    run_dir = tmp_path / "run"
    ensure_marked(run_dir)
    (run_dir / layout.set_aside_name("20260101-000000") / "checkpoints").mkdir(parents=True)
    (run_dir / "notes.txt").write_text("mine")
    assert remove_vlmrl_outputs(run_dir) == ["train.replaced-20260101-000000"]
    assert sorted(p.name for p in run_dir.iterdir()) == [".vlmrl-run", "notes.txt"]


# --- TensorBoard ---------------------------------------------------------------------------------------------


def test_tensorboard_has_no_duplicate_points_after_a_resume(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from vlmrl.train.trackers import build_tracker_callbacks, resume_trackers

    def log(steps: list[int], resumed_after: int | None) -> None:
        (callback,) = build_tracker_callbacks(["tensorboard"], tmp_path)
        if resumed_after is not None:
            resume_trackers([callback], resumed_after)
        for step in steps:
            callback.on_log(None, SimpleNamespace(global_step=step, is_world_process_zero=True), None,
                            logs={"loss": float(step)})
        callback.tb_writer.close()

    log([1, 2, 3, 4], None)
    time.sleep(1.1)  # event files are named by the second they were opened in
    log([3, 4, 5], resumed_after=2)  # killed after step 4, resumed from checkpoint-2
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [point.step for point in events.Scalars("train/loss")] == [1, 2, 3, 4, 5]
