"""Rows of any dataset (not MathVista's schema) to `Candidate`s through the `data.columns` mapping.

`data.columns` maps vlmrl's keys to the file's column names: `question` and `answer` are required, and one of
`image` (one image, or a list) or `images` (a list, kept in order); `id`, `choices`, `answer_type`,
`precision` and `unit` are optional. An `imagefolder` source needs no image mapping: its `file_name` column is
the image. Every column that is not mapped is kept, JSON-safe, in `Candidate.extra` (reward functions get it).

The answer type of a row: its `answer_type` cell when mapped and non-empty, else `data.answer_type`, else read
off the gold: a number is `integer` or `float` (from its text: "3.0" is a float with precision 1, a float64
cell holding 3.0 is the integer 3), a gold that is one of the row's choices is `choice`, anything else `text`
(declare `expression` answers: inference cannot tell an expression from prose). Rows whose type is not in
`data.answer_types` are dropped (`filtered_answer_type`). Gold numbers are kept as written (see values.py).
Left out: choices given as letters only ("B" with no choice texts), answers that are not scalars.
"""

from __future__ import annotations

import json
from typing import Any

from vlmrl.config.schema import DataConfig
from vlmrl.data.items import ANSWER_TYPES, Candidate, DataError, Dropped
from vlmrl.data.values import decimals_of, integer_text, is_integer_text, json_safe, number_text

COLUMN_KEYS = ("id", "question", "answer", "image", "images", "choices", "answer_type", "precision", "unit")
IMAGEFOLDER_COLUMN = "file_name"


def check_columns_seen(data: DataConfig, seen: set[str], name: str) -> None:
    """After the last row: every mapped column must have appeared in at least one row (else it is misspelt).

    Checked at the end, not on the first row, so one row without a column (JSONL rows vary) is dropped with
    a reason instead of refusing the file; rows are dropped before any image decode, so this costs little.
    """
    never = {k: v for k, v in data.columns.items() if v not in seen}
    if never:
        found = ", ".join(sorted(k for k in seen if not k.startswith("__")))
        raise DataError(
            f"{name}: data.columns names column(s) the data does not have "
            f"({', '.join(f'{k}: {v}' for k, v in never.items())}); the columns are: {found}."
        )


def mapping(data: DataConfig, row: dict[str, Any]) -> dict[str, str]:
    """`data.columns`, with the imagefolder's `file_name` as the image when no image column is mapped."""
    cols = dict(data.columns)
    if "image" not in cols and "images" not in cols and IMAGEFOLDER_COLUMN in row:
        cols["image"] = IMAGEFOLDER_COLUMN
    return cols


def check_mapping(data: DataConfig, row: dict[str, Any], name: str) -> None:
    """Refuse a mapping with unknown keys or required keys missing (the columns: `check_columns_seen`)."""
    cols = mapping(data, row)
    unknown = sorted(set(cols) - set(COLUMN_KEYS))
    if unknown:
        raise DataError(
            f"data.columns: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(COLUMN_KEYS)}."
        )
    missing = [k for k in ("question", "answer") if k not in cols]
    if "image" not in cols and "images" not in cols:
        missing.append("image (or images)")
    if missing:
        raise DataError(f"data.columns: map {', '.join(missing)} too (e.g. question: problem).")


def convert_mapped(
    row: dict[str, Any], index: int, data: DataConfig, name: str, counters: dict[str, int]
) -> Candidate | Dropped:
    cols = mapping(data, row)
    cell = {key: row.get(column) for key, column in cols.items()}
    item_id = _id_text(cell.get("id")) or f"{name}-{index}"
    question = cell["question"]
    if not isinstance(question, str) or not question.replace("<image>", "").strip():
        return Dropped(
            item_id, "missing_question", f"column {cols['question']!r} is missing, empty or not text"
        )
    images = _images(cell)
    if isinstance(images, Dropped):
        return Dropped(item_id, images.reason, images.detail)
    choices = _choices(cell.get("choices"))
    if choices is False:
        return Dropped(item_id, "bad_choices", f"column {cols['choices']!r} is not a list of choices")
    gold = _gold(item_id, cell, data, choices, counters)
    if isinstance(gold, Dropped):
        return gold
    answer, atype, precision = gold
    unit = cell.get("unit")
    mapped_columns = set(cols.values())
    extra = {k: json_safe(v) for k, v in row.items() if k not in mapped_columns and not k.startswith("__")}
    return Candidate(
        id=item_id,
        question=question.replace("<image>", "").strip(),
        answer=answer,
        answer_type=atype,  # type: ignore[arg-type]  # checked against ANSWER_TYPES in _gold
        precision=precision,
        unit=(str(unit).strip() or None) if unit is not None else None,
        choices=tuple(choices) if choices else None,
        source=name,
        category=name,
        metadata={"row": index},
        images=tuple(images),
        base_dir=row.get("__base_dir__"),
        extra=extra,
    )


def _gold(
    item_id: str, cell: dict[str, Any], data: DataConfig, choices: list[str] | None, counters: dict[str, int]
) -> tuple[str, str, int | None] | Dropped:
    """(answer text, answer type, precision) of a row, or why it is dropped."""
    raw = cell["answer"]
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return Dropped(item_id, "missing_answer", "the answer column is missing or empty")
    if isinstance(raw, bool) or (not isinstance(raw, (str, int, float)) and number_text(raw) is None):
        return Dropped(item_id, "bad_answer", f"the answer is a {type(raw).__name__}, not text or a number")
    number = number_text(raw)
    text = raw.strip() if isinstance(raw, str) else number
    if text is None:  # a non-finite float
        return Dropped(item_id, "non_numeric_answer", f"answer {raw!r} is not a finite number")
    declared = cell.get("answer_type")
    if isinstance(declared, str) and declared.strip():
        atype = declared.strip().lower()
        if atype not in ANSWER_TYPES:
            return Dropped(
                item_id, "unknown_answer_type", f"answer_type {declared!r}; use {', '.join(ANSWER_TYPES)}"
            )
    elif declared is not None and not isinstance(declared, str):
        return Dropped(
            item_id, "unknown_answer_type", f"answer_type is a {type(declared).__name__}, not text"
        )
    elif data.answer_type is not None:
        atype = data.answer_type
    elif number is not None:
        atype = "integer" if "." not in number else "float"
    else:
        atype = "choice" if choices and text in choices else "text"
    if atype not in data.answer_types:
        return Dropped(
            item_id, "filtered_answer_type", f"{atype} answer not in data.answer_types {data.answer_types}"
        )
    if atype in ("integer", "float"):
        if number is None or (atype == "integer" and not is_integer_text(number)):
            return Dropped(item_id, "non_numeric_answer", f"answer {text!r} is not a valid {atype}")
        gold = integer_text(number) if atype == "integer" else number
        if gold != text:
            counters["answer_normalized"] = counters.get("answer_normalized", 0) + 1
        return gold, atype, _precision(cell.get("precision"), atype, gold, counters)
    if atype == "choice":
        if not choices:
            return Dropped(
                item_id, "missing_choices", "a choice answer needs the row's choices (data.columns.choices)"
            )
        if text not in choices:
            return Dropped(
                item_id, "answer_not_in_choices", f"answer {text!r} is not one of the choices {choices}"
            )
    return text, atype, None


def _precision(raw: Any, atype: str, gold: str, counters: dict[str, int]) -> int | None:
    if atype != "float":
        return None
    declared = number_text(raw)
    if (
        declared is not None
        and is_integer_text(declared)
        and not declared.startswith("-")
        and len(declared) < 4
    ):
        return int(integer_text(declared))
    counters["precision_inferred"] = counters.get("precision_inferred", 0) + 1
    return decimals_of(gold)


def _images(cell: dict[str, Any]) -> list[Any] | Dropped:
    """The row's images, in order: the `images` list when mapped, else the `image` value (or list)."""
    value = cell.get("images") if "images" in cell else cell.get("image")
    if isinstance(value, str) and value.lstrip().startswith("["):  # a CSV cell holding a JSON list
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            return Dropped("", "bad_images", "the images cell starts with '[' but is not a JSON list")
    if isinstance(value, tuple):
        value = list(value)
    if value is None or value == []:
        return Dropped("", "missing_image", "no image in this row")
    return value if isinstance(value, list) else [value]


def _choices(raw: Any) -> list[str] | None | bool:
    """The choices as text, None when there are none, False when the cell cannot be choices."""
    if raw is None:
        return None
    if isinstance(raw, str):
        if not raw.strip():
            return None
        try:
            raw = json.loads(raw)
        except (json.JSONDecodeError, RecursionError):
            return False
    if not isinstance(raw, (list, tuple)) or any(isinstance(c, (list, dict, tuple)) for c in raw):
        return False
    texts = [c.strip() if isinstance(c, str) else (number_text(c) or str(c)) for c in raw]
    return texts or None


def _id_text(raw: Any) -> str | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        return raw.strip() or None
    number = number_text(raw)
    return number if number is not None else json.dumps(json_safe(raw), sort_keys=True)
