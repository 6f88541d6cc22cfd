"""The records the data stage hands to every later stage, and how they are stored.

An `Item` is one kept example: the question, the prompt the model sees, the gold answer as a string, how to
grade it (answer_type, precision, unit, choices), where it came from, its images (one or more, in the row's
order) as paths inside the run directory plus each one's sha256, and the user's columns under their own names
(`extra`: the unmapped ones, and the mapped ones whose name is not an item field, as TRL would pass them).
Manifests written before several images per item (`image`/`image_sha256` strings) still read back.
`Dropped` is one row that did not make it, with a reason code and a human detail.

Files are JSONL, one record per line, and every file is written atomically (temp file in the same folder, then
`os.replace`) so a crash never leaves a half-written manifest that a later stage would trust.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

AnswerType = Literal["integer", "float", "choice", "expression", "text"]
ANSWER_TYPES: tuple[str, ...] = ("integer", "float", "choice", "expression", "text")
# Names TRL gives reward functions itself: an extra column called so is passed as `extra_<name>`.
RESERVED_COLUMNS = frozenset(
    {"prompt", "prompts", "image", "images", "completion", "completions", "completion_ids",
     "trainer_state", "log_extra", "log_metric", "environments"}
)


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
    images: tuple[str, ...]  # paths relative to the run directory, e.g. data/images/<sha256[:16]>.png
    image_sha256: tuple[str, ...]  # one per image, same order
    metadata: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # the source's columns by their own names, JSON-safe
    system: str | None = None  # the system message before `prompt` (the row's own, else data.system_prompt)

    @property
    def image(self) -> str:
        """The first image: what single-image consumers (and one-image items) use."""
        return self.images[0]

    def columns(self) -> dict[str, Any]:
        """The per-item keyword arguments every reward function receives (TRL passes dataset columns).

        The mapped fields, then the user's extra columns; an extra column never shadows a mapped one, and one
        named like an argument TRL passes itself (`prompts`, `completions`, ...) is given as `extra_<name>`.
        """
        mapped = {
            "id": self.id,
            "question": self.question,
            "answer": self.answer,
            "answer_type": self.answer_type,
            "precision": self.precision,
            "unit": self.unit,
            "choices": list(self.choices) if self.choices is not None else None,
            "category": self.category,
            "source": self.source,
        }
        extra = {
            (f"extra_{k}" if k in RESERVED_COLUMNS else k): v for k, v in self.extra.items() if k not in mapped
        }
        return {**extra, **mapped}

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        record["choices"] = list(self.choices) if self.choices is not None else None
        record["images"] = list(self.images)
        record["image_sha256"] = list(self.image_sha256)
        if record["system"] is None:  # manifests without a system message read as before
            del record["system"]
        return record

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Item:
        record = _upgrade(record)
        names = {f.name for f in fields(cls)}
        missing = sorted(names - set(record) - {"metadata", "extra", "system"})
        if missing:
            raise ValueError(f"missing field(s) {', '.join(missing)}")
        unknown = sorted(set(record) - names)
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(unknown)}")
        if record["answer_type"] not in ANSWER_TYPES:
            raise ValueError(
                f"answer_type must be one of {', '.join(ANSWER_TYPES)}, got {record['answer_type']!r}"
            )
        images, hashes = record["images"], record["image_sha256"]
        if not (isinstance(images, list) and images and isinstance(hashes, list) and len(hashes) == len(images)):
            raise ValueError("images and image_sha256 must be lists of the same, non-zero length")
        values = dict(record)
        values["choices"] = tuple(record["choices"]) if record["choices"] is not None else None
        values["images"], values["image_sha256"] = tuple(images), tuple(hashes)
        values["metadata"] = dict(record.get("metadata") or {})
        values["extra"] = dict(record.get("extra") or {})
        return cls(**values)

    def image_path(self, run_dir: Path) -> Path:
        return Path(run_dir) / self.image

    def image_paths(self, run_dir: Path) -> list[Path]:
        return [Path(run_dir) / image for image in self.images]


def _upgrade(record: dict[str, Any]) -> dict[str, Any]:
    """A manifest line from before several images per item: `image`/`image_sha256` strings -> lists."""
    if "image" not in record or "images" in record:
        return record
    upgraded = {k: v for k, v in record.items() if k != "image"}
    upgraded["images"] = [record["image"]]
    if isinstance(record.get("image_sha256"), str):
        upgraded["image_sha256"] = [record["image_sha256"]]
    return upgraded


def record_images(record: dict[str, Any]) -> list[str]:
    """The image paths of an item record read as a plain dict (a manifest line, old or new layout).

    >>> record_images({"images": ["a.png", "b.png"]}), record_images({"image": "a.png"}), record_images({})
    (['a.png', 'b.png'], ['a.png'], [])
    """
    images = record.get("images")
    if isinstance(images, list):
        return [str(i) for i in images]
    return [str(record["image"])] if record.get("image") else []


def record_hashes(record: dict[str, Any]) -> list[str]:
    """Each image's sha256 of an item or evaluation record, in order (one string in records written before
    several images per item).

    >>> record_hashes({"image_sha256": ["a", "b"]}), record_hashes({"image_sha256": "a"}), record_hashes({})
    (['a', 'b'], ['a'], [])
    """
    hashes = record.get("image_sha256")
    return [hashes] if isinstance(hashes, str) else list(hashes or [])


def open_record_images(run_dir: Path, record: dict[str, Any]) -> list[Any]:
    """The item's stored images as RGB PIL images, in order (paths relative to the run folder)."""
    from PIL import Image

    images = []
    for path in record_images(record):
        with Image.open(Path(run_dir) / path) as img:
            images.append(img.convert("RGB"))
    return images


@dataclass(frozen=True)
class Dropped:
    """One input row that was not kept: `reason` is a stable code, `detail` says what exactly (with the value),
    `fix` what to change when this row's own case needs more than the reason's usual fix (`vlmrl.data.drops`)."""

    id: str
    reason: str
    detail: str = ""
    fix: str = ""

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        if not self.fix:
            del record["fix"]
        return record


@dataclass(frozen=True)
class Candidate:
    """A row that passed the field checks of its source, before its image is normalised and stored.

    Each of `images` is whatever the source holds (PIL image, bytes, a `{"bytes", "path"}` dict or a path
    relative to `base_dir`); decoding waits until the cheap checks have passed, so filtered rows never cost a
    decode.
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
    images: tuple[Any, ...] = field(repr=False)  # one or more, in the row's order
    base_dir: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    system: str | None = None  # the row's own system message (a conversational prompt's)


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

