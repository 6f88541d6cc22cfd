"""Reading the run folder for the report: each file once, and a plain sentence for one that is not there.

A damaged file is remembered (the header's inventory and the section both say so) instead of failing the
page. Left out: any interpretation of the files' content (that is each section's job).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from vlmrl.common.io import read_json, read_jsonl
from vlmrl.report.cells import esc
from vlmrl.run import layout


class RunFiles:
    """Reads each run-directory file once and remembers which were unreadable, for the page to say so."""

    KNOWN: ClassVar[list[str]] = [
        layout.CONFIG, layout.ENV, layout.DATA_SUMMARY, layout.HOLDOUT, layout.records_file("baseline"),
        layout.summary_file("baseline"), "train/summary.json", layout.METRICS, "train/health.jsonl",
        layout.records_file("after"), layout.summary_file("after"), layout.COMPARISON, layout.EXPORT]

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.problems: dict[str, str] = {}
        self._cache: dict[str, Any] = {}

    def json(self, name: str) -> Any:
        return self._read(name, read_json)

    def json_object(self, name: str) -> dict | None:
        data = self.json(name)
        if data is not None and not isinstance(data, dict):
            self.problems[name] = f"expected a JSON object, found {type(data).__name__}"
        return data if isinstance(data, dict) else None

    def jsonl(self, name: str) -> list[dict]:
        return [row for row in self._read(name, read_jsonl) or [] if isinstance(row, dict)]

    def text(self, name: str) -> str | None:
        return self._read(name, lambda path: path.read_text(encoding="utf-8", errors="replace"))

    @property
    def read(self) -> list[str]:
        """The names the page asked for (found or not): its inputs."""
        return list(self._cache)

    def _read(self, name: str, reader: Callable[[Path], Any]) -> Any:
        if name not in self._cache:
            self._cache[name] = None
            if (self.run_dir / name).is_file():
                try:
                    self._cache[name] = reader(self.run_dir / name)
                except (OSError, ValueError) as exc:  # one damaged file must not take the whole report down
                    self.problems[name] = f"{type(exc).__name__}: {exc}"
        return self._cache[name]

    def missing(self, name: str, what: str, lacks: str = "what this section shows") -> str:
        """A plain sentence for a section whose file is absent, unreadable, or lacks the section's part."""
        if name in self.problems:
            why = f"could not be read: {esc(self.problems[name])}"
        elif (self.run_dir / name).is_file():
            why = f"has no {lacks}"
        else:
            why = "missing"
        return f'<p class="missing">{what} ({esc(name)} {why}).</p>'

    def inventory(self) -> str:
        """Each input file: found, absent or unreadable (call it after the sections have read them)."""
        state = {n: "unreadable" if n in self.problems else "found" if (self.run_dir / n).is_file()
                 else "absent" for n in self.KNOWN}
        items = "".join(f'<li class="{state[n]}">{esc(n)}</li>' for n in self.KNOWN)
        return f'<details class="inventory"><summary>Input files</summary><ul>{items}</ul></details>'

