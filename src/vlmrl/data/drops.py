"""The drop table: for each reason rows were dropped, how many, one example with its value, and the fix.

`prepare` writes it into `data/summary.json` (`drops`), and `vlmrl prepare` / `vlmrl run` print it, so half of
a file going missing is never silent. The example is the first row dropped for that reason (its id and the
detail, which quotes the offending value); the fix is the row's own when the drop named one (a filtered
answer type says which type to add), else the reason's usual one below. Every row stays in
`data/dropped.jsonl`.

>>> table = drop_table([Dropped("q1", "bad_choices", "column 'options': 'a;b' is not a list", fix="use a list")])
>>> table[0]["reason"], table[0]["count"], table[0]["example_id"], table[0]["fix"]
('bad_choices', 1, 'q1', 'use a list')
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from vlmrl.data.items import Dropped

FIXES = {
    "bad_row": "make each line one JSON object (a CSV row: as many cells as the header)",
    "bad_encoding": "save the file as UTF-8 (a lone surrogate such as \\ud800 in JSON is not text either)",
    "too_deeply_nested": "flatten the row (64 levels at most)",
    "cell_too_large": "shorten the cell (131,072 characters at most), or keep large values out of the data file",
    "row_too_large": "keep each line under 8 MiB: store large values (images, documents) as files beside the data",
    "too_many_columns": "keep the columns the task needs (1,000 at most)",
    "missing_question": "fill the question, or map another column (data.columns.question)",
    "bad_prompt": "give the prompt one system and one user turn (few-shot turns belong in the user text)",
    "missing_answer": "fill the answer, or map another column (data.columns.answer)",
    "bad_answer": "make the answer text or a number",
    "non_numeric_answer": "fix the answer, or declare its type (data.answer_type or an answer_type column)",
    "unknown_answer_type": "write one of integer, float, choice, expression, text",
    "filtered_answer_type": "add the row's type to data.answer_types",
    "missing_choices": "map the choices column (data.columns.choices)",
    "bad_choices": "write choices as a JSON or Python list, or set data.choices_separator",
    "answer_not_in_choices": "make the gold answer the text of one of the choices",
    "missing_image": "map the column holding the image (data.columns.image or images), or fill it",
    "bad_images": "write the images cell as a JSON list of paths",
    "image_and_images": "keep each row's images in one of the two columns",
    "image_url": "download the image and give its path",
    "outside_data_folder": "keep images inside the data file's folder",
    "corrupt_image": "replace the image file",
    "truncated_image": "replace the image file",
    "too_large": "shrink the image",
    "too_small": "use a larger image",
    "duplicate_id": "make ids unique (or map no id: rows are then named by file and row)",
    "prompt_too_long": "raise data.max_prompt_tokens, or lower data.image_size",
    "token_count_failed": "see the detail: the model's processor failed on this row",
    "contaminated_holdout": "nothing if the pictures are copies (this keeps held-out images out of training); for "
    "distinct pictures, set data.contamination: exact (identical pictures only) or lower "
    "data.contamination_max_distance",
    "beyond_holdout_size": "raise data.holdout_size to evaluate on more of the held-out split",
}
EXAMPLE_CHARS = 160  # an example's detail is cut here in the table (dropped.jsonl keeps it whole)


def drop_table(dropped: list[Dropped]) -> list[dict[str, Any]]:
    """One row per reason, most frequent first: reason, count, example_id, example (the detail), fix."""
    first: dict[str, Dropped] = {}
    for row in dropped:
        first.setdefault(row.reason, row)
    return [
        {
            "reason": reason,
            "count": count,
            "example_id": first[reason].id,
            "example": _cut(first[reason].detail),
            "fix": first[reason].fix or FIXES.get(reason, "see data/dropped.jsonl"),
        }
        for reason, count in Counter(d.reason for d in dropped).most_common()
    ]


def drop_lines(table: list[dict[str, Any]], input_rows: int) -> list[str]:
    """The table as plain lines for the console (`vlmrl run`'s log; `vlmrl prepare` draws it with rich).

    >>> print("\\n".join(drop_lines([{"reason": "missing_image", "count": 2, "example_id": "a.csv:3",
    ...                               "example": "no image", "fix": "map it"}], 10)))
    dropped 2 of 10 rows (data/dropped.jsonl):
      missing_image: 2, e.g. a.csv:3: no image -> fix: map it
    """
    if not table:
        return []
    total = sum(row["count"] for row in table)
    lines = [f"dropped {total} of {input_rows} rows (data/dropped.jsonl):"]
    lines += [f"  {row['reason']}: {row['count']}, e.g. {row['example_id']}: {row['example']} -> fix: {row['fix']}"
              for row in table]
    return lines


def _cut(text: str) -> str:
    return text if len(text) <= EXAMPLE_CHARS else text[: EXAMPLE_CHARS - 1] + "…"
