"""The training items as the columns of the dataset TRL's GRPOTrainer reads.

TRL builds each prompt from the conversational `prompt` column (the item's system message, when it has one,
then the user turn) and the `images` column (a list of images per
prompt, inserted in order before the text), and hands every other column to each reward function as a
keyword argument, one value per completion. So the table holds `Item.columns()` for every item: the mapped
fields (id, question, answer, answer_type, precision, unit, choices, category, source) and the user's extra
columns.

Arrow needs one type per column. An extra column keeps its values as they are when every present value has
the same scalar JSON type (all text, all integers, all floats or all booleans); otherwise (mixed types,
lists, mappings) each value is its JSON text, to be `json.loads`-ed by the reward that wants it. A missing
value is None either way. An extra column whose name TRL uses itself (prompt, images, completion, ...) is
renamed `extra_<name>`. `expected_columns` says which columns a config's data will give, before any
preparing, so `vlmrl config validate` refuses a reward that asks for another. Left out: keeping nested extra
columns as Arrow structs (keys would be filled in).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlmrl.config.schema import DataConfig
from vlmrl.data.items import RESERVED_COLUMNS, DataError, Item

SCALARS = (str, bool, int, float)
MAPPED = ("id", "question", "answer", "answer_type", "precision", "unit", "choices", "category", "source")
PEEK_ROWS = 100  # rows `expected_columns` reads: JSONL rows may differ in their columns


def train_table(items: Sequence[Item], run_dir: Path) -> dict[str, list[Any]]:
    """Column name -> one value per item: `prompt`, `images` (absolute paths) and every item column."""
    table: dict[str, list[Any]] = {
        "prompt": [([{"role": "system", "content": item.system}] if item.system else [])
                   + [{"role": "user", "content": item.prompt}] for item in items],
        "images": [[str(path) for path in item.image_paths(run_dir)] for item in items],
    }
    rows = [item.columns() for item in items]  # extras named like TRL's own arguments: extra_<name>
    for name in MAPPED:  # typed fields: one type per column already (choices: a list of text or None)
        table[name] = [row[name] for row in rows]
    extras = list(dict.fromkeys(name for row in rows for name in row if name not in MAPPED))
    for name in extras:
        table[name] = arrow_column([row.get(name) for row in rows])
    return table


def arrow_column(values: list[Any]) -> list[Any]:
    """Values Arrow can hold in one column: as they are when of one scalar type, else JSON text.

    >>> arrow_column([1, None, 3]), arrow_column(["a", 2]), arrow_column([[1], None])
    ([1, None, 3], ['"a"', '2'], ['[1]', None])
    >>> arrow_column([True, 1])  # bool is not int here: a flag column and a count column differ
    ['true', '1']
    """
    kinds = {type(v) for v in values if v is not None}
    if len(kinds) <= 1 and kinds <= set(SCALARS):
        return list(values)
    return [json.dumps(v, sort_keys=True) if v is not None else None for v in values]


def expected_columns(data: DataConfig) -> set[str] | None:
    """The columns reward functions will receive for `data` (besides TRL's own arguments), read off the
    source's first PEEK_ROWS rows; None when that cannot be told without preparing (a hub id, which would be
    downloaded, or a source that cannot be read: `vlmrl prepare` says why)."""
    from vlmrl.data.sources import open_rows

    names = set(MAPPED) | {"image", "images"}
    if data.source == "synthetic":
        return names
    path = Path(data.source).expanduser()
    if not path.exists():
        return None
    try:
        rows = list(itertools.islice(open_rows(data).rows, PEEK_ROWS))
    except (DataError, OSError):
        return None
    if not data.columns and not any("file_name" in row for row in rows):  # MathVista's schema: no extras
        return names
    images = {data.columns[k] for k in ("image", "images") if k in data.columns} or {"file_name"}
    found = {k for row in rows for k in row if not k.startswith("__") and k not in images}
    return names | {f"extra_{k}" if k in RESERVED_COLUMNS else k for k in found}
