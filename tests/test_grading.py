"""Grading: reading one number, comparing at the gold precision, and MathVista-faithful normalization."""

from __future__ import annotations

import doctest
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import vlmrl.grading.grader
from vlmrl.grading.grader import (
    edit_distance,
    mathvista_correct,
    normalize_mathvista,
    numeric_equal,
    parse_number,
)

ORACLE = Path(__file__).resolve().parents[2] / "shared" / "data" / "mathvista_normalization_oracle.jsonl"
ORACLE_ROWS = 23_998


# --- parse_number ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("42", 42.0),  # plain integer
        ("-3", -3.0),  # sign
        ("+3", 3.0),  # explicit plus
        ("\u22123", -3.0),  # typeset minus sign U+2212
        (".5", 0.5),  # leading-dot decimal
        ("-.25", -0.25),  # signed leading-dot decimal
        ("5.", 5.0),  # trailing dot ends a sentence, still a number
        ("1,000", 1000.0),  # thousands separator
        ("12,345,678.5", 12345678.5),  # several separators and decimals
        ("1.5e3", 1500.0),  # scientific notation
        ("2E-2", 0.02),  # capital exponent, negative
        ("3/4", 0.75),  # simple fraction
        ("-1 / 2", -0.5),  # fraction with spaces and sign
        ("\\frac{1}{4}", 0.25),  # LaTeX fraction
        ("\\dfrac{3}{2}", 1.5),  # display fraction
        ("-\\frac{1}{2}", -0.5),  # sign before the fraction
        ("$7$", 7.0),  # inline math
        ("\\(7\\)", 7.0),  # LaTeX inline math
        ("\\boxed{7}", 7.0),  # boxed
        ("$\\boxed{7}$", 7.0),  # nested wrappers
        ("30°", 30.0),  # degree sign
        ("30^\\circ", 30.0),  # LaTeX degree
        ("$30^{\\circ}$", 30.0),  # braced LaTeX degree in math mode
        ("5 cm", 5.0),  # one unit word
        ("12 m^2", 12.0),  # unit with a power
        ("50%", 50.0),  # percent keeps the number as written
        ("50\\%", 50.0),  # escaped LaTeX percent
        ("\\boxed{12} cm", 12.0),  # unit after a wrapper
        ("  8\n", 8.0),  # surrounding whitespace
    ],
)
def test_parse_number_accepts(text, expected):
    assert parse_number(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",  # empty
        "   ",  # whitespace only
        "four",  # words only
        "3 or 4",  # two numbers
        "3 4",  # two numbers, no words
        "1,00",  # malformed thousands group
        "12,5",  # decimal comma is ambiguous
        "nan",  # not a number
        "inf",  # infinity
        "5 nan",  # "nan" is not a unit
        "1e999",  # overflows to infinity
        "1e-999",  # underflows out of range
        "1/0",  # division by zero
        "5 cm cm",  # only one unit
        "5 square meters",  # a two-word unit is not "one unit"
        "\u0663",  # Arabic-Indic digit three: ASCII digits only
        "\uff11\uff12",  # fullwidth 12
        "5\x00",  # NUL byte
        "1" * 201,  # longer than MAX_NUMBER_CHARS cannot be "one number"
    ],
)
def test_parse_number_rejects(text):
    assert parse_number(text) is None


# --- numeric_equal -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pred", "gold", "expected"),
    [
        ("12", "12", True),  # same integer
        ("12.0", "12", True),  # integer gold, equal value
        ("12.4", "12", False),  # integer gold needs equality, no rounding
        ("1,000", "1000", True),  # separators on the prediction side
        ("0.333333333333", "1/3", True),  # within 1e-9 relative of an integer-style gold
        ("0.3333", "1/3", False),  # not within 1e-9
        ("2.675", "2.68", True),  # half away from zero, decimal arithmetic (float round gives 2.67)
        ("-2.675", "-2.68", True),  # away from zero for negatives too
        ("2.674", "2.68", False),  # rounds to 2.67
        ("1/3", "0.33", True),  # fraction rounded to the gold's 2 decimals
        ("0.5", "\\frac{1}{2}", True),  # LaTeX gold
        ("1.04", "1.0", True),  # gold with one decimal accepts what rounds to it
        ("1.05", "1.0", False),  # rounds to 1.1
        ("1.5e3", "1500", True),  # scientific prediction
        ("30°", "30", True),  # unit on the prediction
        ("50%", "50", True),  # percent is the number as written
        ("50%", "0.5", False),  # ... not a fraction of one
        ("3 or 4", "3", False),  # two numbers never match
        ("three", "3", False),  # words never match
        ("", "0", False),  # empty never matches
        ("nan", "nan", False),  # NaN never matches, even itself
        ("1e999", "1e999", False),  # infinity never matches
        ("0", "0", True),  # zero gold
        ("1e-12", "0", False),  # zero gold needs exact zero
        ("12345678901234567891", "12345678901234567890", False),  # 20 digits, last differs: not equal
        ("12345678901234567890", "12345678901234567890", True),  # 20 digits, same
        ("12,345,678,901,234,567,890.0", "12345678901234567890", True),  # same value, other notation
        ("12.0000000001", "12", False),  # an integer gold is matched exactly, no relative tolerance
        ("2", "4/2", True),  # a fraction gold with an integer value is matched exactly too
    ],
)
def test_numeric_equal(pred, gold, expected):
    assert numeric_equal(pred, gold) is expected


@pytest.mark.parametrize(
    ("pred", "gold", "precision", "expected"),
    [
        ("1.54", "1.5", None, True),  # gold's own 1 decimal: 1.54 rounds to 1.5
        ("1.54", "1.5", 2, False),  # precision 2 reads the gold as 1.50
        ("1.504", "1.5", 2, True),  # rounds to 1.50
        ("3.04", "3", 1, True),  # an integral gold with precision 1 is 3.0 at one decimal
        ("3.04", "3", None, False),  # without precision an integral gold is exact
        ("0.33", "1/3", 2, True),  # a fraction gold is rounded to precision as well
        ("2.68", "2.675", 2, False),  # precision below the written decimals never loosens the gold
        ("2.675", "2.675", 2, True),
        ("1.54", "1.5", float("nan"), True),  # NaN precision (hub float64 column) is ignored
        ("1.54", "1.5", -1, True),  # so is a negative one
    ],
)
def test_numeric_equal_with_precision(pred, gold, precision, expected):
    assert numeric_equal(pred, gold, precision=precision) is expected


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=10**15, max_value=10**40), st.integers(min_value=1, max_value=9))
def test_long_integers_compare_exactly(n, delta):
    assert numeric_equal(str(n), str(n))
    assert not numeric_equal(str(n + delta), str(n))
    assert not numeric_equal(str(n), str(n + delta))


def _scientific(n: int) -> str:
    """n in exact scientific notation: 1234 -> "1.234e3"."""
    sign, digits = ("-" if n < 0 else ""), str(abs(n))
    return f"{sign}{digits[0]}.{digits[1:] or '0'}e{len(digits) - 1}"


def _notations(n: int) -> list[str]:
    """Every accepted way to write the integer n."""
    plain = str(n)
    return [
        plain,
        f"{n:,}",
        f"{plain}.0",
        f"{plain}.00",
        _scientific(n),
        f"{2 * n}/2",
        f"\\frac{{{2 * n}}}{{2}}",
        f"\\dfrac{{{3 * n}}}{{3}}",
        f"${plain}$",
        f"\\({plain}\\)",
        f"\\boxed{{{plain}}}",
        f"$\\boxed{{{n:,}}}$",
        f"{plain}°",
        f"{plain} cm",
        f"{plain}%",
        f"{plain}^\\circ",
        f"+{plain}" if n >= 0 else plain.replace("-", "\u2212"),
    ]


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=-(10**12), max_value=10**12))
def test_numeric_equal_same_integer_in_every_notation(n):
    for written in _notations(n):
        assert numeric_equal(written, str(n)), written


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300) | st.text(alphabet="0123456789.,-+/eE$%° \\{}frac", max_size=220))
def test_parse_and_compare_never_raise(text):
    value = parse_number(text)
    assert value is None or math.isfinite(value)
    numeric_equal(text, text)
    numeric_equal(text, "12")


# --- normalize_mathvista / mathvista_correct ---------------------------------------------------------------

CHOICES = ["135°", "140°", "145°", "150°"]


@pytest.mark.parametrize(
    ("extraction", "expected"),
    [
        ("C", "145°"),  # option letter -> its choice
        ("(b)", "140°"),  # parenthesised lowercase letter
        ("(D) 150 degrees", "150°"),  # letter in parentheses wins over the text
        ("  A  ", "135°"),  # whitespace stripped for multiple choice
        ("145°", "145°"),  # the exact choice
        ("145", "145°"),  # nearest by edit distance (1 edit)
        ("146", "140°"),  # 2 edits from both 140° and 145°: the first wins
        ("b", "135°"),  # bare lowercase letter is not an option: nearest choice (first of ties)
        ("", "135°"),  # empty: distance = length, first shortest choice
        (None, "135°"),  # non-string becomes "None", then nearest
        ("E", "135°"),  # letter past the options: nearest
    ],
)
def test_normalize_multi_choice(extraction, expected):
    got = normalize_mathvista(extraction, question_type="multi_choice", answer_type="text", choices=CHOICES)
    assert got == expected


def test_normalize_multi_choice_ties_take_the_first_choice():
    # "ab" is one edit from both "aa" and "bb": the official code takes the first minimum.
    assert (
        normalize_mathvista("ab", question_type="multi_choice", answer_type="text", choices=["bb", "aa"])
        == "bb"
    )


def test_normalize_multi_choice_without_choices_is_an_error():
    with pytest.raises(ValueError, match="choices"):
        normalize_mathvista("A", question_type="multi_choice", answer_type="text", choices=[])


@pytest.mark.parametrize(
    ("extraction", "answer_type", "precision", "expected"),
    [
        ("3", "integer", None, "3"),  # integer as is
        ("3.9", "integer", None, "3"),  # truncated, not rounded
        ("-3.9", "integer", None, "-3"),  # truncation towards zero
        (" 7 ", "integer", None, "7"),  # float() tolerates whitespace
        ("1e3", "integer", None, "1000"),  # scientific
        ("N/A", "integer", None, None),  # unparseable
        ("", "integer", None, None),  # empty
        (None, "integer", None, None),  # missing
        ("nan", "integer", None, None),  # int(nan) fails
        ("inf", "integer", None, None),  # int(inf) fails
        ("3.14159", "float", 2, "3.14"),  # rounded to precision
        ("3.14159", "float", 2.0, "3.14"),  # float precision (Hugging Face copy) is cast
        ("1.25", "float", 1, "1.2"),  # Python round: binary value of 1.25 is exact, half to even
        ("2", "float", 1, "2.0"),  # float formatting adds ".0"
        ("2.5", "float", None, "2"),  # no precision: round(x, None) is an int, half to even
        ("Infinity", "float", 2, "inf"),  # float keeps infinity as text
        ("abc", "float", 1, None),  # unparseable
        ("[1, 2]", "list", None, "[1, 2]"),  # list: the string itself
        ("1,2", "list", None, "1,2"),  # list: no reformatting at all
        (None, "list", None, "None"),  # list: str(None), as official
    ],
)
def test_normalize_free_form(extraction, answer_type, precision, expected):
    got = normalize_mathvista(
        extraction, question_type="free_form", answer_type=answer_type, precision=precision
    )
    assert got == expected


@pytest.mark.parametrize(
    ("normalized", "gold", "expected"),
    [
        ("145°", "145°", True),  # equal strings
        ("3.0", "3", False),  # no numeric comparison
        (None, "3", False),  # unparseable never equals
        ("[1, 2]", "[1,2]", False),  # list spacing matters
    ],
)
def test_mathvista_correct(normalized, gold, expected):
    assert mathvista_correct(normalized, gold) is expected


def test_mathvista_correct_swallows_comparison_errors():
    class Exploding:
        def __eq__(self, other):
            raise RuntimeError("boom")

    assert mathvista_correct(Exploding(), "3") is False


def test_oracle_reproduced_on_every_row():
    assert ORACLE.is_file(), (
        f"MathVista oracle not found at {ORACLE}; lay the shared/ folder beside the repository "
        "(shared/data/mathvista_normalization_oracle.jsonl) as CI does"
    )
    rows = [json.loads(line) for line in ORACLE.read_text(encoding="utf-8").splitlines() if line.strip()]
    agree, mismatches = 0, []
    for row in rows:
        normalized = normalize_mathvista(
            row["extraction"],
            question_type=row["question_type"],
            answer_type=row["answer_type"],
            precision=row["precision"],
            choices=row["choices"],
        )
        expected = row["official_normalized"]
        same = type(normalized) is type(expected) and normalized == expected
        if same and mathvista_correct(normalized, row["answer"]) == row["official_correct"]:
            agree += 1
        elif len(mismatches) < 5:
            mismatches.append((row["source"], row["pid"], row["extraction"], normalized, expected))
    print(f"MathVista oracle agreement: {agree}/{len(rows)}")
    assert len(rows) == ORACLE_ROWS
    assert agree == ORACLE_ROWS, mismatches


# --- edit_distance -----------------------------------------------------------------------------------------


def _reference_distance(a: str, b: str) -> int:
    """Textbook full-matrix Levenshtein, no shortcuts."""
    table = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            table[i][j] = min(
                table[i - 1][j] + 1, table[i][j - 1] + 1, table[i - 1][j - 1] + (a[i - 1] != b[j - 1])
            )
    return table[-1][-1]


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="abc°", max_size=12), st.text(alphabet="abc°", max_size=12))
def test_edit_distance_matches_the_textbook_definition(a, b):
    assert edit_distance(a, b) == _reference_distance(a, b) == edit_distance(b, a)


def test_doctests_pass():
    result = doctest.testmod(vlmrl.grading.grader)
    assert result.attempted > 0 and result.failed == 0
