"""Rows of any dataset (not MathVista's schema) to `Candidate`s through the `data.columns` mapping.

`data.columns` maps vlmrl's keys to the file's column names: `question` and `answer` are required, and
`image` (one image, or a list) and/or `images` (a list, kept in order): a row may have its image(s) in either,
not in both; `id`, `choices`, `answer_type`, `precision`, `unit` and `category` are optional. An `imagefolder`
source needs no image mapping: its `file_name` column is the image. Every column but the image ones is kept,
JSON-safe and under its own name, in `Candidate.extra`: reward functions get it, as TRL passes every dataset
column (with `answer: solution`, a reward may take `solution`, the cell as written, or `answer`). A row's id is its `id` cell, else where it was read
(`train.parquet:12`: file name and row number, the line number for JSONL and CSV).

The question cell may be TRL's conversational prompt, a list of `{"role", "content"}` messages (or its JSON
text): the user turn's text is the question (`<image>` placeholders and image parts left out: the images come
from the image column), a system turn is kept as the item's system message; any other turn drops the row.

The answer type of a row: its `answer_type` cell when mapped and non-empty, else `data.answer_type`, else read
off the gold: a number is `integer` or `float` (from its text: "3.0" is a float with precision 1, a float64
cell holding 3.0 is the integer 3), a gold that is one of the row's choices is `choice`, LaTeX or a symbolic
expression (`\\frac{1}{2}`, `1/2`, `x^2+1`) is `expression`, anything else `text`; where the type came from is
kept in the item's metadata (`answer_type_from`). Rows whose type is not in `data.answer_types` are dropped
(`filtered_answer_type`, showing the answer and the fix). Choices are a list, or a cell holding a JSON list, a
Python list literal or text split at `data.choices_separator`. Gold numbers are kept as written (values.py).
Left out: choices given as letters only ("B" with no choice texts), answers that are not scalars.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from vlmrl.config.schema import DataConfig
from vlmrl.config.sections import COLUMN_ROLES
from vlmrl.data.items import ANSWER_TYPES, Candidate, DataError, Dropped
from vlmrl.data.table import MAPPED
from vlmrl.data.values import (
    decimals_of,
    integer_text,
    is_integer_text,
    json_safe,
    looks_like_expression,
    number_text,
)

IMAGEFOLDER_COLUMN = "file_name"
CHOICE_FORMS = ('write choices as a JSON list ["red", "green"] or a Python list [\'red\', \'green\'], or set '
                'data.choices_separator to split text such as red|green')
TYPE_SOURCES = {"column": "its answer_type cell", "data.answer_type": "data.answer_type",
                "inferred": "read off the gold"}


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
    unknown = sorted(set(cols) - set(COLUMN_ROLES))
    if unknown:
        raise DataError(
            f"data.columns: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(COLUMN_ROLES)}."
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
    item_id = _id_text(cell.get("id")) or row.get("__where__") or f"{name}-{index}"
    question, system = _conversation(cell["question"])
    if isinstance(system, Dropped):
        return Dropped(item_id, system.reason, system.detail)
    if not isinstance(question, str) or not question.replace("<image>", "").strip():
        return Dropped(
            item_id, "missing_question", f"column {cols['question']!r} is missing, empty or not text"
        )
    images = _images(cell, cols)
    if isinstance(images, Dropped):
        return Dropped(item_id, images.reason, images.detail)
    choices = _choices(cell.get("choices"), data.choices_separator)
    if isinstance(choices, str):  # why the cell cannot be choices
        return Dropped(item_id, "bad_choices", f"column {cols['choices']!r}: {choices}", fix=CHOICE_FORMS)
    gold = _gold(item_id, cell, data, choices, counters)
    if isinstance(gold, Dropped):
        return gold
    answer, atype, precision, typed_by = gold
    unit, category = cell.get("unit"), cell.get("category")
    metadata: dict[str, Any] = {"row": index, "answer_type_from": typed_by}
    if row.get("__split__"):
        metadata["split"] = row["__split__"]
    # images: TRL hands them over itself; a column named like an item field: that field is what rewards get
    skip = {cols[k] for k in ("image", "images") if k in cols} | set(MAPPED)
    extra = {k: json_safe(v) for k, v in row.items() if k not in skip and not k.startswith("__")}
    return Candidate(
        id=item_id,
        question=question.replace("<image>", "").strip(),
        answer=answer,
        answer_type=atype,  # type: ignore[arg-type]  # checked against ANSWER_TYPES in _gold
        precision=precision,
        unit=(str(unit).strip() or None) if unit is not None else None,
        choices=tuple(choices) if choices else None,
        source=name,
        category=str(category).strip() if category is not None and str(category).strip() else name,
        metadata=metadata,
        images=tuple(images),
        base_dir=row.get("__base_dir__"),
        extra=extra,
        system=system,
    )


def _conversation(cell: Any) -> tuple[Any, str | None | Dropped]:
    """(question, system message) of a question cell: a TRL conversational prompt gives its user turn's text
    and its system turn's; any other cell is the question as it is, without a system message.

    >>> _conversation([{"role": "system", "content": "Be brief."},
    ...                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}])
    ('How many?', 'Be brief.')
    """
    messages = cell
    if isinstance(cell, str) and cell.lstrip().startswith("[{"):  # a CSV or JSONL cell holding the list as text
        try:
            messages = json.loads(cell)
        except (json.JSONDecodeError, RecursionError):
            return cell, None
    if not (isinstance(messages, list) and messages and all(isinstance(m, dict) and "role" in m for m in messages)):
        return cell, None
    texts: dict[str, list[str]] = {"user": [], "system": []}
    for message in messages:
        if message["role"] not in texts:
            return None, Dropped("", "bad_prompt", f"the prompt has a {str(message['role'])[:40]!r} turn; vlmrl keeps "
                                 "one system and one user turn")
        texts[message["role"]].append(_message_text(message.get("content")))
    system = "\n".join(t for t in texts["system"] if t.strip()) or None
    return "\n".join(t for t in texts["user"] if t.strip()), system


def _message_text(content: Any) -> str:
    """A message's text: its string, or its text parts joined (image parts left out)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text") or "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def _gold(
    item_id: str, cell: dict[str, Any], data: DataConfig, choices: list[str] | None, counters: dict[str, int]
) -> tuple[str, str, int | None, str] | Dropped:
    """(answer text, answer type, precision, where the type came from) of a row, or why it is dropped."""
    raw = cell["answer"]
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return Dropped(item_id, "missing_answer", "the answer column is missing or empty")
    if isinstance(raw, bool) or (not isinstance(raw, (str, int, float)) and number_text(raw) is None):
        return Dropped(item_id, "bad_answer", f"the answer is a {type(raw).__name__}, not text or a number")
    number = number_text(raw)
    text = raw.strip() if isinstance(raw, str) else number
    if text is None:  # a non-finite float
        return Dropped(item_id, "non_numeric_answer", f"answer {raw!r} is not a finite number")
    declared, typed_by = cell.get("answer_type"), "column"
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
        atype, typed_by = data.answer_type, "data.answer_type"
    else:
        atype, typed_by = _inferred_type(text, number, choices), "inferred"
    if atype not in data.answer_types:
        fix = f"add {atype} to data.answer_types"
        return Dropped(
            item_id, "filtered_answer_type",
            f"answer {_short(text)!r} is {atype} ({TYPE_SOURCES[typed_by]}); data.answer_types is {data.answer_types}",
            fix=fix if typed_by != "inferred" else f"{fix}, or declare the type (data.answer_type, or an "
            "answer_type column)",
        )
    if atype in ("integer", "float"):
        if number is None or (atype == "integer" and not is_integer_text(number)):
            return Dropped(item_id, "non_numeric_answer", f"answer {text!r} is not a valid {atype}")
        gold = integer_text(number) if atype == "integer" else number
        if gold != text:
            counters["answer_normalized"] = counters.get("answer_normalized", 0) + 1
        return gold, atype, _precision(cell.get("precision"), atype, gold, counters), typed_by
    if atype == "choice":
        if not choices:
            return Dropped(
                item_id, "missing_choices", "a choice answer needs the row's choices (data.columns.choices)"
            )
        if text not in choices:
            return Dropped(
                item_id, "answer_not_in_choices", f"answer {text!r} is not one of the choices {choices}"
            )
    return text, atype, None, typed_by


def _inferred_type(text: str, number: str | None, choices: list[str] | None) -> str:
    """A number is integer/float, one of the row's choices is choice, maths is expression, the rest text."""
    if number is not None:
        return "integer" if "." not in number else "float"
    if choices and text in choices:
        return "choice"
    return "expression" if looks_like_expression(text) else "text"


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


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


def _images(cell: dict[str, Any], cols: dict[str, str]) -> list[Any] | Dropped:
    """The row's images, in order, from whichever of `images` (a list) and `image` (one, or a list) holds
    them; a row with images in both is dropped, since which to show would be a guess."""
    keys = [k for k in ("images", "image") if k in cols]
    if len(keys) == 2 and cols["image"] == cols["images"]:  # one column mapped twice
        keys = ["images"]
    present = {}
    for key in (k for k in keys if k in cell):
        value = cell[key]
        if isinstance(value, str) and value.lstrip().startswith("["):  # a CSV cell holding a JSON list
            try:
                value = json.loads(value)
            except (json.JSONDecodeError, RecursionError):
                return Dropped("", "bad_images", f"the {key} cell starts with '[' but is not a JSON list")
        value = list(value) if isinstance(value, tuple) else value
        if value is not None and value != []:
            present[key] = value
    if len(present) > 1:
        return Dropped("", "image_and_images", f"both columns {cols['image']!r} and {cols['images']!r} hold "
                       "images in this row; keep them in one")
    if not present:
        return Dropped("", "missing_image", f"no image in column(s) {', '.join(repr(cols[k]) for k in keys)}")
    value = next(iter(present.values()))
    return value if isinstance(value, list) else [value]


def _choices(raw: Any, separator: str | None = None) -> list[str] | None | str:
    """The choices as text, None when there are none, or why the cell cannot be choices.

    >>> _choices('["a", "b"]'), _choices("['a', 'b']"), _choices("a | b", "|"), _choices("a|b")
    (['a', 'b'], ['a', 'b'], ['a', 'b'], "'a|b' is not a JSON or Python list (and data.choices_separator is unset)")
    """
    if raw is None:
        return None
    if isinstance(raw, str):
        text = raw.strip()
        if not text:
            return None
        raw = _list_literal(text)
        if raw is None and separator:
            raw = [part.strip() for part in text.split(separator) if part.strip()]
        elif raw is None:
            return f"{_short(text)!r} is not a JSON or Python list (and data.choices_separator is unset)"
    if not isinstance(raw, (list, tuple)) or any(isinstance(c, (list, dict, tuple)) for c in raw):
        return f"{_short(json.dumps(json_safe(raw)))} is not a list of choices"
    texts = [c.strip() if isinstance(c, str) else (number_text(c) or str(c)) for c in raw]
    return texts or None


def _list_literal(text: str) -> Any:
    """A cell's JSON list or Python list literal (`['a', 'b']`), else None; never runs code."""
    if not text.startswith("["):
        return None
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        pass
    try:
        return ast.literal_eval(text) if len(text) <= 100_000 else None
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None


def _id_text(raw: Any) -> str | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        return raw.strip() or None
    number = number_text(raw)
    return number if number is not None else json.dumps(json_safe(raw), sort_keys=True)
