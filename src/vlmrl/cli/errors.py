"""How the `vlmrl` command line fails: one literal line and an exit code, never a traceback for what the user
can fix; `--debug` shows the traceback instead.

Exit codes: 0 done; 2 anything the user can fix (a config, the data, a reward function, a folder in use or not
vlmrl's, a missing model, a stage that refuses, a full disk or a read-only folder, even when a library reports it
wrapped in its own exception); 130 Ctrl-C; 1 only a bug in vlmrl, with its traceback. A stage stopped by the
disk, a reward or Ctrl-C resumes when the same command is re-run.

Kept apart from `app.py`, which holds the commands. Left out: catching programming errors (anything not named
here still ends in a traceback, which is what a bug report needs).
"""

from __future__ import annotations

import errno
import os
import re
import sys
import traceback
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


def fail(message: str, code: int = 2) -> NoReturn:
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


# errno values that say "the disk", not "the program" (full, read-only, over quota, a file over the file
# system's or the process's size limit): the run resumes once the user has made room
_DISK_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EFBIG)
# The same failures as libraries report them in their own exceptions: safetensors (`... (os error 28)`) and
# PyTorch's zip writer, which names no errno (`[enforce fail at inline_container.cc:672] . unexpected pos 576 vs
# 534` on a full disk, measured on a full tmpfs; its reader's errors, a damaged file, are not matched).
_DISK_TEXT = re.compile(r"No space left on device|Read-only file system|Disk quota exceeded|File too large"
                        r"|os error (?:27|28|30|122)\b|PytorchStreamWriter failed"
                        r"|inline_container\.cc:\d+\] \. (?:unexpected pos|file write failed|open file failed)")
RESUME = "free some space or make the folder writable, then re-run the same command: it resumes where it stopped"


def disk_failure(exc: BaseException) -> str | None:
    """One line for a full disk, a quota or a read-only folder behind `exc` (itself, or an exception it was
    raised from), however a library wrapped it; None for anything else.

    >>> disk_failure(RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"))
    'writing failed: Error while serializing: I/O error: No space left on device (os error 28); free some space or make the folder writable, then re-run the same command: it resumes where it stopped'
    >>> disk_failure(KeyError("x")) is None
    True
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS:
            return f"{describe(exc)}; {RESUME}"
        if not isinstance(exc, OSError) and _DISK_TEXT.search(str(exc)):
            text = " ".join(str(exc).split())[:300]
            return f"writing failed: {text}; {RESUME}"
        exc = exc.__cause__ or exc.__context__
    return None


class Commands(TyperGroup):
    """The top-level command group: an OS error or a damaged file met anywhere in a command becomes one line
    and exit 2 (the traceback only with --debug): a full disk or a read-only folder is the user's to fix, also
    when a library (safetensors, PyTorch's checkpoint writer) reports it inside an exception of its own."""

    def main(self, *args, **kwargs):
        try:
            return super().main(*args, **kwargs)
        except SystemExit as exc:
            _end_if_threads_left(exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1)
            raise
        except BaseException:
            if _threads_left():
                traceback.print_exc()
                _end_if_threads_left(1)
            raise

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        """`--debug` anywhere before a `--` is the global option: `vlmrl run --debug` as `vlmrl --debug run`."""
        end = args.index("--") if "--" in args else len(args)
        if "--debug" in args[:end]:
            args = ["--debug", *(a for a in args[:end] if a != "--debug"), *args[end:]]
        return super().parse_args(ctx, args)

    def invoke(self, ctx):
        from vlmrl.common.io import DamagedFileError

        try:
            return super().invoke(ctx)
        except (OSError, DamagedFileError, UnicodeDecodeError) as exc:
            if debug():
                raise
            fail(f"{disk_failure(exc) or describe(exc)} (--debug shows the traceback)", 2)
        except Exception as exc:
            line = disk_failure(exc)
            if line is None or debug():
                raise
            fail(f"{line} (--debug shows the traceback)", 2)
        except KeyboardInterrupt:  # Ctrl-C: not a bug (click would say "Aborted!" and exit 1)
            if debug():
                raise
            fail("interrupted; re-run the same command: it resumes where it stopped", 130)


def _threads_left() -> bool:
    """Whether a reward that ran past its time limit left threads running that Python waits for at exit (a
    ThreadPoolExecutor's workers, `asyncio.to_thread`); no reward ran when its module was never imported."""
    reward_call = sys.modules.get("vlmrl.grading.reward_call")
    return reward_call is not None and bool(reward_call.left_behind())


def _end_if_threads_left(code: int) -> None:
    """End the process now, its line printed, when a reward left such threads: Python would otherwise hang at exit
    joining them, after the run folder's lock is released."""
    if _threads_left():
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed or broken stream: nothing more can be said
                pass
        os._exit(code)


def guarded(action: Callable[[], T]) -> T:
    """Run a stage, turning the project's own errors (each one the user can act on: a config, the data, a
    reward, a folder, a model, a refused check) into one red line and exit 2; with --debug the traceback
    instead."""
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
        fail(str(exc), 2)


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


def check_needs(config, *, gpu: bool = True, gpus: int = 1, strategy: str = "ddp") -> None:
    """The model, the data and the GPU `config` needs, before any stage starts (vlmrl.preflight.needs); exit 2 if not.
    `gpus` / `strategy`: the training run's processes in all and how they shard (the memory check is per GPU)."""
    import os

    from vlmrl.common.distributed import LAUNCHED_ENV, launched_strategy, world_size
    from vlmrl.preflight.needs import RequirementError, check_requirements

    if world_size() > 1 and os.environ.get(LAUNCHED_ENV):
        # a rank started by `--gpus N` / `--nodes M`: the launching process on its host checked (the hub probes
        # would repeat once per rank)
        return
    if world_size() > 1 and gpus == 1:  # launched by hand: the launcher chose
        gpus, strategy = world_size(), launched_strategy()
    try:
        check_requirements(config, gpu=gpu, gpus=gpus, strategy=strategy)
    except RequirementError as exc:
        fail(str(exc), 2)
