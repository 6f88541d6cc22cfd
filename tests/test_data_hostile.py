"""Hostile input for the data stage (issue 18, items 2 and 5): every row is kept or dropped with a reason
whatever its types, encoding or nesting; a file that cannot be read is one DataError naming it; gold answers
are stored exactly as written; image paths stay inside the data folder. Each case crashed, lost a row, changed
a gold or followed a path out of the data before this suite's fixes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import placeholder_image
from vlmrl.common.io import read_jsonl
from vlmrl.config.schema import load_config
from vlmrl.data.items import Candidate, DataError, Dropped, read_items
from vlmrl.data.mathvista import convert_rows
from vlmrl.data.prepare import prepare_data
from vlmrl.data.values import number_text

MAPPING = "data.columns={id: id, question: question, answer: answer, image: image}"


def mathvista_row(pid: str, **fields) -> dict:
    return {
        "pid": pid,
        "question": f"Question {pid}?",
        "answer": "3",
        "question_type": "free_form",
        "answer_type": "integer",
        "image": f"{pid}.png",
        "precision": None,
        "unit": None,
        "choices": None,
        "metadata": {"task": "t"},
        **fields,
    }


def source(tmp_path: Path, lines: list[bytes], *, images: int = 4, name: str = "rows.jsonl") -> Path:
    for k in range(images):
        placeholder_image(f"h{k}").save(tmp_path / f"{k}.png")
    path = tmp_path / name
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def row_line(k: int, **fields) -> bytes:
    return json.dumps(
        {"id": f"r{k}", "question": "How many?", "answer": str(k), "image": f"{k}.png", **fields}
    ).encode()


def prepared(tmp_path: Path, path: Path, *overrides: str):
    config = load_config(
        "demo", [f"data.source={path}", "data.image_size=32", "data.holdout_size=1",
                 "train.per_device_train_batch_size=4", *overrides]  # one prompt is a whole generation batch
    )
    result = prepare_data(config, tmp_path / "run")
    dropped = read_jsonl(result.data_dir / "dropped.jsonl")
    assert result.input_rows == result.num_train + result.num_holdout + len(
        dropped
    )  # every row accounted for
    items = read_items(result.train_path) + read_items(result.holdout_path)
    return result, {i.id: i for i in items}, {d["id"]: d for d in dropped}


# --- encodings and nesting ---------------------------------------------------------------------------------


def test_an_undecodable_byte_costs_only_its_own_line(tmp_path):
    # before: UnicodeDecodeError out of prepare
    lines = [row_line(0), row_line(1)[:-2] + b'\xff"}', row_line(2), row_line(3)]
    result, items, _ = prepared(tmp_path, source(tmp_path, lines), MAPPING)
    assert set(items) == {"r0", "r2", "r3"} and result.dropped_by_reason == {"bad_encoding": 1}


def test_a_byte_order_mark_does_not_cost_the_first_row(tmp_path):
    # before: the first line was "not valid JSON" and dropped
    lines = [b"\xef\xbb\xbf" + row_line(0), row_line(1), row_line(2)]
    result, items, _ = prepared(tmp_path, source(tmp_path, lines), MAPPING)
    assert set(items) == {"r0", "r1", "r2"} and result.dropped_by_reason == {}


def test_very_deep_json_is_dropped_not_a_recursion_error(tmp_path):
    # before: RecursionError (the 100000-deep line) out of json.loads
    abyss = (
        b'{"id": "deep", "question": "q", "answer": "1", "image": "0.png", "x": '
        + b"[" * 100_000
        + b"]" * 100_000
        + b"}"
    )
    deep = json.dumps(
        {
            "id": "deep2",
            "question": "q",
            "answer": "1",
            "image": "1.png",
            "x": json.loads("[" * 200 + "]" * 200),
        }
    ).encode()
    result, items, _ = prepared(tmp_path, source(tmp_path, [abyss, deep, row_line(2), row_line(3)]), MAPPING)
    assert set(items) == {"r2", "r3"} and result.dropped_by_reason == {"too_deeply_nested": 2}


def test_optional_cells_of_unexpected_types(tmp_path):
    # before: dict("not a mapping") raised ValueError out of prepare
    rows = [
        mathvista_row("1", metadata="not a mapping"),
        mathvista_row("2", metadata=[1, 2]),
        mathvista_row("3", unit=["cm"], choices=7),
        {**mathvista_row("4", precision="two"), "pid": 4},
        mathvista_row("5", question=["a list"]),
        mathvista_row("6", answer={"a": 1}),
        mathvista_row("7", answer=3.0),
    ]
    path = source(tmp_path, [json.dumps(r).encode() for r in rows], images=0)
    for k in range(1, 8):
        placeholder_image(f"m{k}").save(tmp_path / f"{k}.png")
    result, items, dropped = prepared(tmp_path, path)
    assert set(items) == {"1", "2", "3", "4", "7"}
    assert items["1"].metadata["metadata"] == "not a mapping" and items["2"].metadata["metadata"] == [1, 2]
    assert result.summary["converted"]["metadata_not_mapping"] == 2
    assert items["7"].answer == "3"  # a float cell holding 3.0 is the integer 3, not "3.0"
    assert dropped["5"]["reason"] == "missing_question" and dropped["6"]["reason"] == "non_numeric_answer"


def test_mapped_cells_of_every_wrong_type(tmp_path):
    lines = [
        row_line(0, question=["q"]),
        row_line(1, answer={"x": 1}),
        row_line(2, image={"neither": 1}),
        row_line(3, id={"a": [1]}),
        row_line(4, image=[]),
        row_line(5, answer=float("nan")),
        b'{"id": "r6", "question": "q", "answer": "6", "image": ["0.png", 7]}',
        row_line(7, answer=True),
        row_line(8, image="1.png"),
    ]
    result, items, _dropped = prepared(tmp_path, source(tmp_path, lines), MAPPING)
    assert set(items) == {'{"a": [1]}', "r8"}  # an id of an odd type is its JSON text, the row is fine
    assert result.dropped_by_reason == {
        "missing_question": 1,
        "bad_answer": 2,
        "missing_image": 3,
        "non_numeric_answer": 1,
    }


# --- files that cannot be read at all ----------------------------------------------------------------------


def test_a_corrupt_parquet_file_is_one_error_naming_it(tmp_path):
    # before: pyarrow's ArrowInvalid traceback
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"PAR1" + os.urandom(200) + b"PAR1")
    with pytest.raises(DataError, match=r"broken\.parquet: not a readable Parquet file") as info:
        prepare_data(load_config("demo", [f"data.source={path}", MAPPING]), tmp_path / "run")
    assert "\n" not in str(info.value)


def test_a_damaged_csv_is_one_error_and_a_bad_row_is_one_drop(tmp_path):
    for k in range(4):
        placeholder_image(f"c{k}").save(tmp_path / f"{k}.png")
    path = tmp_path / "rows.csv"
    path.write_bytes(
        b"id,question,answer,image\nr0,q,0,0.png\nr1,q\xff,1,1.png\nr2,q,2,2.png,extra\nr3,q,3,3.png\n"
    )
    result, items, _dropped = prepared(tmp_path, path, MAPPING)
    assert set(items) == {"r0", "r3"} and result.dropped_by_reason == {"bad_encoding": 1, "bad_row": 1}


def test_an_oversized_csv_cell_drops_its_row_not_the_file(tmp_path):
    """Issue 37: one cell over the csv module's 131,072-character limit refused the whole file."""
    for k in range(4):
        placeholder_image(f"c{k}").save(tmp_path / f"{k}.png")
    big = tmp_path / "big.csv"
    cells = ['r0,q,0,0.png', 'r1,"' + "x" * 200_000 + '",1,1.png', 'r2,"multi\nline",2,2.png', "r3,q,3,3.png"]
    big.write_text("id,question,answer,image\n" + "\n".join(cells) + "\n")
    result, items, dropped = prepared(tmp_path, big, MAPPING)
    assert set(items) == {"r0", "r2", "r3"} and result.dropped_by_reason == {"cell_too_large": 1}
    assert "200,000 characters" in next(iter(dropped.values()))["detail"]


def test_a_huge_image_file_is_refused_by_its_size_before_it_is_read(tmp_path, monkeypatch):
    """Issue 37: a 64 GiB sparse file as an image was read whole (MemoryError) before any size check."""
    from vlmrl.data.images import ImageError, open_row_image

    lines = [row_line(k) for k in range(4)]
    path = source(tmp_path, lines)
    with open(tmp_path / "2.png", "r+b") as handle:
        handle.truncate(64 * 2**30)  # sparse: no disk used
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail(f"{self} was read whole"))
    with pytest.raises(ImageError, match="too_large: .*68,719,476,736 bytes"):
        open_row_image("2.png", base_dir=tmp_path)
    result, items, _dropped = prepared(tmp_path, path, MAPPING)
    assert set(items) == {"r0", "r1", "r3"} and result.dropped_by_reason == {"too_large": 1}


# --- gold answers stored exactly ---------------------------------------------------------------------------


def test_gold_answers_keep_every_digit(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    for k in range(4):
        placeholder_image(f"g{k}").save(tmp_path / f"{k}.png")
    # MathVista schema: a 20-digit integer gold (before: rounded through float to ...168)
    lines = [
        json.dumps(mathvista_row("big", answer="12345678901234567890", image="0.png")).encode(),
        json.dumps(mathvista_row("dec", answer="0.10", answer_type="float", image="1.png")).encode(),
        # a huge numeric choice (before: float -> inf -> OverflowError)
        json.dumps(
            mathvista_row(
                "mc",
                question_type="multi_choice",
                answer="1" + "0" * 400,
                choices=["1" + "0" * 400, "2"],
                image="2.png",
            )
        ).encode(),
    ]
    _, items, _ = prepared(tmp_path, source(tmp_path, lines, images=0), "data.include_multi_choice=true")
    assert items["big"].answer == "12345678901234567890"
    assert (items["dec"].answer, items["dec"].precision) == ("0.10", 2)
    assert items["mc"].answer == "1" + "0" * 400
    # a float64 column: 3.0 is the gold 3 (before: "3.0", a float with one decimal), 2.5 stays 2.5
    table = pa.table(
        {
            "id": ["a", "b", "c"],
            "question": ["q"] * 3,
            "answer": [3.0, 2.5, 1e20],
            "image": ["0.png", "1.png", "2.png"],
        }
    )
    pq.write_table(table, tmp_path / "floats.parquet")
    _result, items, _ = prepared(tmp_path, tmp_path / "floats.parquet", MAPPING)
    assert {k: (v.answer, v.answer_type) for k, v in items.items()} == {
        "a": ("3", "integer"),
        "b": ("2.5", "float"),
        "c": ("100000000000000000000", "integer"),
    }


@given(st.integers())
def test_integer_text_is_exact_for_any_length(n):
    assert number_text(str(n)) == str(n) == number_text(n)


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_a_float_cell_reads_back_to_the_same_double(x):
    text = number_text(x)
    assert float(text) == x and not text.endswith(".0")


# --- image paths stay inside the data folder ---------------------------------------------------------------


def test_paths_outside_the_data_folder_are_dropped(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    outside = tmp_path / "secret.png"
    placeholder_image("secret").save(outside)
    os.symlink(outside, data / "link.png")
    placeholder_image("inside").save(data / "inside.png")
    placeholder_image("inside2").save(data / "inside2.png")
    os.symlink(data / "inside2.png", data / "inner-link.png")  # a link that stays inside is fine
    lines = [
        row_line(0, image=str(outside)),
        row_line(1, image="../secret.png"),
        row_line(2, image="link.png"),
        row_line(3, image="inside.png"),
        row_line(4, image="inner-link.png"),
        row_line(5, image="https://example.com/x.png"),
        row_line(6, image={"path": "../secret.png"}),
    ]
    path = data / "rows.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    result, items, _dropped = prepared(tmp_path, path, MAPPING)
    assert set(items) == {"r3", "r4"}
    assert result.dropped_by_reason == {"outside_data_folder": 4, "image_url": 1}
    assert "secret" not in "".join(p.name for p in (tmp_path / "run" / "data" / "images").iterdir())


# --- anything at all in a row ------------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=8,
)
COLUMNS = ["id", "question", "answer", "images", "choices", "answer_type", "precision", "unit", "extra"]


@pytest.mark.slow  # ~3 s: 150 examples
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.fixed_dictionaries({}, optional={c: JSON for c in COLUMNS}), min_size=1, max_size=6))
def test_any_row_is_kept_or_dropped_with_a_reason(rows):
    data = load_config(
        "demo",
        [
            (
                "data.columns={id: id, question: question, answer: answer, images: images, choices: choices, "
                "answer_type: answer_type, precision: precision, unit: unit}"
            ),
            "data.answer_types=[integer, float, choice, expression, text]",
        ],
    ).data
    full = [{c: None for c in COLUMNS[:-1]} | row | {"__base_dir__": None} for row in rows]
    out = list(convert_rows(iter(full), data, "fuzz", {}))
    assert len(out) == len(rows)
    for result in out:
        assert isinstance(result, (Candidate, Dropped))
        if isinstance(result, Dropped):
            assert result.reason and isinstance(result.detail, str)
        else:
            json.dumps([result.extra, result.answer, result.choices, result.unit, result.id], allow_nan=False)
            assert isinstance(result.answer, str) and result.images


@settings(max_examples=200, deadline=None)
@given(JSON | st.fixed_dictionaries({}, optional={"bytes": JSON, "path": JSON}))
def test_any_image_value_is_an_image_or_an_image_error_and_never_leaves_the_folder(tmp_path_factory, value):
    from vlmrl.data.images import ImageError, open_row_image

    folder = tmp_path_factory.mktemp("imgs")
    try:
        open_row_image(value, base_dir=folder)
    except ImageError as exc:
        assert exc.reason in {
            "missing_image",
            "corrupt_image",
            "outside_data_folder",
            "image_url",
            "too_small",
        }
    else:
        pytest.fail(f"an empty folder yielded an image for {value!r}")


def test_doctests_of_the_data_value_modules():
    import doctest

    from vlmrl.data import items, table, values

    for module in (values, table, items):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


def test_a_first_row_without_a_mapped_column_is_one_drop_not_a_refused_file(tmp_path):
    # before: "data.columns names column(s) the data does not have" for the whole file
    first = json.dumps({"id": "r0", "question": "text only?", "answer": "1"}).encode()
    _result, items, dropped = prepared(tmp_path, source(tmp_path, [first, row_line(1), row_line(2)]), MAPPING)
    assert set(items) == {"r1", "r2"} and dropped["r0"]["reason"] == "missing_image"
    typo = "data.columns={id: id, question: question, answer: answer, image: picture}"
    with pytest.raises(DataError, match=r"names column\(s\) the data does not have \(image: picture\)"):
        prepared(tmp_path, source(tmp_path, [row_line(1), row_line(2)]), typo)
