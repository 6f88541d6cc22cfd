"""Who may write a run folder: one vlmrl process at a time, and only into folders vlmrl made.

- **The mark.** vlmrl writes `.vlmrl-run` into every run folder it creates. A folder without it is not a run:
  vlmrl never writes into it nor deletes it, with or without `--force`. Two kinds of unmarked folder are adopted
  (marked) instead of refused: an empty one, and one whose entries are all names vlmrl writes and that holds a
  run's `config.yaml` or `data/summary.json` (a run made before the mark existed, or by the Python API).
- **The claim.** A command holds an OS lock (`fcntl.flock`, exclusive, non-blocking) on `.vlmrl.lock` for as
  long as it runs; a second command on the same folder fails at once, naming the holder's pid. The kernel drops
  the lock when the holder exits, however it exits, so a kill -9 leaves no stale claim. Processes started by
  `--gpus N` (and ranks other than 0 under a bare `accelerate launch`) share the claim of the process that
  launched them: the claimed folder is passed down in `VLMRL_RUN_CLAIM`.
- **`--force`** removes only what vlmrl writes (`VLMRL_ENTRIES`, their shard/temp siblings and the trainings a
  fresh start moved aside, `train.replaced-*`); anything else in the folder stays.

Left out: locks on network filesystems where flock is advisory-only or unsupported (NFS without lockd), and
claims for `compare` / `report`, which read a finished run and write one file each atomically.
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
    layout.EXPORT, "merged-16bit", "merged-4bit", "gguf", layout.REPORT, MARKER, LOCK,
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
    """Make sure `run_dir` is a vlmrl run folder (creating and marking it, or adopting it); raise RunDirError
    for a folder vlmrl did not make. Returns False (touching nothing) when it is missing and not `create`."""
    run_dir = Path(run_dir)
    marker = run_dir / MARKER
    if marker.is_file():
        return True
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"{run_dir} is a file, not a folder; choose another run.name or run.output_dir.")
    if run_dir.is_dir():
        names = [p.name for p in run_dir.iterdir()]
        ours = all(is_vlmrl_entry(n) for n in names)
        looks_like_a_run = (run_dir / "config.yaml").is_file() or (run_dir / "data" / "summary.json").is_file()
        if names and not (ours and looks_like_a_run):
            strangers = sorted(n for n in names if not is_vlmrl_entry(n))[:3]
            raise RunDirError(
                f"{run_dir} exists and is not a vlmrl run folder (no {MARKER} mark"
                + (f"; it holds {', '.join(strangers)}" if strangers else "")
                + "); vlmrl never writes into nor deletes such a folder, --force included. "
                "Choose another run.name or run.output_dir."
            )
    elif not create:
        return False
    run_dir.mkdir(parents=True, exist_ok=True)
    marker.write_text("This folder is a vlmrl run; `vlmrl run --force` may delete what vlmrl wrote here.\n")
    return True


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
