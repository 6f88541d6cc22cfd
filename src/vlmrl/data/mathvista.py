"""From raw dataset rows to `Candidate`s: MathVista's own schema, or any dataset through `data.columns`.

MathVista rows (pid, question, query, decoded_image/image, choices, unit, precision, answer, question_type,
answer_type, metadata) are kept when their free-form answer is numeric (`integer`/`float`, filtered by
`data.answer_types`), and multiple-choice items when `data.include_multi_choice` is set: those become answer
type `choice`, the gold being the text of the right choice ("145°") and the choices kept in order, so the
grader accepts the text or its letter. On testmini that keeps 418 + 40 = 458 free-form items, plus 540
multiple-choice ones when asked. A `metadata` cell may be the mapping or its JSON text (a CSV or JSONL copy);
rows without a pid are named by file and row.

Other datasets (e.g. hiyouga/geometry3k) go through `data.columns` (mapped.py).

Every row that is not kept comes back as a `Dropped` with a reason, so input rows = kept + dropped: a row
nested too deeply, or one whose cells have types no converter expected, is dropped (`too_deeply_nested`,
`bad_row`) instead of stopping the stage; so is one with an over-long text cell, too many columns or a lone
surrogate (`values.cell_problem`). Gold numbers keep their digits (values.py), never through float.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

from vlmrl.config.schema import DataConfig
from vlmrl.data.items import Candidate, DataError, Dropped
from vlmrl.data.mapped import check_columns_seen, check_mapping, convert_mapped
from vlmrl.data.values import (
    MAX_DEPTH,
    cell_problem,
    decimals_of,
    depth,
    integer_text,
    is_integer_text,
    json_safe,
    number_text,
)

__all__ = ["convert_rows", "decimals_of", "parse_number"]

MATHVISTA_FIELDS = ("pid", "question", "answer", "question_type", "answer_type")


def convert_rows(
    rows: Iterator[dict[str, Any]], data: DataConfig, name: str, counters: dict[str, int]
) -> Iterator[Candidate | Dropped]:
    """Convert each row; the first row decides the schema (MathVista's, or the `data.columns` mapping).

    `counters` counts rows that were kept after a repair (e.g. `precision_inferred`).
    """
    checked = False
    seen: set[str] = set()  # columns present in some row (mapped optional columns must be somewhere)
    for index, row in enumerate(rows):
        where = row.get("__where__") or f"row-{index}"  # file name and row number, for rows without an id
        if "__error__" in row:
            yield Dropped(where, row.get("__reason__", "bad_row"), row["__error__"])
            continue
        if depth(row) > MAX_DEPTH:
            yield Dropped(where, "too_deeply_nested", f"nested more than {MAX_DEPTH} levels deep")
            continue
        if problem := cell_problem(row):  # before anything reads a cell: tokenizers, ids, the manifests
            yield Dropped(where, *problem)
            continue
        if not checked:  # the first readable row decides the schema
            _check_schema(row, data, name)
            checked = True
        if data.columns:
            seen.update(row)
        try:
            if data.columns or "file_name" in row:
                yield convert_mapped(row, index, data, name, counters)
            else:
                yield _mathvista(row, index, data, counters)
        except (TypeError, ValueError, AttributeError, KeyError, OverflowError) as exc:
            # cells of a type no check above expected: the row goes, with what was wrong, the run goes on
            yield Dropped(where, "bad_row", f"{type(exc).__name__}: {exc}"[:300])
    if data.columns and checked:
        check_columns_seen(data, seen, name)


def parse_number(text: Any, *, allow_unit: bool = False) -> float | None:
    """The number a gold answer or choice states, or None. "1,000" -> 1000.0; with allow_unit "6cm" -> 6.0.
    (The exact text is `values.number_text`; this is its value.)"""
    exact = number_text(text, allow_unit=allow_unit)
    return None if exact is None else float(exact)


def _check_schema(row: dict[str, Any], data: DataConfig, name: str) -> None:
    fields = sorted(k for k in row if not k.startswith("__"))
    if data.columns or "file_name" in row:
        check_mapping(data, row, name)
    elif not all(f in row for f in MATHVISTA_FIELDS):
        raise DataError(
            f"{name}: rows are not in MathVista's schema (need {', '.join(MATHVISTA_FIELDS)}; found "
            f"{', '.join(fields)}). For another dataset set data.columns, e.g. "
            "{image: images, question: problem, answer: answer}."
        )


def _mathvista(
    row: dict[str, Any], index: int, data: DataConfig, counters: dict[str, int]
) -> Candidate | Dropped:
    pid = str(row.get("pid") or row.get("__where__") or f"row-{index}")
    question = row.get(data.prompt_field)
    if not isinstance(question, str) or not question.strip():
        return Dropped(pid, "missing_question", f"field {data.prompt_field!r} is missing or empty")
    qtype, atype = row.get("question_type"), row.get("answer_type")
    choices = _as_choices(row.get("choices"))
    answer = row.get("answer")
    if answer is not None and not isinstance(answer, str):  # a number cell: its exact text, never "3.0"
        answer = number_text(answer)
        if answer is None:
            kind = type(row["answer"]).__name__
            return Dropped(pid, "non_numeric_answer", f"answer of type {kind} is not a number")
    if answer is None or not answer.strip():
        return Dropped(pid, "missing_answer", "field 'answer' is missing or empty")
    answer = answer.strip()

    if qtype == "multi_choice":
        if not data.include_multi_choice:
            return Dropped(pid, "filtered_answer_type", "multi_choice (data.include_multi_choice is false)")
        if not choices:
            return Dropped(pid, "missing_choices", "multi_choice without a non-empty `choices` list")
        stripped = [c.strip() for c in choices]
        if answer not in stripped:
            return Dropped(pid, "answer_not_in_choices", f"answer {answer!r} is not one of the choices {choices}")
        # Graded as `choice`: the gold is the choice's text, the model may answer with it or with its letter
        # (the prompt lists the lettered choices, contract.build_prompt_text).
        text, atype, precision = answer, "choice", None
    else:
        if atype not in data.answer_types:
            return Dropped(
                pid, "filtered_answer_type", f"{qtype}/{atype} not in data.answer_types {data.answer_types}"
            )
        number = number_text(answer)
        if number is None or (atype == "integer" and not is_integer_text(number)):
            return Dropped(pid, "non_numeric_answer", f"answer {answer!r} is not a valid {atype}")
        text = integer_text(number) if atype == "integer" else number
        precision = _precision(row.get("precision"), atype, text, counters)
        if text != answer:
            counters["answer_normalized"] = counters.get("answer_normalized", 0) + 1

    raw_metadata = row.get("metadata")
    if isinstance(raw_metadata, str):  # a CSV or JSONL file may hold the mapping as JSON text
        raw_metadata = _json_mapping(raw_metadata) or raw_metadata
    if raw_metadata is None or isinstance(raw_metadata, dict):
        metadata = json_safe(dict(raw_metadata or {}))
    else:  # kept as it was, under its own key: the row is usable, the odd cell is not lost
        metadata = {"metadata": json_safe(raw_metadata)}
        counters["metadata_not_mapping"] = counters.get("metadata_not_mapping", 0) + 1
    split = metadata.get("split") if isinstance(metadata.get("split"), str) else None
    split = row.get("__split__") or split or data.split or "testmini"
    metadata["split"] = split
    metadata.update(
        {"pid": pid, "question_type": json_safe(qtype), "answer_type": json_safe(row.get("answer_type"))}
    )
    if row.get("query"):
        metadata["query"] = json_safe(row["query"])
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
        images=(_mathvista_image(row),),
        base_dir=row.get("__base_dir__"),
    )


def _json_mapping(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _mathvista_image(row: dict[str, Any]) -> Any:
    """decoded_image (PIL image or datasets' {"bytes", "path"} storage) when it holds something, else the
    `image` path, which is relative to the annotation file."""
    decoded = row.get("decoded_image")
    if isinstance(decoded, dict) and not (decoded.get("bytes") or decoded.get("path")):
        decoded = None
    return decoded if decoded is not None else row.get("image")


def _precision(raw: Any, answer_type: str, text: str, counters: dict[str, int]) -> int | None:
    """Integers have none. Floats keep a valid declared precision; a missing or NaN one (the hub stores
    precision as float64, so "none" can arrive as NaN) is read off the gold's decimals and counted."""
    if answer_type == "integer":
        return None
    if isinstance(raw, (int, float)) and not isinstance(raw, bool) and math.isfinite(raw) and 0 <= raw <= 20:
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
