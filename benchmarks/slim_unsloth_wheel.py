"""Rewrite the unsloth wheel without Unsloth Studio and the `unsloth` command, so the bench's wheels fit one carry.

The unsloth 2026.10.9 wheel is 28.6 MB, of which the library (`unsloth/`) is about 2 MB: the rest is
`studio/` (a web app: its frontend bundle and backend) and `unsloth_cli/`, which `import unsloth` never imports.
Beside bitsandbytes (43 MB) the whole wheel would not fit the device's 64 MiB carry. This keeps every other file
byte for byte, drops the dropped files' RECORD rows and the console script that named `unsloth_cli`, and writes
the result under the same file name. Left out: any change to the library itself.

    python benchmarks/slim_unsloth_wheel.py .whl-unsloth/unsloth-2026.10.9-py3-none-any.whl
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

DROP = ("studio/", "unsloth_cli/")


def dropped(name: str, drop: tuple[str, ...] = DROP) -> bool:
    """Whether a wheel member (or a RECORD row's path) belongs to a dropped top-level folder.

    >>> dropped("studio/frontend/dist/a.js"), dropped("unsloth/models/vision.py"), dropped("unsloth_cli/x.py")
    (True, False, True)
    """
    return name.startswith(drop)


def slim_metadata(name: str, text: str, drop: tuple[str, ...] = DROP) -> str:
    """RECORD without the dropped rows; top_level.txt without their names; no console script into them.

    >>> slim_metadata("u.dist-info/RECORD", "studio/a.py,sha256=x,1\\nunsloth/b.py,sha256=y,2\\n")
    'unsloth/b.py,sha256=y,2\\n'
    >>> slim_metadata("u.dist-info/entry_points.txt", "[console_scripts]\\nunsloth = unsloth_cli:app\\n")
    '[console_scripts]\\n'
    """
    tops = tuple(d.rstrip("/") for d in drop)
    if name.endswith("/RECORD"):
        keep = [row for row in text.splitlines() if not dropped(row, drop)]
    elif name.endswith("/top_level.txt"):
        keep = [row for row in text.splitlines() if row.strip() not in tops]
    elif name.endswith("/entry_points.txt"):
        keep = [row for row in text.splitlines() if not any(f"= {t}" in row or f"={t}" in row for t in tops)]
    else:
        return text
    return "\n".join(keep) + "\n"


def slim_wheel(path: Path, drop: tuple[str, ...] = DROP) -> tuple[int, int]:
    """Rewrite `path` in place; returns its size before and after (bytes)."""
    before = path.stat().st_size
    tmp = path.with_suffix(".slim")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if dropped(info.filename, drop):
                continue
            data = src.read(info)
            if ".dist-info/" in info.filename:
                data = slim_metadata(info.filename, data.decode(), drop).encode()
            dst.writestr(info, data)
    tmp.replace(path)
    return before, path.stat().st_size


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        a, b = slim_wheel(Path(arg))
        print(f"{arg}: {a / 1e6:.1f} MB -> {b / 1e6:.1f} MB")
