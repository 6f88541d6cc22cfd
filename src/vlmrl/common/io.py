"""Crash-safe files: every JSON artifact is written whole or not at all, every JSONL line is flushed.

A run can be killed at any moment (SIGKILL, OOM, a pre-empted node). Whole files go through a temp file
and `os.replace`, which is atomic on POSIX; record files are appended one complete line at a time and a
torn last line (the only damage a kill can do) is ignored and truncated away on the next append.
`check_disk_space` refuses work whose output cannot fit before the work starts, not at the first save.
Every JSON file is strict JSON, which any parser reads: a NaN or infinite number is written as `null`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

_CHUNK = 1 << 16  # bytes read at a time when looking for a file's last newline


class DamagedFileError(ValueError):
    """A records file damaged beyond a torn last line (not something a kill does); the message names the
    file and the line."""


def write_bytes_atomic(path: str | Path, payload: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; the file should read like any other the user writes
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process umask (read by setting it and restoring it at once: POSIX has no getter)."""
    current = os.umask(0o022)
    os.umask(current)
    return current


def match_umask(folder: str | Path) -> None:
    """Give files under `folder` that a library wrote 0600 (safetensors writes through a private temp file) the
    mode the user's umask gives any other file; files with any other mode are left as they are."""
    mode = 0o666 & ~_umask()
    for path in Path(folder).rglob("*"):
        if path.is_file() and not path.is_symlink() and path.stat().st_mode & 0o777 == 0o600 and mode != 0o600:
            path.chmod(mode)


def write_text_atomic(path: str | Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | Path, data: Any) -> None:
    write_text_atomic(path, strict_json(data, indent=2) + "\n")


def write_jsonl_atomic(path: str | Path, rows: Iterable[dict]) -> None:
    write_text_atomic(path, "".join(strict_json(row) + "\n" for row in rows))


def strict_json(data: Any, *, indent: int | None = None) -> str:
    """`json.dumps` that never writes `NaN` or `Infinity` (Python's default, which strict parsers refuse):
    a non-finite number becomes `null`, as JavaScript's JSON.stringify does.

    >>> strict_json({"a": float("nan"), "b": [1.5, float("-inf")]})
    '{"a": null, "b": [1.5, null]}'
    """
    try:  # the common case: nothing to replace, one pass
        return json.dumps(data, indent=indent, ensure_ascii=False, default=str, allow_nan=False)
    except ValueError:
        return json.dumps(_finite_or_none(data), indent=indent, ensure_ascii=False, default=str, allow_nan=False)


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite_or_none(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_or_none(item) for item in value]
    return value


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def read_jsonl(path: str | Path) -> list[dict]:
    """All complete lines of a JSONL file; a torn final line (killed mid-write) is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):  # the last, unterminated line: an interrupted append
                break
            raise DamagedFileError(
                f"{path}:{number}: not valid JSON; the file is damaged beyond a torn last line (restore it from a "
                "copy, or delete it to redo what it recorded)."
            ) from None
    return rows


def append_jsonl(path: str | Path, rows: Iterable[dict]) -> None:
    """Append complete lines and fsync, after cutting any torn tail a previous kill left behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _truncate_torn_tail(path)
    payload = "".join(strict_json(row) + "\n" for row in rows)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())


def _truncate_torn_tail(path: Path) -> None:
    """Cut an unterminated last line, reading only the file's end (rollouts.jsonl grows to many MB).

    A last line that is complete JSON and only lacks its newline (a kill between the two) is kept and
    terminated instead: `read_jsonl` already counts it, so cutting it would lose a record it reported.
    """
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as handle:
        size = handle.seek(0, os.SEEK_END)
        handle.seek(size - 1)
        if handle.read(1) == b"\n":
            return
        cut = 0
        for end in range(size, 0, -_CHUNK):
            start = max(0, end - _CHUNK)
            handle.seek(start)
            newline = handle.read(end - start).rfind(b"\n")
            if newline >= 0:
                cut = start + newline + 1
                break
        handle.seek(cut)
        try:
            json.loads(handle.read())
        except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
            handle.truncate(cut)
        else:
            handle.seek(size)
            handle.write(b"\n")


class DiskSpaceError(OSError):
    """Not enough free space for what a stage is about to write; the message names the path and both sizes."""


def check_disk_space(path: str | Path, needed_bytes: int, *, what: str = "this stage's output") -> None:
    """Raise DiskSpaceError unless the filesystem holding `path` has `needed_bytes` free.

    `path` need not exist yet: its nearest existing parent is measured (same filesystem in practice).
    """
    path = Path(path)
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed_bytes:
        raise DiskSpaceError(
            f"{path}: {_size(free)} free, but {what} needs about {_size(needed_bytes)}. "
            "Free some space there, or point run.output_dir at a larger disk."
        )


def checkpoint_bytes(trainable_params: int, *, margin_bytes: int = 64 * 2**20) -> int:
    """Disk needed by one training checkpoint: fp32 trainable weights (4 bytes) and their two Adam moments
    (8 bytes), plus a margin for the RNG, scheduler and trainer state and the processor files."""
    return 12 * trainable_params + margin_bytes


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
