"""From raw dataset rows to `Candidate`s: MathVista's own schema, or any dataset through `data.columns`.

MathVista rows (pid, question, query, decoded_image/image, choices, unit, precision, answer, question_type,
answer_type, metadata) are kept when their free-form answer is numeric (`integer`/`float`, filtered by
`data.answer_types`), and multiple-choice items when `data.include_multi_choice` is set: those become answer
type `choice`, the gold being the text of the right choice ("145°") and the choices kept in order, so the
grader accepts the text or its letter. On testmini that keeps 418 + 40 = 458 free-form items, plus 540
multiple-choice ones when asked.

Other datasets (e.g. hiyouga/geometry3k) map their columns onto image, question, answer and optionally
precision, choices and id; the answer type is read off the gold ("3" is an integer, "8.5" a float with
precision 1).

Every row that is not kept comes back as a `Dropped` with a reason, so input rows = kept + dropped.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

from ..config import DataConfig
from .items import Candidate, DataError, Dropped

MATHVISTA_FIELDS = ("pid", "question", "answer", "question_type", "answer_type")
COLUMN_KEYS = ("image", "question", "answer", "precision", "choices", "id")
REQUIRED_COLUMNS = ("image", "question", "answer")
_PLAIN_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)$")
_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(,\d{3})+(\.\d+)?$")
_WITH_UNIT = re.compile(r"^\$?\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+))\s*[^\d]*$")  # "6cm", "135°", "$4"


def convert_rows(
    rows: Iterator[dict[str, Any]], data: DataConfig, name: str, counters: dict[str, int]
) -> Iterator[Candidate | Dropped]:
    """Convert each row; the first row decides the schema (MathVista's, or the `data.columns` mapping).

    `counters` counts rows that were kept after a repair (e.g. `precision_inferred`).
    """
    for index, row in enumerate(rows):
        if "__error__" in row:
            yield Dropped(f"row-{index}", "bad_row", row["__error__"])
            continue
        if index == 0:
            _check_schema(row, data, name)
        if data.columns:
            yield _mapped(row, index, data, name, counters)
        else:
            yield _mathvista(row, index, data, counters)


def parse_number(text: Any, *, allow_unit: bool = False) -> float | None:
    """The number a gold answer or choice states, or None. "1,000" -> 1000.0; with allow_unit "6cm" -> 6.0."""
    if isinstance(text, bool) or text is None:
        return None
    if isinstance(text, (int, float)):
        return float(text) if math.isfinite(text) else None
    text = str(text).strip()
    if _THOUSANDS.match(text):
        text = text.replace(",", "")
    if _PLAIN_NUMBER.match(text):
        return float(text)
    match = _WITH_UNIT.match(text) if allow_unit else None
    return float(match.group(1)) if match else None


def decimals_of(text: str) -> int:
    """Digits after the decimal point of a plain number string ("8.50" -> 2)."""
    text = str(text).strip()
    return len(text.split(".", 1)[1]) if "." in text else 0


def _check_schema(row: dict[str, Any], data: DataConfig, name: str) -> None:
    fields = sorted(k for k in row if not k.startswith("__"))
    if data.columns:
        unknown = sorted(set(data.columns) - set(COLUMN_KEYS))
        if unknown:
            raise DataError(
                f"data.columns: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(COLUMN_KEYS)}."
            )
        missing = [k for k in REQUIRED_COLUMNS if k not in data.columns]
        if missing:
            raise DataError(f"data.columns: map {', '.join(missing)} too (e.g. question: problem).")
        absent = {k: v for k, v in data.columns.items() if v not in row}
        if absent:
            raise DataError(
                f"{name}: data.columns names column(s) the data does not have "
                f"({', '.join(f'{k}: {v}' for k, v in absent.items())}); "
                f"the columns are: {', '.join(fields)}."
            )
    elif not all(f in row for f in MATHVISTA_FIELDS):
        raise DataError(
            f"{name}: rows are not in MathVista's schema (need {', '.join(MATHVISTA_FIELDS)}; found "
            f"{', '.join(fields)}). For another dataset set data.columns, e.g. "
            "{image: images, question: problem, answer: answer}."
        )


def _mathvista(
    row: dict[str, Any], index: int, data: DataConfig, counters: dict[str, int]
) -> Candidate | Dropped:
    pid = str(row.get("pid") or f"row-{index}")
    question = row.get(data.prompt_field)
    if not isinstance(question, str) or not question.strip():
        return Dropped(pid, "missing_question", f"field {data.prompt_field!r} is missing or empty")
    qtype, atype = row.get("question_type"), row.get("answer_type")
    choices = _as_choices(row.get("choices"))
    answer = row.get("answer")
    if answer is None or not str(answer).strip():
        return Dropped(pid, "missing_answer", "field 'answer' is missing or empty")
    answer = str(answer).strip()

    if qtype == "multi_choice":
        if not data.include_multi_choice:
            return Dropped(pid, "filtered_answer_type", "multi_choice (data.include_multi_choice is false)")
        if not choices:
            return Dropped(pid, "missing_choices", "multi_choice without a non-empty `choices` list")
        stripped = [c.strip() for c in choices]
        if answer not in stripped:
            return Dropped(pid, "answer_not_a_choice", f"answer {answer!r} is not one of the choices {choices}")
        # Graded as `choice`: the gold is the choice's text, the model may answer with it or with its letter
        # (the prompt lists the lettered choices, contract.build_prompt_text).
        text, atype, precision = answer, "choice", None
    else:
        if atype not in data.answer_types:
            return Dropped(
                pid, "filtered_answer_type", f"{qtype}/{atype} not in data.answer_types {data.answer_types}"
            )
        value = parse_number(answer)
        if value is None or (atype == "integer" and not value.is_integer()):
            return Dropped(pid, "non_numeric_answer", f"answer {answer!r} is not a valid {atype}")
        text = str(int(value)) if atype == "integer" else answer.replace(",", "")
        precision = _precision(row.get("precision"), atype, text, counters)
        if text != answer:
            counters["answer_normalized"] = counters.get("answer_normalized", 0) + 1

    metadata = dict(row.get("metadata") or {})
    split = metadata.get("split") or data.split
    metadata.update({"pid": pid, "question_type": qtype, "answer_type": row.get("answer_type")})
    if row.get("query"):
        metadata["query"] = row["query"]
    return Candidate(
        id=pid,
        question=question.strip(),
        answer=text,
        answer_type=atype,
        precision=precision,
        unit=(str(row["unit"]).strip() or None) if row.get("unit") else None,
        choices=tuple(choices) if choices else None,
        source=f"mathvista-{split}",
        category=str(metadata.get("task") or "unknown"),
        metadata=metadata,
        image=_mathvista_image(row),
        base_dir=row.get("__base_dir__"),
    )


def _mathvista_image(row: dict[str, Any]) -> Any:
    """decoded_image (PIL image or datasets' {"bytes", "path"} storage) when it holds something, else the
    `image` path, which is relative to the annotation file."""
    decoded = row.get("decoded_image")
    if isinstance(decoded, dict) and not (decoded.get("bytes") or decoded.get("path")):
        decoded = None
    return decoded if decoded is not None else row.get("image")


def _mapped(
    row: dict[str, Any], index: int, data: DataConfig, name: str, counters: dict[str, int]
) -> Candidate | Dropped:
    cols = data.columns
    item_id = str(
        row.get(cols["id"]) if "id" in cols and row.get(cols["id"]) is not None else f"{name}-{index}"
    )
    question = row.get(cols["question"])
    if not isinstance(question, str) or not question.replace("<image>", "").strip():
        return Dropped(item_id, "missing_question", f"column {cols['question']!r} is missing or empty")
    answer = row.get(cols["answer"])
    if answer is None or not str(answer).strip():
        return Dropped(item_id, "missing_answer", f"column {cols['answer']!r} is missing or empty")
    answer = str(answer).strip()
    value = parse_number(answer)
    if value is None:
        return Dropped(item_id, "non_numeric_answer", f"answer {answer!r} is not a number")
    text = answer.replace(",", "")
    atype = "integer" if "." not in text else "float"
    if atype not in data.answer_types:
        return Dropped(
            item_id, "filtered_answer_type", f"{atype} answer not in data.answer_types {data.answer_types}"
        )
    precision = _precision(row.get(cols["precision"]) if "precision" in cols else None, atype, text, counters)
    image = row.get(cols["image"])
    metadata: dict[str, Any] = {"row": index}
    if isinstance(image, list):  # datasets such as geometry3k store a list of images per row
        metadata["images_in_row"] = len(image)
        image = image[0] if image else None
    choices = _as_choices(row.get(cols["choices"])) if "choices" in cols else None
    return Candidate(
        id=item_id,
        question=question.replace("<image>", "").strip(),
        answer=str(int(value)) if atype == "integer" else text,
        answer_type=atype,
        precision=precision,
        unit=None,
        choices=tuple(choices) if choices else None,
        source=name,
        category=name,
        metadata=metadata,
        image=image,
        base_dir=row.get("__base_dir__"),
    )


def _precision(raw: Any, answer_type: str, text: str, counters: dict[str, int]) -> int | None:
    """Integers have none. Floats keep a valid declared precision; a missing or NaN one (the hub stores
    precision as float64, so "none" can arrive as NaN) is read off the gold's decimals and counted."""
    if answer_type == "integer":
        return None
    if isinstance(raw, (int, float)) and not isinstance(raw, bool) and math.isfinite(raw) and raw >= 0:
        return int(raw)
    counters["precision_inferred"] = counters.get("precision_inferred", 0) + 1
    return decimals_of(text)


def _as_choices(raw: Any) -> list[str] | None:
    if raw is None or isinstance(raw, str):
        return None
    try:
        choices = [str(c) for c in raw]
    except TypeError:
        return None
    return choices or None
