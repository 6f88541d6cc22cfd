"""The records the data stage hands to every later stage, and how they are stored.

An `Item` is one kept example: the question, the prompt the model sees, the gold answer as a string, how to
grade it (answer_type, precision, unit, choices), where it came from, and the image as a path inside the run
directory plus its sha256. `Dropped` is one row that did not make it, with a reason code and a human detail.

Files are JSONL, one record per line, and every file is written atomically (temp file in the same folder, then
`os.replace`) so a crash never leaves a half-written manifest that a later stage would trust.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

AnswerType = Literal["integer", "float"]


class DataError(ValueError):
    """Data that cannot be used; the message names the file or source, the problem and the fix."""


@dataclass(frozen=True)
class Item:
    """One kept example, exactly as written to `train.jsonl` / `holdout.jsonl`."""

    id: str
    question: str
    prompt: str  # contract.build_prompt_text(question): the user-turn text
    answer: str  # gold, as a string ("42", "3.14")
    answer_type: AnswerType
    precision: int | None  # decimals the gold carries for floats; None for integers
    unit: str | None
    choices: tuple[str, ...] | None
    source: str  # "synthetic", "mathvista-testmini", or the dataset's name
    category: str
    image: str  # path relative to the run directory, e.g. data/images/<sha256[:16]>.png
    image_sha256: str
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        record["choices"] = list(self.choices) if self.choices is not None else None
        return record

    def columns(self) -> dict[str, Any]:
        """The keyword arguments every reward function receives for this item: the record without its image
        fields, its prompt (TRL passes that separately) or its metadata."""
        record = self.to_json()
        for key in ("image", "image_sha256", "prompt", "metadata"):
            record.pop(key, None)
        return record

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Item:
        names = {f.name for f in fields(cls)}
        missing = sorted(names - set(record) - {"metadata"})
        if missing:
            raise ValueError(f"missing field(s) {', '.join(missing)}")
        unknown = sorted(set(record) - names)
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(unknown)}")
        if record["answer_type"] not in ("integer", "float"):
            raise ValueError(f"answer_type must be integer or float, got {record['answer_type']!r}")
        values = dict(record)
        values["choices"] = tuple(record["choices"]) if record["choices"] is not None else None
        values["metadata"] = dict(record.get("metadata") or {})
        return cls(**values)

    def image_path(self, run_dir: Path) -> Path:
        return Path(run_dir) / self.image


@dataclass(frozen=True)
class Dropped:
    """One input row that was not kept: `reason` is a stable code, `detail` says what exactly."""

    id: str
    reason: str
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Candidate:
    """A row that passed the field checks of its source, before its image is normalised and stored.

    `image` is whatever the source holds (PIL image, bytes, a `{"bytes", "path"}` dict or a path relative to
    `base_dir`); decoding waits until the cheap checks have passed, so filtered rows never cost a decode.
    """

    id: str
    question: str
    answer: str
    answer_type: AnswerType
    precision: int | None
    unit: str | None
    choices: tuple[str, ...] | None
    source: str
    category: str
    metadata: dict[str, Any]
    image: Any = field(repr=False)
    base_dir: Path | None = None


def read_items(path: Path) -> list[Item]:
    """Read a train/holdout manifest; a bad line is an error naming the file and the line number."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file; run `vlmrl prepare` to write the data manifests.")
    items = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                items.append(Item.from_json(json.loads(line)))
            except (ValueError, TypeError) as exc:  # JSONDecodeError is a ValueError
                raise DataError(
                    f"{path}:{number}: not a valid item ({exc}); the file is damaged or hand-edited, "
                    "re-run `vlmrl prepare` to rewrite it."
                ) from None
    return items

