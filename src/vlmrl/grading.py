"""Reading numbers out of answers, and scoring answers the way MathVista's official script does.

Two jobs live here because both decide whether an answer is right:

* ``parse_number`` / ``numeric_equal`` read one number from what a policy wrote (``1,000``, ``\\frac{1}{2}``,
  ``$30^\\circ$``, ``50%``) and compare it with the gold answer at the gold answer's own precision. The
  training reward uses them, so they must never raise and must stay fast on any string a policy can emit:
  only short texts are considered (a 1 MB "number" is not one number), and every regex is anchored and free
  of nested quantifiers.
* ``normalize_mathvista`` / ``mathvista_correct`` reproduce MathVista's official
  ``normalize_extracted_answer`` and ``safe_equal`` (evaluation/calculate_score.py) so our benchmark numbers
  are comparable with published ones. They are checked row by row against an oracle computed with the
  official code (tests/test_grading.py), quirks included: an empty multiple-choice extraction still picks the
  shortest choice, integers are truncated, not rounded.

Deliberately left out: symbolic equivalence (``2\\sqrt{2}`` vs ``2.828``), numbers written in words, and
non-ASCII digits; such answers score as not numerically equal.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from fractions import Fraction

# A solution longer than this cannot be "one number" with at most one unit; refusing it early bounds the
# work done on adversarial completions.
MAX_NUMBER_CHARS = 200
# Exponents beyond float range would make exact arithmetic explode (10**10**9) and mean inf or 0 anyway.
_MAX_EXPONENT = 400
_RELATIVE_TOLERANCE = Fraction(1, 10**9)

_SIGN = r"[+\-\u2212]?"  # U+2212 is the minus sign typeset by LaTeX-trained models
_MANTISSA = r"(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]*)?|\.[0-9]+"
_PLAIN_RE = re.compile(rf"(?P<sign>{_SIGN})(?P<mantissa>{_MANTISSA})(?:[eE](?P<exp>[+\-]?[0-9]+))?")
_FRAC_RE = re.compile(rf"(?P<sign>{_SIGN})\s*\\[dt]?frac\s*\{{(?P<num>[^{{}}]*)\}}\s*\{{(?P<den>[^{{}}]*)\}}")
_UNIT_RE = re.compile(
    r"\s*(?:%|\\%|°|\^\s*\{?\s*\\circ\s*\}?|\\circ"
    r"|\\(?:text|mathrm)\{\s*(?P<latex_word>[A-Za-z]{1,12})\s*\}"
    r"|(?P<word>[A-Za-z]{1,12})(?:\^\{?[23]\}?|[²³])?)\Z"
)
# Words that look like a unit to the pattern above but would turn "5 nan" into the number 5.
_NOT_UNITS = {"nan", "inf", "infinity", "e"}
_WRAPPERS = (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"), ("\\boxed{", "}"))
_OPTION_LETTER_RE = re.compile(r"\(([a-zA-Z])\)")


def parse_number(text: str) -> float | None:
    """The single finite number ``text`` writes, or None (two numbers, words only, nan, 1e999, too long).

    >>> parse_number("$\\\\boxed{1,000}$"), parse_number("-\\\\frac{3}{4}"), parse_number("30°")
    (1000.0, -0.75, 30.0)
    >>> parse_number("3 or 4") is None, parse_number("nan") is None, parse_number("1e999") is None
    (True, True, True)
    """
    value = _parse_exact(text)
    return None if value is None else float(value)


def numeric_equal(pred: str, gold: str) -> bool:
    """Whether ``pred`` states the gold number, at the precision the gold answer is written with.

    An integer gold must be matched exactly (within 1e-9 relative, for ``1/3`` against ``0.333333333333``);
    a gold with d decimals is matched by any prediction that rounds (half away from zero) to it.

    >>> numeric_equal("2.675", "2.68"), numeric_equal("1/2", "0.5"), numeric_equal("12 cm", "12")
    (True, True, True)
    >>> numeric_equal("2.4", "2"), numeric_equal("two", "2")
    (False, False)
    """
    if not isinstance(pred, str) or not isinstance(gold, str):
        return False
    pred_value, gold_value = _parse_exact(pred), _parse_exact(gold)
    if pred_value is None or gold_value is None:
        return False
    decimals = _decimals_written(gold)
    if decimals == 0:
        tolerance = _RELATIVE_TOLERANCE * max(abs(pred_value), abs(gold_value))
        return abs(pred_value - gold_value) <= tolerance
    return _round_half_away(pred_value, decimals) == gold_value


def _parse_exact(text: str) -> Fraction | None:
    """The exact value of the one number in ``text`` (exact so that rounding 2.675 is not a float accident)."""
    if not isinstance(text, str) or len(text) > MAX_NUMBER_CHARS:
        return None
    core = _unwrap(_strip_unit(_unwrap(text)))
    frac = _FRAC_RE.fullmatch(core)
    if frac:
        return _ratio(frac["num"], frac["den"], negate=frac["sign"] in ("-", "\u2212"))
    if core.count("/") == 1:
        numerator, denominator = core.split("/")
        return _ratio(numerator, denominator, negate=False)
    return _parse_plain(core)


def _unwrap(text: str) -> str:
    """Peel math-mode and box wrappers (``$..$``, ``\\(..\\)``, ``\\boxed{..}``), nested ones too."""
    text = text.strip()
    peeled = True
    while peeled:
        peeled = False
        for opening, closing in _WRAPPERS:
            if (
                len(text) > len(opening) + len(closing) - 1
                and text.startswith(opening)
                and text.endswith(closing)
            ):
                text = text[len(opening) : len(text) - len(closing)].strip()
                peeled = True
    return text


def _strip_unit(text: str) -> str:
    """Drop one trailing unit, percent or degree sign: ``5 cm`` -> ``5``, ``30^\\circ`` -> ``30``."""
    match = _UNIT_RE.search(text)
    if not match or match.start() == 0:
        return text
    word = match["word"] or match["latex_word"]
    if word and word.lower() in _NOT_UNITS:
        return text
    return text[: match.start()]


def _ratio(numerator: str, denominator: str, *, negate: bool) -> Fraction | None:
    top, bottom = _parse_plain(numerator.strip()), _parse_plain(denominator.strip())
    if top is None or not bottom:  # None, or a zero denominator
        return None
    value = top / bottom
    return -value if negate else value


def _parse_plain(text: str) -> Fraction | None:
    """A signed decimal with optional thousands separators and exponent, as an exact fraction."""
    match = _PLAIN_RE.fullmatch(text)
    if not match:
        return None
    exponent = int(match["exp"] or 0)
    if abs(exponent) > _MAX_EXPONENT:
        return None
    value = Decimal(match["mantissa"].replace(",", "")).scaleb(exponent)
    if value != 0 and (abs(value.adjusted()) > _MAX_EXPONENT or not math.isfinite(float(value))):
        return None
    exact = Fraction(value)
    return -exact if match["sign"] in ("-", "\u2212") else exact


def _decimals_written(gold: str) -> int:
    """How many decimals the gold answer states (``12.50`` -> 2, ``1.5e3`` -> 0, ``1/3`` -> 0)."""
    match = _PLAIN_RE.fullmatch(_unwrap(_strip_unit(_unwrap(gold))))
    if not match:
        return 0
    exponent = Decimal(match["mantissa"].replace(",", "")).scaleb(int(match["exp"] or 0)).as_tuple().exponent
    return max(0, -int(exponent))


def _round_half_away(value: Fraction, decimals: int) -> Fraction:
    scale = 10**decimals
    magnitude = math.floor(abs(value) * scale + Fraction(1, 2))
    return Fraction(magnitude if value >= 0 else -magnitude, scale)


# ---------------------------------------------------------------------------------------------------------
# MathVista's official normalization (evaluation/calculate_score.py), reimplemented.


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
