"""Who may write a run folder: one vlmrl process at a time, and only into folders vlmrl made.

- **The mark.** vlmrl writes `.vlmrl-run` into every run folder it creates. A folder without it is not a run:
  vlmrl never adopts it, writes into it nor deletes from it, whatever it holds, with or without `--force`. The
  one exception is an empty folder (a user's `mkdir` for the run): it holds nothing to lose, so it is marked and
  used. A run made before the mark existed is refused like any other folder; the message says how to mark it.
- **No links out.** A vlmrl name at the top of a run folder that is a symbolic link to somewhere outside it
  (`report.html -> /etc/...`, `adapter -> ~/models`) is refused before anything is written: a write through it
  would land outside the run.
- **The claim.** A command holds an OS lock (`fcntl.flock`, exclusive, non-blocking) on `.vlmrl.lock` for as
  long as it runs; a second command on the same folder fails at once, naming the holder's pid. The kernel drops
  the lock when the holder exits, however it exits, so a kill -9 leaves no stale claim. Processes started by
  `--gpus N` (and ranks other than 0 under a bare `accelerate launch`) share the claim of the process that
  launched them: the claimed folder is passed down in `VLMRL_RUN_CLAIM`.
- **`--force`** removes only what vlmrl writes (`VLMRL_ENTRIES`, their shard/temp siblings and the trainings a
  fresh start moved aside, `train.replaced-*`); anything else in the folder stays.

`compare` and `report` take no claim (they read a run, perhaps one still training, and write one file each
atomically) but check the mark and the links like every other command (`require_mark`).

Left out: locks on network filesystems where flock is advisory-only or unsupported (NFS without lockd).
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vlmrl.run import layout

MARKER = ".vlmrl-run"
LOCK = ".vlmrl.lock"
CLAIM_ENV = "VLMRL_RUN_CLAIM"
# Everything a vlmrl command writes at the top of a run folder (records shards and temp files are matched by
# their stem in `is_vlmrl_entry`).
VLMRL_ENTRIES = frozenset({
    layout.CONFIG, layout.ENV, layout.DATA, "base-model", layout.TRAIN, layout.COMPARISON, layout.ADAPTER,
    layout.EXPORT, "merged-16bit", "merged-4bit", "gguf", layout.REPORT, layout.STAGES_FILE, MARKER, LOCK,
    *(layout.records_file(s + swap) for s in layout.STAGES for swap in ("", layout.SWAPPED)),
    *(layout.summary_file(s + swap) for s in layout.STAGES for swap in ("", layout.SWAPPED)),
})


class RunDirError(RuntimeError):
    """A run folder that this process may not use now; the message names the folder and what to do."""


def is_vlmrl_entry(name: str) -> bool:
    """Whether a top-level name in a run folder is one vlmrl writes.

    >>> names = ("train", "train.replaced-20260101-120000", "after_records.rank1.jsonl", ".env.json.x.tmp", "notes")
    >>> [is_vlmrl_entry(n) for n in names]
    [True, True, True, True, False]
    """
    if name in VLMRL_ENTRIES or name.startswith(layout.SET_ASIDE):  # train.replaced-*: an earlier training
        return True
    for stage in ("baseline", "after", "baseline_swapped", "after_swapped"):
        if name.startswith(f"{stage}_records.rank") and name.endswith(".jsonl"):
            return True
    # write_bytes_atomic's temp files: .<name>.<random>.tmp
    return name.startswith(".") and name.endswith(".tmp") and any(name.startswith(f".{e}.") for e in VLMRL_ENTRIES)


def relative_to_run(path: str | Path, run_dir: Path | None) -> str:
    """`path` relative to the run folder when inside it (so a moved run stays valid), else as given.

    >>> relative_to_run("/r/run/train/final", Path("/r/run")), relative_to_run("/elsewhere/a", Path("/r/run"))
    ('train/final', '/elsewhere/a')
    """
    if run_dir is not None:
        try:
            return Path(path).resolve().relative_to(Path(run_dir).resolve()).as_posix()
        except (OSError, ValueError):  # outside the run folder: keep it as the user gave it
            pass
    return str(path)


def ensure_marked(run_dir: Path, *, create: bool = True) -> bool:
    """Make sure `run_dir` is a vlmrl run folder (creating and marking it, or marking an empty one); raise
    RunDirError for any other folder. Returns False (touching nothing) when it is missing and not `create`."""
    run_dir = Path(run_dir)
    if (run_dir / MARKER).is_file():
        check_no_links_out(run_dir)
        return True
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"{run_dir} is a file, not a folder; choose another run.name or run.output_dir.")
    if run_dir.is_dir():
        if names := sorted(p.name for p in run_dir.iterdir()):
            raise RunDirError(_not_a_run(run_dir, names))
    elif not create:
        return False
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / MARKER).write_text("This folder is a vlmrl run; `vlmrl run --force` may delete what vlmrl wrote here.\n")
    return True


def mark_if_new(run_dir: Path) -> None:
    """Mark `run_dir` when it is missing (creating it) or empty; leave any other folder as it is. For the
    Python API's stage functions, which write where they are told: the commands' claim still refuses a
    non-empty folder without the mark."""
    run_dir = Path(run_dir)
    if not run_dir.exists() or (run_dir.is_dir() and not any(run_dir.iterdir())):
        ensure_marked(run_dir)


def require_mark(run_dir: Path) -> None:
    """For a command that writes into an existing run without claiming it (`compare`, `report`): the folder
    exists, carries the mark, and no vlmrl name in it links out of it; else RunDirError."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunDirError(f"{run_dir}: no such run folder (give the folder `vlmrl run` wrote, e.g. runs/demo).")
    if not (run_dir / MARKER).is_file():
        raise RunDirError(_not_a_run(run_dir, sorted(p.name for p in run_dir.iterdir())))
    check_no_links_out(run_dir)


def check_no_links_out(run_dir: Path) -> None:
    """Refuse a run folder where a name vlmrl writes is a symbolic link leading outside the folder."""
    inside = Path(run_dir).resolve()
    for path in sorted(Path(run_dir).iterdir()):
        if path.is_symlink() and is_vlmrl_entry(path.name):
            target = path.resolve()
            if target != inside and inside not in target.parents:
                raise RunDirError(f"{path} is a link to {target}, outside the run folder; vlmrl writes only inside "
                                  "its run folders: remove the link, or choose another run.name.")


def _not_a_run(run_dir: Path, names: list[str]) -> str:
    held = f"; it holds {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}" if names else ""
    hint = (f" Only if it is a run an older vlmrl made, mark it (touch {run_dir / MARKER}): vlmrl then owns "
            "every name it writes there."
            if layout.CONFIG in names or layout.DATA in names else "")
    return (f"{run_dir} exists and is not a vlmrl run folder (no {MARKER} mark{held}); vlmrl never writes into "
            f"nor deletes from such a folder, --force included. Choose another run.name or run.output_dir.{hint}")


def remove_vlmrl_outputs(run_dir: Path) -> list[str]:
    """`--force`: delete what vlmrl wrote in a marked run folder (not the mark, not the lock, nothing else);
    returns the names removed."""
    run_dir = Path(run_dir)
    if not (run_dir / MARKER).is_file():
        raise RunDirError(f"{run_dir}: no {MARKER} mark; --force deletes only inside folders vlmrl made.")
    removed = []
    for path in sorted(run_dir.iterdir()):
        if path.name in (MARKER, LOCK) or not is_vlmrl_entry(path.name):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        removed.append(path.name)
    return removed


def shared_claim(run_dir: Path) -> bool:
    """True when a parent process (the `--gpus N` launcher) or rank 0 holds this folder's claim for us."""
    from vlmrl.common.distributed import rank, world_size

    claimed = os.environ.get(CLAIM_ENV)
    if claimed and claimed == str(Path(run_dir).resolve()):
        return True
    return world_size() > 1 and rank() != 0


@contextmanager
def claimed(run_dir: Path, *, create: bool = True) -> Iterator[None]:
    """Hold `run_dir` for the duration of the block (see the module docstring).

    A missing folder with `create=False` is not claimed: the stage that needed its files says what is missing.
    """
    run_dir = Path(run_dir)
    if shared_claim(run_dir):
        yield
        return
    if not ensure_marked(run_dir, create=create):
        yield
        return
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    previous = os.environ.get(CLAIM_ENV)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            raise RunDirError(
                f"{run_dir} is in use by another vlmrl command (pid {holder}); wait for it to finish, "
                "or choose another run.name."
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        os.environ[CLAIM_ENV] = str(run_dir.resolve())
        yield
    finally:
        if previous is None:
            os.environ.pop(CLAIM_ENV, None)
        else:
            os.environ[CLAIM_ENV] = previous
        os.close(fd)  # releases the flock
