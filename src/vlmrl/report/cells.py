"""Small HTML pieces shared by every report section: escaping, numbers, number cells and tables.

Every number cell keeps the exact file value in `data-value`, so each shown figure can be checked against its
file. Left out: any layout (that is `page`'s CSS).
"""

from __future__ import annotations

import html
import json
from typing import Any

from vlmrl.common.stats import finite


def table(head: list[str], rows: list[str], cls: str = "") -> str:
    header = "".join(f"<th>{h}</th>" for h in head)
    return f'<table class="{cls}"><thead><tr>{header}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def kv_table(data: dict, depth: int = 0) -> str:
    """A dict of any shape as a compact key/value table; nested dicts nest twice, then show as JSON."""
    rows = "".join(
        f"<tr><th>{esc(k)}</th><td>"
        f"{kv_table(v, depth + 1) if isinstance(v, dict) and v and depth < 2 else esc(short(v))}</td></tr>"
        for k, v in data.items())
    return f'<table class="kv">{rows}</table>'


def short(value: Any) -> str:
    if value is None or isinstance(value, str):
        return value or ""
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 400 else text[:400] + " …"


def id_link(item_id: Any) -> str:
    return f'<a href="#samples" data-goto="{esc(item_id)}"><code>{esc(item_id)}</code></a>'


def interval(ci: Any) -> str:
    return f"[{num(ci[0])}, {num(ci[1])}]" if isinstance(ci, list) and len(ci) == 2 else "–"


def num(value: Any, fmt: str = ".3f", signed: bool = False) -> str:
    if not finite(value):
        return "–" if value is None else esc(value)
    if fmt == "d" or isinstance(value, int) and fmt == ".3f":
        return format(round(value), "+d" if signed else "d")
    return format(value, ("+" if signed else "") + fmt)


def num_td(value: Any, fmt: str = ".3f", signed: bool = False) -> str:
    """A number cell; `data-value` keeps the exact file value, so every shown number can be checked."""
    direction = "" if not (signed and finite(value) and value) else " up" if value > 0 else " down"
    raw = f' data-value="{esc(json.dumps(value))}"' if finite(value) else ""
    return f'<td class="num{direction}"{raw}>{num(value, fmt, signed)}</td>'


def delta_td(before: Any, after: Any) -> str:
    return num_td(after - before, signed=True) if finite(before) and finite(after) else "<td></td>"


def esc(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)

