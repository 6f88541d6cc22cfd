"""Where a training starts: from scratch in a clean `train/`, or from a checkpoint that is provably its own.

- **A fresh start is fresh.** `set_aside` moves an earlier `train/` (its checkpoints, `final/`, `best/`,
  records, TensorBoard events) to `train.replaced-<UTC time>/`, so nothing of it can be resumed, exported or
  plotted as the new run's; `vlmrl run --force` deletes such folders with the rest of what vlmrl wrote.
- **A checkpoint is resumed only when its own stamp matches.** `CheckpointStamp` writes
  `checkpoint-N/vlmrl_checkpoint.json` (the training's `checkpoint_fingerprint` and N) as each save completes;
  `resume_point` takes the newest complete checkpoint whose stamp names this training and this step. One of
  another training config is refused (the message names the way out, `--no-resume`); an unstamped one is passed
  over.
- **Never past the end.** A checkpoint beyond `train.max_steps` is not a resume point; with an epoch count
  instead, `CheckpointStamp` refuses at the start of training a resumed step past the last one.
- **Nothing from the discarded steps.** `discard_after` removes the checkpoints past the resume point and a
  kept best step (`best/`) past it or kept by another training.
- **A checkpoint at the last step is the end, not a start.** Killed after its last checkpoint and before
  `train/summary.json`, a training is done: `ends_training` says so and `final_from_checkpoint` makes `final/`
  from that checkpoint, so nothing trains (transformers would take one step past `max_steps` before checking it).
- **A damaged adapter is never resumed.** A checkpoint whose adapter files do not parse
  (`vlmrl.models.loading.adapter_files_problem`) is passed over for the one before it.

A checkpoint killed between transformers' `trainer_state.json` and the stamp (a few milliseconds) has no stamp
and is not resumed: training goes back to the one before it.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

from transformers import TrainerCallback

from vlmrl.common.io import read_json, read_jsonl, write_json_atomic
from vlmrl.models.loading import adapter_files_problem
from vlmrl.run import layout

log = logging.getLogger(__name__)


class ResumeError(RuntimeError):
    """A checkpoint that must not be resumed; the message names it and the way out (the train stage re-raises
    it as its TrainError)."""


def set_aside(run_dir: Path) -> Path | None:
    """Move `train/` to `train.replaced-<UTC time>/` when it holds anything; returns where it went."""
    train_dir = run_dir / layout.TRAIN
    if not train_dir.is_dir() or not any(train_dir.iterdir()):
        return None
    taken = {p.name for p in run_dir.iterdir()}
    target = run_dir / layout.set_aside_name(time.strftime("%Y%m%d-%H%M%S", time.gmtime()), taken)
    train_dir.rename(target)  # one atomic rename: a kill leaves either folder whole
    return target


def resume_point(checkpoints: Path, fingerprint: str, max_steps: int) -> Path | None:
    """The newest `checkpoint-N` to resume: complete, stamped by this training (`fingerprint`, N), N within
    `max_steps` (when positive). None: start from step 0. Raises ResumeError for one of another training."""
    for step, folder in reversed(_numbered(checkpoints)):
        if not _complete(folder):
            continue
        stamp = _stamp(folder)
        if stamp is None:
            log.warning("%s: no stamp (saved by an interrupted save or by another tool); not resumed", folder)
            continue
        recorded = stamp.get("fingerprint")
        if recorded != fingerprint or stamp.get("step") != step:
            raise ResumeError(  # refused, never deleted: it is another training's
                f"{folder}: written by another training config (fingerprint {recorded}, this config's "
                f"{fingerprint}); restore that config to resume it, or pass --no-resume to start over (the earlier "
                "training is then moved aside, not deleted)."
            )
        if max_steps > 0 and step > max_steps:
            continue  # this training's, but past its end: never resumed (discard_after removes it)
        if _holds_adapter(folder) and (damage := adapter_files_problem(folder)):
            log.warning("%s: damaged adapter (%s); not resumed", folder, damage)
            continue
        return folder
    return None


def checkpoints_of(checkpoints: Path) -> list[Path]:
    """The `checkpoint-N` folders under `checkpoints`, in step order."""
    return [folder for _, folder in _numbered(checkpoints)]


def holds_own_checkpoint(checkpoints: Path, fingerprint: str) -> bool:
    """Whether a checkpoint under `checkpoints` is stamped by the training of `fingerprint`."""
    return any((stamp := _stamp(folder)) is not None and stamp.get("fingerprint") == fingerprint
               for folder in checkpoints_of(checkpoints))


def checkpoint_step(folder: Path) -> int:
    """N of `checkpoint-N`."""
    return int(folder.name.removeprefix("checkpoint-"))


def ends_training(checkpoint: Path | None, max_steps: int, metrics: Path | None = None,
                  budget_minutes: float | None = None) -> bool:
    """Whether resuming `checkpoint` has nothing left to train: it is at `max_steps` (when positive), or, given
    `train.time_budget_minutes`, `metrics` (train/metrics.jsonl) shows the budget spent by its step. With an
    epoch count instead, transformers itself trains nothing from the last step."""
    if checkpoint is None:
        return False
    step = checkpoint_step(checkpoint)
    if max_steps > 0 and step >= max_steps:
        return True
    if budget_minutes is None or metrics is None or not metrics.is_file():
        return False
    spent = [r["elapsed_s"] for r in read_jsonl(metrics)
             if r.get("step", 0) <= step and isinstance(r.get("elapsed_s"), (int, float))]
    return bool(spent) and max(spent) >= budget_minutes * 60


TRAINING_STATE = ("optimizer.pt", "scheduler.pt", "scaler.pt", "trainer_state.json", layout.CHECKPOINT_STAMP)


def final_from_checkpoint(checkpoint: Path, final_dir: Path) -> None:
    """Make `final_dir` what `trainer.save_model` writes at the checkpoint's step: the checkpoint's files less the
    optimizer's and trainer's state (a checkpoint is that save plus its state). Written beside and renamed, so a
    kill never leaves a half-copied `final/` (at worst none, which the next run makes again)."""
    if damage := adapter_files_problem(checkpoint):
        raise ResumeError(f"{checkpoint}: damaged adapter ({damage}); pass --no-resume to train again from step 0.")
    partial = final_dir.with_name(final_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for path in checkpoint.iterdir():
        if path.is_file() and path.name not in TRAINING_STATE and not path.name.startswith("rng_state"):
            shutil.copy2(path, partial / path.name)
    shutil.rmtree(final_dir, ignore_errors=True)
    partial.rename(final_dir)


def last_complete_checkpoint(checkpoints: Path) -> Path | None:
    """The newest `checkpoint-N` whose trainer_state.json (written last by transformers) parses, or None.

    transformers writes a checkpoint in place, so a kill mid-save leaves a folder that looks like the newest
    checkpoint but cannot be resumed from. Such folders are removed, so neither this resume nor the trainer's
    checkpoint rotation trusts them.
    """
    for _, folder in reversed(_numbered(checkpoints)):
        if _complete(folder):
            return folder
        log.warning("%s: incomplete checkpoint (interrupted while saving); removing it", folder)
        shutil.rmtree(folder, ignore_errors=True)
    return None


def discard_after(run_dir: Path, step: int, fingerprint: str) -> None:
    """Remove what belongs to steps past `step`, which training is about to redo: later checkpoints, and a kept
    best step after it or kept by another training."""
    for number, folder in _numbered(run_dir / layout.CHECKPOINTS):
        if number > step:
            shutil.rmtree(folder, ignore_errors=True)
    best = run_dir / layout.BEST
    if best.is_dir():
        record = _read_record(best / layout.BEST_RECORD)
        if record.get("fingerprint") != fingerprint or not isinstance(record.get("step"), int) or record["step"] > step:
            shutil.rmtree(best, ignore_errors=True)


class CheckpointStamp(TrainerCallback):
    """Stamps each saved checkpoint with its training, and refuses a resumed step past the last step."""

    def __init__(self, fingerprint: str):
        self.fingerprint = fingerprint

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step > state.max_steps:
            raise ResumeError(
                f"the checkpoint resumed is at step {state.global_step}, past this config's last step "
                f"({state.max_steps}); raise train.num_train_epochs or train.max_steps, or pass --no-resume."
            )

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            write_json_atomic(folder / layout.CHECKPOINT_STAMP, {"fingerprint": self.fingerprint,
                                                                 "step": state.global_step})


def _numbered(checkpoints: Path) -> list[tuple[int, Path]]:
    """`checkpoint-N` folders in step order (numeric: 10 after 4)."""
    if not checkpoints.is_dir():
        return []
    return sorted((int(p.name.removeprefix("checkpoint-")), p) for p in checkpoints.iterdir()
                  if p.is_dir() and p.name.removeprefix("checkpoint-").isdigit())


def _complete(folder: Path) -> bool:
    """transformers writes `trainer_state.json` last: a checkpoint whose state parses was saved whole."""
    try:
        json.loads((folder / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return True


def _holds_adapter(folder: Path) -> bool:
    """PEFT's adapter files are in the folder (a checkpoint saved in shards by FSDP may hold none of them)."""
    return (folder / layout.ADAPTER_CONFIG).exists() or any(folder.glob("adapter_model.*"))


def _stamp(folder: Path) -> dict | None:
    record = _read_record(folder / layout.CHECKPOINT_STAMP)
    return record or None


def _read_record(path: Path) -> dict:
    try:
        record = read_json(path)
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}
