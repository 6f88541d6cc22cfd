"""Crash-safe files: every JSON artifact is written whole or not at all, every JSONL line is flushed.

A run can be killed at any moment (SIGKILL, OOM, a pre-empted node). Whole files go through a temp file
and `os.replace`, which is atomic on POSIX; record files are appended one complete line at a time and a
torn last line (the only damage a kill can do) is ignored and truncated away on the next append.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def write_text_atomic(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, ensure_ascii=False, default=str) + "\n")


def write_jsonl_atomic(path: str | Path, rows: Iterable[dict]) -> None:
    write_text_atomic(path, "".join(json.dumps(row, ensure_ascii=False, default=str) + "\n" for row in rows))


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
            raise ValueError(f"{path}:{number}: not valid JSON; the file is damaged beyond a torn last line.") from None
    return rows


def append_jsonl(path: str | Path, rows: Iterable[dict]) -> None:
    """Append complete lines and fsync, after cutting any torn tail a previous kill left behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _truncate_torn_tail(path)
    payload = "".join(json.dumps(row, ensure_ascii=False, default=str) + "\n" for row in rows)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())


def _truncate_torn_tail(path: Path) -> None:
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as handle:
        data = handle.read()
        if data.endswith(b"\n"):
            return
        handle.truncate(data.rfind(b"\n") + 1)
