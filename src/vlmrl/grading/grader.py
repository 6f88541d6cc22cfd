"""Deciding whether an answer is right: one public grader per answer type.

The jobs that decide it live here:

* ``grade(prediction, gold, answer_type, *, choices, precision)`` is the one grader the training reward and the
  evaluation records use, for the five answer types ``integer | float | choice | expression | text`` (the exact
  rules are in docs/rewards.md). It never raises on any prediction or gold and stays fast on any string a
  policy can emit: numbers and expressions are only read from short texts, text rules are linear.
* ``parse_number`` / ``numeric_equal`` read one number from what a policy wrote (``1,000``, ``\\frac{1}{2}``,
  ``$30^\\circ$``, ``50%``) and compare it with the gold answer at the gold answer's own precision: only
  short texts are considered (a 1 MB "number" is not one number), and every regex is anchored and free of
  nested quantifiers. An integer gold is compared exactly, whatever its number of digits.
* ``latex_plain`` reads away the LaTeX that only dresses an answer (``\\text{Paris}``, ``\\textbf{B}``, ``{4}``,
  ``1{,}000``, ``140^\\circ``), as math-verify does, before numbers, choices and text are compared.
* ``normalize_mathvista`` / ``mathvista_correct`` (MathVista's official scoring) live in
  ``vlmrl.grading.mathvista`` and are re-exported here.

Symbolic equivalence (``2\\sqrt{2}`` = ``\\sqrt{8}``) is the ``expression`` type's alone, through math-verify in
a separate process (``vlmrl.grading.symbolic``); ``integer``/``float`` answers stay numeric. Deliberately left out:
numbers written in words, non-ASCII digits, and Unicode normalisation of text answers (full-width letters
differ from ASCII ones).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from decimal import Context, Decimal
from fractions import Fraction

from vlmrl.data.items import ANSWER_TYPES
from vlmrl.grading.mathvista import (  # noqa: F401 (re-exported: `from vlmrl.grading.grader import normalize_mathvista`)
    edit_distance,
    mathvista_correct,
    normalize_mathvista,
)
from vlmrl.grading.symbolic import MAX_EXPRESSION_CHARS, expressions_equal

# A solution longer than this cannot be "one number" with at most one unit; refusing it early bounds the
# work done on adversarial completions.
MAX_NUMBER_CHARS = 200
# Exponents beyond float range would make exact arithmetic explode (10**10**9) and mean inf or 0 anyway.
_MAX_EXPONENT = 400
_RELATIVE_TOLERANCE = Fraction(1, 10**9)
# Decimal's default context keeps 28 digits; a number of up to MAX_NUMBER_CHARS digits must stay exact.
_EXACT = Context(prec=2 * MAX_NUMBER_CHARS)

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


def grade(
    prediction: str,
    gold: str,
    answer_type: str,
    *,
    choices: Sequence[str] | None = None,
    precision: int | None = None,
) -> bool:
    """Whether ``prediction`` is the gold answer, by the rules of ``answer_type`` (docs/rewards.md).

    ``integer``/``float``: ``numeric_equal`` (``precision`` counts for floats). ``choice``: the gold choice's
    text (as ``text`` compares) or its letter (A = first of ``choices``; ``b``, ``(B)``, ``B.``, ``B)``).
    ``expression``: ``expression_equal``. ``text``: ``text_equal``. A prediction or gold that is not a string
    is never right; an ``answer_type`` outside ``ANSWER_TYPES`` is a ValueError (a typo must not zero every
    reward).

    >>> grade("12.0", "12", "integer"), grade("b)", "7", "choice", choices=["6", "7"])
    (True, True)
    >>> grade("Paris.", "paris", "text"), grade("Lyon", "paris", "text")
    (True, False)
    >>> grade("0.5", "\\\\frac{1}{2}", "expression"), grade("A", "7", "choice", choices=["6", "7"])
    (True, False)
    """
    if answer_type not in ANSWER_TYPES:
        raise ValueError(f"answer_type must be one of {', '.join(ANSWER_TYPES)}, got {answer_type!r}")
    if not isinstance(prediction, str) or not isinstance(gold, str):
        return False
    if answer_type in ("choice", "text"):  # numbers read it in parse_number, math-verify in expressions
        prediction, gold = latex_plain(prediction), latex_plain(gold)
        if choices is not None and not isinstance(choices, str):
            choices = [latex_plain(c) if isinstance(c, str) else c for c in choices]
    if answer_type == "integer":
        return numeric_equal(prediction, gold)
    if answer_type == "float":
        return numeric_equal(prediction, gold, precision=precision)
    if answer_type == "choice":
        return choice_equal(prediction, gold, choices)
    if answer_type == "expression":
        return expression_equal(prediction, gold)
    return text_equal(prediction, gold)


# LaTeX that dresses an answer without changing it (math-verify, behind TRL's accuracy_reward, reads it away too):
# text and font commands around plain text, the degree written `^\circ`, the thousands separator `{,}`, the
# LaTeX space `\ ` before a unit.
_STYLED_RE = re.compile(r"\\(?:text(?:bf|it|rm|sf|normal)?|math(?:bf|rm|it|sf)|mbox|operatorname)\s*\{([^{}]*)\}")
_DEGREE_RE = re.compile(r"\^\s*\{\s*\\(?:circ|degree)\s*\}|\^\s*\\(?:circ|degree)|\\(?:circ|degree)\b")
_PLAIN_PASSES = 8  # nested commands peeled per call (`\textbf{\text{B}}` takes two)


def latex_plain(text: str) -> str:
    r"""``text`` with the LaTeX that only dresses an answer read away: ``\text{}``, ``\textbf{}``, ``\mathbf{}``,
    ``\mathrm{}`` and their kin around plain text, braces around the whole answer, ``{,}`` as ``,``,
    ``^\circ`` / ``\degree`` as ``°``, ``\ `` as a space. Texts over ``MAX_TEXT_CHARS`` are left as they are
    (no answer that long is right).

    >>> latex_plain("\\text{Paris}"), latex_plain("\\textbf{\\text{B}}"), latex_plain("{4}"), latex_plain("1{,}000")
    ('Paris', 'B', '4', '1,000')
    >>> latex_plain("140^\\circ"), latex_plain("4\\ \\text{apples}"), latex_plain("\\frac{1}{2}")
    ('140°', '4 apples', '\\frac{1}{2}')
    """
    if len(text) > MAX_TEXT_CHARS or ("\\" not in text and "{" not in text):
        return text
    text = _DEGREE_RE.sub("°", text.replace("{,}", ",").replace("\\ ", " "))
    for _ in range(_PLAIN_PASSES):
        peeled = _outer_group(_STYLED_RE.sub(r"\1", text).strip())
        if peeled == text:
            break
        text = peeled
    return text


def _outer_group(text: str) -> str:
    r"""``{...}`` around the whole text, peeled once: ``{4}`` -> ``4``; ``{1}{2}`` and ``\{1\}`` stay."""
    if not (text.startswith("{") and text.endswith("}")):
        return text
    depth = 0
    for position, char in enumerate(text):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return text[1:-1].strip() if position == len(text) - 1 else text
    return text


_TRAILING = ".,;:!? "
# A text or choice answer longer than this (after trimming) is a derivation, not an answer: never right, and
# never normalised, so megabytes of repeated words cost nothing.
MAX_TEXT_CHARS = 10_000
# A letter answer, read on the normalised prediction (lower case, single spaces, no trailing "." left).
_LETTER_RE = re.compile(r"(?:\((?P<inner>[a-z])\)|(?P<bare>[a-z])[.)]?)(?: (?P<rest>.*))?", re.DOTALL)


def normalize_text(text: str) -> str:
    """``text`` compared case-insensitively, whitespace runs as one space, trailing ``.,;:!?`` dropped.

    >>> normalize_text("  The  Eiffel\\nTower. "), normalize_text("Yes!?"), normalize_text("C++")
    ('the eiffel tower', 'yes', 'c++')
    """
    return " ".join(text.split()).casefold().rstrip(_TRAILING)


def text_equal(prediction: str, gold: str) -> bool:
    """Whether the two are the same text once normalised (``normalize_text``); an empty gold matches nothing.

    >>> text_equal(" The  Eiffel Tower!", "the eiffel tower"), text_equal("Paris, France", "Paris")
    (True, False)
    """
    if _too_long(prediction):
        return False
    target = normalize_text(gold)
    return bool(target) and normalize_text(prediction) == target


def choice_equal(prediction: str, gold: str, choices: Sequence[str] | None) -> bool:
    """Whether ``prediction`` names the gold choice: by its text, or by its letter (A = first choice).

    The letter may be any case, in parentheses or followed by ``.`` or ``)``, and may be followed by the same
    choice's text (``(B) 140°``). A prediction that is the text of a choice is read as that text, never as a
    letter: with choices ``["B", "A"]``, ``B`` names the first choice.

    >>> opts = ["135°", "140°", "145°"]
    >>> [choice_equal(p, "140°", opts) for p in ("140°", "b", "(B)", "B.", "B) 140°", "C", "(B) 145°", "140")]
    [True, True, True, True, True, False, False, False]
    """
    if _too_long(prediction):
        return False
    target = normalize_text(gold)
    said = normalize_text(prediction)
    if not target or not said:
        return False
    if said == target:
        return True
    if isinstance(choices, str):  # one string is not a list of choices (its characters are no options)
        choices = None
    options = [normalize_text(str(choice)) for choice in choices or ()]
    if said in options:  # the text of another choice
        return False
    match = _LETTER_RE.fullmatch(said)
    if not match:
        return False
    index = ord(match["inner"] or match["bare"]) - ord("a")
    if index >= len(options) or options[index] != target:
        return False
    return match["rest"] is None or match["rest"] == target


def _too_long(prediction: str) -> bool:
    # strip() only when needed: whitespace padding around a short answer is still that answer
    return len(prediction) > MAX_TEXT_CHARS and len(prediction.strip()) > MAX_TEXT_CHARS


def expression_equal(prediction: str, gold: str) -> bool:
    """Whether two mathematical answers are equal: numbers by ``numeric_equal``, the rest by math-verify.

    Identical texts are equal. When both are plain numbers (what ``parse_number`` reads, fractions and
    ``\\frac`` included) the numeric rules decide, exactly and without a parser; otherwise math-verify compares
    them symbolically (``vlmrl.grading.symbolic``). Texts longer than ``MAX_EXPRESSION_CHARS`` are only equal when
    identical.

    >>> expression_equal("1/2", "\\\\frac{1}{2}"), expression_equal("0.5", "1/2"), expression_equal("0.6", "1/2")
    (True, True, False)
    """
    prediction, gold = prediction.strip(), gold.strip()
    if not prediction or not gold:
        return False
    if prediction == gold:
        return True
    if len(prediction) > MAX_EXPRESSION_CHARS or len(gold) > MAX_EXPRESSION_CHARS:
        return False
    if _parse_exact(prediction) is not None and _parse_exact(gold) is not None:
        return numeric_equal(prediction, gold)
    return expressions_equal(prediction, gold)


def parse_number(text: str) -> float | None:
    """The single finite number ``text`` writes, or None (two numbers, words only, nan, 1e999, too long).

    >>> parse_number("$\\\\boxed{1,000}$"), parse_number("-\\\\frac{3}{4}"), parse_number("30°")
    (1000.0, -0.75, 30.0)
    >>> parse_number("3 or 4") is None, parse_number("nan") is None, parse_number("1e999") is None
    (True, True, True)
    """
    value = _parse_exact(text)
    return None if value is None else float(value)


def numeric_equal(pred: str, gold: str, *, precision: int | None = None) -> bool:
    """Whether ``pred`` states the gold number, at the precision the gold answer is written with.

    A gold whose value is an integer must be matched exactly, however many digits it has; another gold
    written without decimals (``1/3``) within 1e-9 relative (``0.333333333333`` states it). A gold with d
    decimals is matched by any prediction that rounds (half away from zero) to it; ``precision``, when it asks
    for more decimals than the gold is written with, is the number of decimals used instead (gold ``1.5`` with
    precision 2 is read as ``1.50``).

    >>> numeric_equal("2.675", "2.68"), numeric_equal("1/2", "0.5"), numeric_equal("12 cm", "12")
    (True, True, True)
    >>> numeric_equal("2.4", "2"), numeric_equal("two", "2")
    (False, False)
    >>> numeric_equal("12345678901234567891", "12345678901234567890")  # 20 digits: exact
    False
    >>> numeric_equal("1.54", "1.5"), numeric_equal("1.54", "1.5", precision=2)
    (True, False)
    """
    if not isinstance(pred, str) or not isinstance(gold, str):
        return False
    pred_value, gold_value = _parse_exact(pred), _parse_exact(gold)
    if pred_value is None or gold_value is None:
        return False
    decimals = max(_decimals_written(gold), _valid_precision(precision))
    if decimals == 0:
        # An integral gold is matched exactly: a tolerance lets 20-digit integers match their neighbours.
        if gold_value.denominator == 1:
            return pred_value == gold_value
        tolerance = _RELATIVE_TOLERANCE * max(abs(pred_value), abs(gold_value))
        return abs(pred_value - gold_value) <= tolerance
    # Rounding the gold too only matters when precision asks for more decimals than a fraction gold has.
    return _round_half_away(pred_value, decimals) == _round_half_away(gold_value, decimals)


def _valid_precision(precision: object) -> int:
    """Decimals asked for by an item's ``precision`` (0 when absent, NaN, negative or absurd).

    >>> _valid_precision(2), _valid_precision(2.0), _valid_precision(None), _valid_precision(float("nan"))
    (2, 2, 0, 0)
    """
    if isinstance(precision, bool) or not isinstance(precision, (int, float)):
        return 0
    if not math.isfinite(precision) or precision < 0 or precision != int(precision):
        return 0
    return min(int(precision), _MAX_EXPONENT)


def _parse_exact(text: str) -> Fraction | None:
    """The exact value of the one number in ``text`` (exact so that rounding 2.675 is not a float accident)."""
    if not isinstance(text, str) or len(text) > MAX_NUMBER_CHARS:
        return None
    core = _number_core(text)
    frac = _FRAC_RE.fullmatch(core)
    if frac:
        return _ratio(frac["num"], frac["den"], negate=frac["sign"] in ("-", "\u2212"))
    if core.count("/") == 1:
        numerator, denominator = core.split("/")
        return _ratio(numerator, denominator, negate=False)
    return _parse_plain(core)


def _number_core(text: str) -> str:
    """The number's own text: wrappers, its LaTeX dress (``latex_plain``) and one trailing unit taken away."""
    return _unwrap(_strip_unit(_unwrap(latex_plain(_unwrap(text)))))


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
    value = Decimal(match["mantissa"].replace(",", "")).scaleb(exponent, context=_EXACT)
    if value != 0 and (abs(value.adjusted()) > _MAX_EXPONENT or not math.isfinite(float(value))):
        return None
    exact = Fraction(value)
    return -exact if match["sign"] in ("-", "\u2212") else exact


def _decimals_written(gold: str) -> int:
    """How many decimals the gold answer states (``12.50`` -> 2, ``1.5e3`` -> 0, ``1/3`` -> 0)."""
    match = _PLAIN_RE.fullmatch(_number_core(gold))
    if not match:
        return 0
    value = Decimal(match["mantissa"].replace(",", "")).scaleb(int(match["exp"] or 0), context=_EXACT)
    exponent = value.as_tuple().exponent
    return max(0, -int(exponent))


def _round_half_away(value: Fraction, decimals: int) -> Fraction:
    scale = 10**decimals
    magnitude = math.floor(abs(value) * scale + Fraction(1, 2))
    return Fraction(magnitude if value >= 0 else -magnitude, scale)
