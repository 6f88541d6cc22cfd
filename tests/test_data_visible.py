"""Data the way users bring it: drops shown (reason, count, an example with its value, the fix), LaTeX answers
read as expressions, choices as a JSON list, a Python list or separated text, rows mixing `image` and `images`,
MathVista metadata as JSON text, the dataset's own splits (a held-out split, a default that follows the source),
ids from the file and row, categories from a column. All on local files (no network)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.conftest import placeholder_image
from vlmrl.cli.app import app
from vlmrl.common.io import read_json, read_jsonl
from vlmrl.config.schema import load_config
from vlmrl.data.items import DataError, read_items
from vlmrl.data.prepare import prepare_data

SMALL = ["train.per_device_train_batch_size=4", "data.image_size=32"]  # one prompt makes a generation batch


def _images(folder: Path, count: int, prefix: str = "p") -> list[str]:
    names = [f"{prefix}{k}.png" for k in range(count)]
    for name in names:
        placeholder_image(f"visible-{prefix}-{name}").save(folder / name)
    return names


def _csv(path: Path, rows: list[dict]) -> Path:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def _items(run: Path) -> dict:
    data = run / "data"
    return {i.id: i for i in read_items(data / "train.jsonl") + read_items(data / "holdout.jsonl")}


QUIZ = [  # (answer, choices cell): LaTeX and symbolic answers, numbers, prose, and choices in four spellings
    ("\\frac{1}{2}", ""), ("2\\sqrt{3}", ""), ("1/2", ""), ("12", ""), ("Paris", ""),
    ("red", '["red", "green"]'), ("green", "['red', 'green']"), ("red", "red|green"), ("blue", "blue;red"),
]


def _quiz(folder: Path) -> Path:
    names = _images(folder, len(QUIZ))
    rows = [{"qid": f"q{k}", "ask": "What is shown?", "gold": gold, "options": options, "pic": name}
            for k, ((gold, options), name) in enumerate(zip(QUIZ, names))]
    return _csv(folder / "quiz.csv", rows)


QUIZ_SETTINGS = ["data.columns={id: qid, question: ask, answer: gold, choices: options, image: pic}",
                 "data.answer_types=[integer, choice, expression]", "data.holdout_size=1", "model.name=tiny:qwen3_vl"]


def test_prepare_prints_the_drop_table_and_keeps_latex_answers_as_expressions(tmp_path: Path) -> None:
    path = _quiz(tmp_path)
    sets = [f"data.source={path}", f"run.output_dir={tmp_path / 'runs'}", *SMALL, *QUIZ_SETTINGS]
    result = CliRunner().invoke(app, ["prepare", *[a for s in sets for a in ("--set", s)]], terminal_width=240)
    assert result.exit_code == 0, result.output
    run = tmp_path / "runs" / "demo"
    items = _items(run)
    assert {k: items[k].answer_type for k in ("q0", "q1", "q2")} == dict.fromkeys(("q0", "q1", "q2"), "expression")
    assert items["q0"].metadata["answer_type_from"] == "inferred" and items["q3"].answer_type == "integer"
    assert {items["q5"].choices, items["q6"].choices} == {("red", "green")}  # a JSON list and a Python list
    drops = {row["reason"]: row for row in read_json(run / "data" / "summary.json")["drops"]}
    assert set(drops) == {"bad_choices", "filtered_answer_type"}
    assert drops["bad_choices"]["count"] == 2 and "'red|green'" in drops["bad_choices"]["example"]
    assert "data.choices_separator" in drops["bad_choices"]["fix"]
    assert drops["filtered_answer_type"]["example_id"] == "q4" and "'Paris' is text" in drops["filtered_answer_type"]["example"]
    assert "add text to data.answer_types" in drops["filtered_answer_type"]["fix"]
    # the table printed: each reason, its count, the example's value and the fix
    for text in ("bad_choices", "'red|green'", "choices_separator", "filtered_answer_type", "'Paris'"):
        assert text in result.output, text


def test_vlmrl_run_says_the_same_drop_table(tmp_path: Path, monkeypatch) -> None:
    from vlmrl import pipeline

    monkeypatch.setattr(pipeline, "prompt_token_counter", lambda config, run_dir: None)  # no model needed here
    config = load_config("demo", [f"data.source={_quiz(tmp_path)}", *SMALL, *QUIZ_SETTINGS])
    said: list[str] = []
    pipeline._prepare_and_show_drops(config, tmp_path / "run", said.append)
    assert said[0] == "dropped 3 of 9 rows (data/dropped.jsonl):"
    assert said[1].startswith("  bad_choices: 2, e.g. q7: column 'options': 'red|green'") and "-> fix:" in said[1]


def test_a_choices_separator_splits_text_cells(tmp_path: Path) -> None:
    path = _quiz(tmp_path)
    config = load_config("demo", [f"data.source={path}", *SMALL, *QUIZ_SETTINGS, 'data.choices_separator="|"'])
    result = prepare_data(config, tmp_path / "run")
    items = _items(tmp_path / "run")
    assert items["q7"].choices == ("red", "green")  # red|green
    # 'blue;red' split at | is one choice, blue is not it: read off the gold, blue is a text answer
    assert result.dropped_by_reason == {"filtered_answer_type": 2}


def test_rows_may_mix_image_and_images_but_not_hold_both(tmp_path: Path) -> None:
    a, b, c, d = _images(tmp_path, 4)
    rows = [{"id": "one", "q": "?", "a": "1", "image": a}, {"id": "two", "q": "?", "a": "2", "images": [b, c]},
            {"id": "both", "q": "?", "a": "3", "image": d, "images": [d]},
            {"id": "none", "q": "?", "a": "4"}]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = load_config("demo", [f"data.source={path}", *SMALL, "data.holdout_size=1",
                                  "data.columns={id: id, question: q, answer: a, image: image, images: images}"])
    result = prepare_data(config, tmp_path / "run")
    assert {k: len(v.images) for k, v in _items(tmp_path / "run").items()} == {"one": 1, "two": 2}
    dropped = {d["id"]: d for d in read_jsonl(result.data_dir / "dropped.jsonl")}
    assert dropped["both"]["reason"] == "image_and_images" and dropped["none"]["reason"] == "missing_image"


def _split_folder(folder: Path, train: int, test: int) -> Path:
    """A folder in EasyR1's layout: train.parquet and test.parquet, images as {bytes, path}, no id column."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir()
    for name, count in (("train", train), ("test", test)):
        rows = []
        for k in range(count):
            buffer = io.BytesIO()
            placeholder_image(f"split-{name}-{k}").save(buffer, format="PNG")
            rows.append({"images": [{"bytes": buffer.getvalue(), "path": None}], "problem": "<image>How many?",
                         "answer": str(k), "subject": ["counting", "reading"][k % 2]})
        pq.write_table(pa.Table.from_pylist(rows), folder / f"{name}.parquet")
    return folder


SPLIT_MAP = "data.columns={images: images, question: problem, answer: answer, category: subject}"


def test_the_holdout_comes_from_the_datasets_own_split(tmp_path: Path) -> None:
    folder = _split_folder(tmp_path / "easyr1", train=6, test=4)
    config = load_config("demo", [f"data.source={folder}", *SMALL, SPLIT_MAP, "data.holdout_split=test",
                                  "data.holdout_size=3"])
    result = prepare_data(config, tmp_path / "run")
    train, holdout = read_items(result.train_path), read_items(result.holdout_path)
    assert sorted(i.id for i in train) == [f"train.parquet:{k}" for k in range(1, 7)]  # ids: file and row
    assert {i.id.split(":")[0] for i in holdout} == {"test.parquet"} and len(holdout) == 3
    assert result.dropped_by_reason == {"beyond_holdout_size": 1}  # the 4th test row: neither trained nor evaluated
    assert {i.category for i in train} == {"counting", "reading"}  # from the mapped column
    assert result.summary["holdout"]["split"] == "test" and result.comparable_to_published is None
    # without holdout_split the default split is the source's own train split: test rows are never read
    default = prepare_data(load_config("demo", [f"data.source={folder}", *SMALL, SPLIT_MAP, "data.holdout_size=2"]),
                           tmp_path / "run2")
    assert default.input_rows == 6


def test_a_held_out_split_that_is_missing_or_trained_on_is_refused(tmp_path: Path) -> None:
    folder = _split_folder(tmp_path / "easyr1", train=4, test=2)
    for sets, message in ((["data.holdout_split=dev"], r"no file names the split 'dev'"),
                          (["data.holdout_split=test", "data.split=test"], r"the training rows would include it")):
        with pytest.raises(DataError, match=message):
            prepare_data(load_config("demo", [f"data.source={folder}", *SMALL, SPLIT_MAP, *sets]), tmp_path / "r")
    single = folder / "train.parquet"
    with pytest.raises(DataError, match="is one file, with no splits"):
        prepare_data(load_config("demo", [f"data.source={single}", *SMALL, SPLIT_MAP, "data.holdout_split=test"]),
                     tmp_path / "r")


def test_a_saved_dataset_dict_defaults_to_its_train_split(tmp_path: Path) -> None:
    import datasets

    rows = {name: [{"problem": "How many?", "answer": str(k), "image": {"bytes": None, "path": None}}
                   for k in range(n)] for name, n in (("train", 5), ("test", 2))}
    for name, split in rows.items():
        for k, row in enumerate(split):
            placeholder_image(f"dict-{name}-{k}").save(tmp_path / f"{name}{k}.png")
            row["image"] = f"{name}{k}.png"
    saved = tmp_path / "saved"
    datasets.DatasetDict({n: datasets.Dataset.from_list(r) for n, r in rows.items()}).save_to_disk(str(saved))
    for path in tmp_path.glob("*.png"):
        (saved / path.name).write_bytes(path.read_bytes())
    config = load_config("demo", [f"data.source={saved}", *SMALL, "data.holdout_size=1",
                                  "data.columns={image: image, question: problem, answer: answer}"])
    result = prepare_data(config, tmp_path / "run")
    assert result.input_rows == 5
    assert sorted(_items(tmp_path / "run")) == [f"saved/train:{k}" for k in range(1, 6)]
    with_test = load_config("demo", [f"data.source={saved}", *SMALL, "data.holdout_split=test",
                                     "data.columns={image: image, question: problem, answer: answer}"])
    held = read_items(prepare_data(with_test, tmp_path / "run3").holdout_path)
    assert sorted(i.id for i in held) == ["saved/test:1", "saved/test:2"]


def test_mathvista_metadata_given_as_json_text_is_read(mathvista_annotations: dict, tmp_path: Path) -> None:
    rows = [r for r in mathvista_annotations.values() if r["question_type"] == "free_form"][:12]
    lines = []
    for row in rows:
        placeholder_image(row["pid"]).save(tmp_path / f"{row['pid']}.png")
        lines.append(json.dumps({**row, "image": f"{row['pid']}.png", "metadata": json.dumps(row["metadata"])}))
    path = tmp_path / "mathvista.jsonl"
    path.write_text("\n".join(lines) + "\n")
    result = prepare_data(load_config("demo", [f"data.source={path}", *SMALL, "data.holdout_size=2"]),
                          tmp_path / "run")
    items = _items(tmp_path / "run")
    assert items and all(i.category == i.metadata["task"] != "unknown" for i in items.values())
    assert result.comparable_to_published is False  # MathVista testmini on both sides: the claim is made, and false
