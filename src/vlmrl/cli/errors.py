"""How the `vlmrl` command line fails: one literal line and an exit code, never a traceback for what the user
can fix (a bad config, a folder in use, a full disk, a read-only folder, a damaged records file); `--debug`
shows the traceback instead.

Kept apart from `cli.py`, which holds the commands. Left out: catching programming errors (anything not named
here still ends in a traceback, which is what a bug report needs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn, TypeVar

import typer
from rich.console import Console
from rich.text import Text
from typer.core import TyperGroup

T = TypeVar("T")
console = Console()  # rich finds sys.stdout when it writes, so this and cli's console share the stream
_state = {"debug": False}


def set_debug(on: bool) -> None:
    _state["debug"] = on


def debug() -> bool:
    """Whether the global --debug option was given (show tracebacks, do not turn errors into one line)."""
    return _state["debug"]


def fail(message: str, code: int = 1) -> NoReturn:
    # Text, not markup: a message quoting a path or key with brackets ([v2], [/x]) prints as written
    console.print(Text.assemble(("error:", "red"), " ", message), highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def describe(exc: BaseException) -> str:
    """One line for an OS error or a damaged file: the cause and the file it concerns.

    >>> describe(PermissionError(13, "Permission denied", "/runs/x"))
    'Permission denied: /runs/x'
    """
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename is not None else exc.strerror
    return " ".join(str(exc).split()) or type(exc).__name__


class Commands(TyperGroup):
    """The top-level command group: an OS error or a damaged file met anywhere in a command becomes one line
    and exit 2 (the traceback only with --debug): a full disk or a read-only folder is the user's to fix."""

    def invoke(self, ctx):
        from vlmrl.common.io import DamagedFileError

        try:
            return super().invoke(ctx)
        except (OSError, DamagedFileError, UnicodeDecodeError) as exc:
            if debug():
                raise
            fail(f"{describe(exc)} (--debug shows the traceback)", 2)


def guarded(action: Callable[[], T]) -> T:
    """Run a stage, turning the project's own errors into one red line and exit 1 (a folder in use or not
    vlmrl's: exit 2, nothing was done); with --debug the traceback instead."""
    from vlmrl.compare.stage import CompareError
    from vlmrl.compare.visual_gain import VisualGainError
    from vlmrl.config.schema import ConfigError
    from vlmrl.data.items import DataError
    from vlmrl.evaluate.stage import EvalError
    from vlmrl.evaluate.swap import VisualControlError
    from vlmrl.export.stage import ExportError
    from vlmrl.models.loading import ModelLoadError
    from vlmrl.models.lora import LoraLayoutError
    from vlmrl.run.claim import RunDirError
    from vlmrl.run.layout import RunFolderError
    from vlmrl.train.stage import TrainError

    try:
        return action()
    except RunDirError as exc:
        fail(str(exc), 2)
    except (ConfigError, DataError, EvalError, TrainError, CompareError, ExportError, ModelLoadError,
            LoraLayoutError, VisualControlError, VisualGainError, RunFolderError) as exc:
        if debug():
            raise
        fail(str(exc))


@contextmanager
def claimed(run_dir: Path, *, create: bool = True) -> Iterator[None]:
    """The run folder's claim for a stage command (vlmrl.run.claim); a refusal is one line and exit 2."""
    from vlmrl.run.claim import RunDirError
    from vlmrl.run.claim import claimed as claim

    try:
        with claim(run_dir, create=create):
            yield
    except RunDirError as exc:
        fail(str(exc), 2)


def check_needs(config, *, gpu: bool = True) -> None:
    """The model, the data and the GPU `config` needs, before any stage starts (vlmrl.run.needs); exit 2 if not."""
    import os

    from vlmrl.common.distributed import LAUNCHED_ENV, world_size
    from vlmrl.run.needs import RequirementError, check_requirements

    if world_size() > 1 and os.environ.get(LAUNCHED_ENV):
        # a rank started by `--gpus N` / `--nodes M`: the launching process on its host checked (the hub probes
        # would repeat once per rank)
        return
    try:
        check_requirements(config, gpu=gpu)
    except RequirementError as exc:
        fail(str(exc), 2)
