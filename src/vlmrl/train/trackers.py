"""Experiment trackers (`train.report_to`): TensorBoard, Weights & Biases, trackio, fed by transformers' own
integration callbacks, which we build here rather than through `GRPOConfig.report_to`.

Building them ourselves lets us choose where TensorBoard writes (`train/tensorboard/`, beside the other records,
not a dated folder under the checkpoints), run W&B offline unless the user configured it, and hand the same
callbacks the validation rows (`vlmrl.train.validation`) so trackers show held-out numbers next to the rewards.
A tracker whose package is missing is a one-line error naming what to pip install, found before any model loads.
A resumed run tells TensorBoard to drop what it logged past the checkpoint it resumes from (`resume_trackers`),
so the re-done steps are not plotted twice.

Left out: tracker-specific options (projects, entities, tags); set them through each tool's environment
variables (WANDB_PROJECT, TRACKIO_SPACE_ID, ...), which these callbacks read.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

# tracker -> (module that must import, what to pip install)
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "trackio": ("trackio", "trackio")}
TENSORBOARD_DIR = "tensorboard"  # under train/


def active(report_to: list[str]) -> list[str]:
    """The trackers to run (`none` means none).

    >>> active(["none"]), active(["tensorboard"])
    ([], ['tensorboard'])
    """
    return [name for name in report_to if name != "none"]


class TrackerError(RuntimeError):
    """A requested tracker cannot run; the message says what to install."""


def missing_packages(report_to: list[str]) -> list[str]:
    """One line per requested tracker whose package is not installed.

    >>> missing_packages([])
    []
    """
    lines = []
    for name in active(report_to):
        module, package = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            lines.append(f"train.report_to={name}: the {package} package is not installed; pip install {package}")
    return lines


def offline_environment(report_to: list[str], train_dir: Path, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Environment defaults that keep trackers offline and inside the run, unless the user set them.

    W&B goes offline when neither WANDB_MODE nor an API key is set (the run syncs later with `wandb sync`);
    trackio is local unless TRACKIO_SPACE_ID names a Space, so it needs nothing.

    >>> offline_environment(["wandb"], Path("r/train"), {})
    {'WANDB_MODE': 'offline', 'WANDB_DIR': 'r/train'}
    >>> offline_environment(["wandb"], Path("r/train"), {"WANDB_MODE": "online"})
    {'WANDB_DIR': 'r/train'}
    """
    env = os.environ if environ is None else environ
    wanted: dict[str, str] = {}
    if "wandb" in report_to:
        if "WANDB_MODE" not in env and "WANDB_API_KEY" not in env:
            wanted["WANDB_MODE"] = "offline"
        if "WANDB_DIR" not in env:
            wanted["WANDB_DIR"] = str(train_dir)
    return wanted


def build_tracker_callbacks(report_to: list[str], train_dir: Path) -> list[Any]:
    """The transformers callbacks for `report_to`, TensorBoard writing to `train_dir/tensorboard`."""
    problems = missing_packages(report_to)
    if problems:
        raise TrackerError(problems[0])
    os.environ.update(offline_environment(report_to, train_dir))
    callbacks: list[Any] = []
    for name in active(report_to):
        if name == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            from transformers.integrations import TensorBoardCallback

            callbacks.append(TensorBoardCallback(tb_writer=_LazyWriter(SummaryWriter, train_dir / TENSORBOARD_DIR)))
        elif name == "wandb":
            from transformers.integrations import WandbCallback

            callbacks.append(WandbCallback())
        elif name == "trackio":
            from transformers.integrations import TrackioCallback

            callbacks.append(TrackioCallback())
    return callbacks


def resume_trackers(callbacks: list[Any], step: int) -> None:
    """Training continues after optimizer step `step`: TensorBoard hides the points an earlier process logged
    past it (`SummaryWriter(purge_step=...)`), as `trim_records_after` drops those rows from the records.
    W&B and trackio start a new run of their own on each process, so they have nothing to drop."""
    for callback in callbacks:
        writer = getattr(callback, "tb_writer", None)
        if isinstance(writer, _LazyWriter):
            writer.purge_step = step + 1


class _LazyWriter:
    """A SummaryWriter opened on first use, so ranks other than 0 (which never log) create no event file."""

    def __init__(self, factory: Any, log_dir: Path):
        self._factory = factory
        self._log_dir = log_dir
        self._writer: Any = None
        self.purge_step: int | None = None  # set before training by resume_trackers

    def __getattr__(self, name: str) -> Any:
        if self._writer is None:
            self._writer = self._factory(log_dir=str(self._log_dir), purge_step=self.purge_step)
        return getattr(self._writer, name)


def log_to_trackers(callbacks: list[Any], args: Any, state: Any, control: Any, logs: dict[str, float]) -> None:
    """Send extra scalars (validation rows) to the tracker callbacks only, at the current step.

    Going through each callback's `on_log` (not `trainer.log`) keeps them out of metrics.jsonl and the health
    monitor, which have records of their own."""
    for callback in callbacks:
        callback.on_log(args, state, control, logs=dict(logs))
