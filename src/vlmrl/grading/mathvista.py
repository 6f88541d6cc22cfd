"""MathVista's official scoring, reimplemented: ``normalize_mathvista`` / ``mathvista_correct`` reproduce
``normalize_extracted_answer`` and ``safe_equal`` (evaluation/calculate_score.py) so our benchmark numbers are
comparable with published ones. They are checked row by row against an oracle computed with the official code
(tests/test_grading.py), quirks included: an empty multiple-choice extraction still picks the shortest choice,
integers are truncated, not rounded. vlmrl's own grading is ``vlmrl.grading.grader.grade``.
"""

from __future__ import annotations

import math
import re

_OPTION_LETTER_RE = re.compile(r"\(([a-zA-Z])\)")


def normalize_mathvista(
    extraction: object,
    *,
    question_type: str,
    answer_type: str,
    precision: float | None = None,
    choices: list[str] | None = None,
) -> str | None:
    """What MathVista's ``normalize_extracted_answer`` turns an extracted answer into.

    Multiple choice: a letter (``B`` or ``(b)``) becomes that choice, anything else the closest choice by
    edit distance (first one on ties). Integer answers are *truncated* (``2.9`` -> ``2``), floats rounded to
    ``precision`` with Python's ``round``; unparseable numbers give None. ``precision`` may be a float (the
    Hugging Face copy stores ``1.0``): we cast it, where the official code would fail and return None.

    >>> normalize_mathvista("(b) 7", question_type="multi_choice", answer_type="text", choices=["6", "7"])
    '7'
    >>> normalize_mathvista("2.9", question_type="free_form", answer_type="integer")
    '2'
    >>> normalize_mathvista("3.14159", question_type="free_form", answer_type="float", precision=2.0)
    '3.14'
    """
    if question_type == "multi_choice":
        return _normalize_choice(extraction, choices)
    try:
        if answer_type == "integer":
            return str(int(float(extraction)))  # type: ignore[arg-type]
        if answer_type == "float":
            return str(round(float(extraction), _ndigits(precision)))  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):  # None, words, nan/inf for integers
        return None
    if answer_type == "list":
        return str(extraction)  # official: even None becomes "None"
    # Other answer types pass through unchanged in the official code (none exist in testmini).
    return extraction if extraction is None else str(extraction)


def mathvista_correct(normalized: object, gold: object) -> bool:
    """MathVista's ``safe_equal``: plain equality, and any comparison error counts as wrong."""
    try:
        return bool(normalized == gold)
    except Exception:  # noqa: BLE001 - the official code swallows everything here too
        return False


def _normalize_choice(extraction: object, choices: list[str] | None) -> str:
    if not choices:
        raise ValueError("a multi_choice item needs a non-empty `choices` list to normalize against")
    text = extraction.strip() if isinstance(extraction, str) else str(extraction)
    letter = _OPTION_LETTER_RE.search(text)
    if letter:
        text = letter.group(1).upper()
    letters = [chr(ord("A") + i) for i in range(len(choices))]
    if text in letters:
        return choices[letters.index(text)]
    distances = [edit_distance(text, choice) for choice in choices]
    return choices[distances.index(min(distances))]


def _ndigits(precision: float | None) -> int | None:
    """Digits for ``round``; None keeps the official ``round(x, None)`` (an int) for items without one."""
    if precision is None or (isinstance(precision, float) and math.isnan(precision)):
        return None
    return int(precision)


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insert, delete, substitute all cost 1), as ``Levenshtein.distance`` computes it.

    >>> edit_distance("kitten", "sitting"), edit_distance("", "abc"), edit_distance("same", "same")
    (3, 3, 0)
    """
    # A shared prefix or suffix never changes the distance; trimming it makes typical cases cheap.
    start = 0
    while start < min(len(a), len(b)) and a[start] == b[start]:
        start += 1
    a, b = a[start:], b[start:]
    end = 0
    while end < min(len(a), len(b)) and a[-1 - end] == b[-1 - end]:
        end += 1
    a, b = a[: len(a) - end], b[: len(b) - end]
    if len(a) < len(b):
        a, b = b, a  # keep the row (len(b) + 1) short
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]
