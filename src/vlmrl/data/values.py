"""Cell values as the data stage must keep them: gold numbers exactly as written, everything else JSON-safe.

A gold answer never goes through `float`: "12345678901234567890" stays those 20 digits, "0.10" keeps its two
decimals, and a float64 cell (Parquet, hub data) is written back as the shortest text that reads back to the
same double, with an integral value losing its ".0" (a float64 column turns the gold 3 into 3.0; the data
meant 3). `json_safe` turns whatever a column holds (bytes, Decimal, dates, NaN, numpy scalars, nesting) into
plain JSON so a manifest line can always be written; `depth` finds rows nested too deeply to keep, and
`cell_problem` rows no later step should see: a text cell over `MAX_CELL_CHARS` (a tokenizer given a 200 MB
question needs tens of GB), more than `MAX_COLUMNS` columns, or a lone surrogate (valid JSON, not writable
as UTF-8) in a column's name or value.
Left out: locale number formats ("1.000,5"), fractions and scientific notation in gold answers (those are
`expression` answers).
"""

from __future__ import annotations

import base64
import datetime
import decimal
import math
import re
from typing import Any

MAX_DEPTH = 64  # nesting kept in a row; deeper rows are dropped (`too_deeply_nested`)
MAX_CELL_CHARS = 131_072  # characters in one text cell (the csv module's own limit); no question comes near it
MAX_COLUMNS = 1000  # columns of a row; a wider file is refused or its rows dropped (`too_many_columns`)
_PLAIN = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)$")
_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(,\d{3})+(\.\d+)?$")
_WITH_UNIT = re.compile(r"^\$?\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+))\s*[^\d]*$")  # "6cm", "135°", "$4"
_LATEX = re.compile(r"\\[A-Za-z]+|\$|[\^_]\{")  # \frac, \sqrt, $...$, x^{2}, a_{1}
# Plain symbolic maths: digits, one-letter variables, operators, brackets and a few function names only.
_SYMBOLIC = re.compile(r"^(?:\s|\d|\.|[a-zA-Z](?![a-zA-Z])|sqrt|pi|sin|cos|tan|log|ln|exp|[-+*/^()=,π√·×])+$")
_OPERATOR = re.compile(r"[-+*/^=π√·×]|sqrt|pi|sin|cos|tan|log|ln|exp")


def number_text(value: Any, *, allow_unit: bool = False) -> str | None:
    """The exact text of the number a cell states, or None; never through float for text and ints.

    >>> number_text("12345678901234567890"), number_text("1,000"), number_text("+0.50"), number_text(3.0)
    ('12345678901234567890', '1000', '0.50', '3')
    >>> number_text(0.1), number_text("6cm", allow_unit=True), number_text("6cm"), number_text(float("inf"))
    ('0.1', '6', None, None)
    >>> number_text("9" * 400 + ".5")[-3:], number_text(True), number_text(".5")
    ('9.5', None, '0.5')
    """
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, decimal.Decimal):
        return _tidy(format(value, "f")) if value.is_finite() else None
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return str(int(value)) if value.is_integer() else repr(value)
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # numpy scalars
        try:
            return number_text(value.item(), allow_unit=allow_unit)
        except (TypeError, ValueError):
            return None
    if not isinstance(value, str):
        return None
    text = value.strip()
    if _THOUSANDS.match(text):
        text = text.replace(",", "")
    if _PLAIN.match(text):
        return _tidy(text)
    match = _WITH_UNIT.match(text) if allow_unit else None
    return _tidy(match.group(1)) if match else None


def looks_like_expression(text: str) -> bool:
    """Whether a gold that is not a plain number is maths (LaTeX or a symbolic expression), not prose.

    >>> [looks_like_expression(t) for t in ("\\\\frac{1}{2}", "2\\\\sqrt{3}", "1/2", "x^2 + 1", "3pi", "$4$")]
    [True, True, True, True, True, True]
    >>> [looks_like_expression(t) for t in ("red", "the Eiffel Tower", "B", "A-B", "2020-01-02T10:00", "")]
    [False, False, False, False, False, False]
    """
    text = text.strip()
    if not text or len(text) > 300:
        return False
    if _LATEX.search(text):
        return True
    if not _SYMBOLIC.match(text) or not _OPERATOR.search(text):
        return False
    # an operator between letters alone ("A-B", "x=y") reads as a label more often than as maths
    return any(ch.isdigit() for ch in text) or bool(re.search(r"sqrt|pi|π|√|\^", text))


def is_integer_text(text: str) -> bool:
    """Whether an exact number text is integral ("3", "-3.00"); "3.5" is not.

    >>> is_integer_text("3"), is_integer_text("-3.00"), is_integer_text("3.5")
    (True, True, False)
    """
    return "." not in text or set(text.split(".", 1)[1]) <= {"0"}


def integer_text(text: str) -> str:
    """An integral number text without its zero decimals: "3.00" -> "3", "-0.0" -> "0".

    >>> integer_text("3.00"), integer_text("-0.0"), integer_text("-7")
    ('3', '0', '-7')
    """
    whole = text.split(".", 1)[0] or "0"
    return "0" if set(whole.lstrip("-")) <= {"0"} else whole


def decimals_of(text: str) -> int:
    """Digits after the decimal point of a plain number string ("8.50" -> 2).

    >>> decimals_of("8.50"), decimals_of("8")
    (2, 0)
    """
    text = str(text).strip()
    return len(text.split(".", 1)[1]) if "." in text else 0


def depth(value: Any, limit: int = MAX_DEPTH) -> int:
    """Nesting depth of lists/dicts, counted without recursion and stopping once past `limit`.

    >>> depth(1), depth([1, [2]]), depth({"a": {"b": []}}), depth([[[[]]]], limit=2)
    (0, 2, 3, 3)
    """
    deepest, stack = 0, [(value, 0)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, (list, tuple, dict)):
            level += 1
            deepest = max(deepest, level)
            if deepest > limit:
                return deepest
            stack.extend((child, level) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def cell_problem(row: dict[str, Any]) -> tuple[str, str] | None:
    """(reason, detail) for a row no later step should see, else None; columns named `__...` are vlmrl's own.

    Call it on rows whose `depth` is within MAX_DEPTH. The detail names the column with `ascii()`, so a lone
    surrogate in it can still be written.

    >>> cell_problem({"q": "x" * (MAX_CELL_CHARS + 1)})
    ('cell_too_large', "column 'q' holds 131,073 characters (limit 131,072)")
    >>> cell_problem({"id": "a\\ud800"}), cell_problem({"q": ["ok", {"deep": "fine"}]})
    (('bad_encoding', "column 'id' holds a lone surrogate ('a\\\\ud800'), not valid Unicode"), None)
    """
    names = [k for k in row if not (isinstance(k, str) and k.startswith("__"))]
    if len(names) > MAX_COLUMNS:
        return "too_many_columns", f"{len(names):,} columns (limit {MAX_COLUMNS:,})"
    for name in names:
        if isinstance(name, str) and not _writable(name):
            return "bad_encoding", f"the column name {ascii(name)[:80]} holds a lone surrogate, not valid Unicode"
        stack = [row[name]]
        while stack:
            value = stack.pop()
            if isinstance(value, str):
                if len(value) > MAX_CELL_CHARS:
                    return ("cell_too_large",
                            f"column {ascii(name)[:80]} holds {len(value):,} characters (limit {MAX_CELL_CHARS:,})")
                if not _writable(value):
                    return ("bad_encoding",
                            f"column {ascii(name)[:80]} holds a lone surrogate ({ascii(value)[:80]}), not valid Unicode")
            elif isinstance(value, dict):
                for key in value:
                    if isinstance(key, str) and not _writable(key):
                        return "bad_encoding", f"column {ascii(name)[:80]} has a key with a lone surrogate"
                stack.extend(value.values())
            elif isinstance(value, (list, tuple)):
                stack.extend(value)
    return None


def _writable(text: str) -> bool:
    """Whether `text` encodes as UTF-8 (a lone surrogate, valid in JSON, does not)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def json_safe(value: Any) -> Any:
    """`value` as plain JSON (call it on rows whose `depth` is within MAX_DEPTH).

    Bytes become {"base64": ...} only when short (<= 1 KiB; images are not extras), else a size note; NaN and
    infinities become their names as text; anything else unknown becomes its `str`.

    >>> json_safe({"a": (1, float("nan")), 2: b"hi", "d": decimal.Decimal("1.10")})
    {'a': [1, 'nan'], '2': {'base64': 'aGk='}, 'd': '1.10'}
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [json_safe(v) for v in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        return {"base64": base64.b64encode(raw).decode()} if len(raw) <= 1024 else f"<{len(raw)} bytes>"
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, (datetime.date, datetime.time, datetime.datetime)):
        return value.isoformat()
    if hasattr(value, "item") and hasattr(value, "dtype"):  # numpy scalar
        try:
            return json_safe(value.item())
        except (TypeError, ValueError):
            pass
    if hasattr(value, "tolist"):  # numpy array
        return json_safe(value.tolist())
    return str(value)


def _tidy(text: str) -> str:
    """Drop a leading '+', give '.5' its zero, and a trailing '.' its absence: the written digits stay."""
    text = text.lstrip("+")
    sign = "-" if text.startswith("-") else ""
    text = text.lstrip("-")
    if text.startswith("."):
        text = "0" + text
    text = text.removesuffix(".")
    return sign + text
