"""MathVista and column-mapped sources, on local files in the hub's exact schema (no network)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from tests.conftest import mathvista_dataset, placeholder_image
from vlmrl.config.schema import ConfigError, load_config
from vlmrl.data.items import DataError, read_items
from vlmrl.data.mathvista import parse_number
from vlmrl.data.prepare import prepare_data

SMALL = ["data.image_size=48", "data.holdout_size=100"]


def config_for(source, *overrides):
    return load_config("demo", [f"data.source={source}", *SMALL, *overrides])


def summary_of(run_dir):
    return json.loads((run_dir / "data" / "summary.json").read_text())


def test_default_filter_keeps_458_free_form_numeric_items(mathvista_parquet, mathvista_annotations, tmp_path):
    result = prepare_data(config_for(mathvista_parquet), tmp_path)
    summary = summary_of(tmp_path)
    assert summary["counts"] == {"input_rows": 1000, "train": 358, "holdout": 100, "dropped": 542}
    assert summary["dropped_by_reason"] == {"filtered_answer_type": 542}  # 540 multi_choice + 2 list
    items = read_items(tmp_path / "data" / "train.jsonl") + read_items(tmp_path / "data" / "holdout.jsonl")
    assert Counter(i.answer_type for i in items) == {"integer": 418, "float": 40}
    assert result.num_train + result.num_holdout == 458

    by_id = {i.id: i for i in items}
    first = by_id["1"]  # the spring question: float, precision 1
    assert (first.answer, first.answer_type, first.precision, first.source) == (
        "1.2",
        "float",
        1,
        "mathvista-testmini",
    )
    assert first.question == mathvista_annotations["1"]["question"].strip()
    assert first.prompt.startswith(first.question) and "<SOLUTION>" in first.prompt
    assert first.category == "textbook question answering" and first.metadata["pid"] == "1"
    assert by_id["2"].unit == "g" and by_id["2"].answer == "1000" and by_id["2"].precision is None
    assert all((tmp_path / i.image).is_file() for i in items)


def test_testmini_train_and_holdout_are_flagged_not_comparable(mathvista_parquet, tmp_path):
    result = prepare_data(config_for(mathvista_parquet), tmp_path)
    summary = summary_of(tmp_path)
    assert result.comparable_to_published is False and summary["comparable_to_published"] is False
    assert "not comparable to published MathVista testmini results" in result.message
    assert summary["message"] == result.message


def test_jsonl_variant_with_relative_image_paths(mathvista_jsonl, tmp_path):
    result = prepare_data(config_for(mathvista_jsonl), tmp_path)
    assert (result.input_rows, result.num_train + result.num_holdout) == (1000, 458)


def test_multiple_choice_kept_as_choice_when_asked(mathvista_parquet, tmp_path):
    result = prepare_data(config_for(mathvista_parquet, "data.include_multi_choice=true"), tmp_path)
    items = {i.id: i for i in read_items(result.train_path) + read_items(result.holdout_path)}
    assert Counter(i.answer_type for i in items.values()) == {"integer": 418, "float": 40, "choice": 540}
    assert summary_of(tmp_path)["dropped_by_reason"] == {"filtered_answer_type": 2}  # the 2 list answers
    angle = items["3"]  # choices 135°, 140°, 145°, 150°; answer 145°
    assert (angle.answer, angle.answer_type, angle.choices, angle.precision) == (
        "145°",
        "choice",
        ("135°", "140°", "145°", "150°"),
        None,
    )
    assert "Choices" not in angle.question  # the prompt lists the choices, the question stays as written
    assert "\nChoices:\n(A) 135°\n(B) 140°\n(C) 145°\n(D) 150°\n" in angle.prompt
    assert "the letter of the correct choice, or the choice's text" in angle.prompt
    yes_no = [i for i in items.values() if i.choices == ("Yes", "No")]
    assert yes_no and all(i.answer in ("Yes", "No") and i.answer_type == "choice" for i in yes_no)
    assert all(i.answer in i.choices for i in items.values() if i.answer_type == "choice")
    numeric = items["1"]  # free-form items keep today's prompt
    assert numeric.prompt.endswith("Then give only the final numeric answer between <SOLUTION> and </SOLUTION>.")


def test_multiple_choice_rows_without_a_usable_gold_are_dropped_with_a_reason(mathvista_annotations, tmp_path):
    mc = [r for r in mathvista_annotations.values() if r["question_type"] == "multi_choice"][:4]
    rows = [{**mc[0], "answer": "not a choice"}, {**mc[1], "choices": []}, *mc[2:]]
    path = tmp_path / "mc.parquet"
    mathvista_dataset(rows).to_parquet(str(path))
    overrides = ["data.image_size=48", "data.holdout_size=1", "data.include_multi_choice=true"]
    config = load_config("demo", [f"data.source={path}", "train.per_device_train_batch_size=4", *overrides])
    result = prepare_data(config, tmp_path / "run")
    dropped = [json.loads(line) for line in (result.data_dir / "dropped.jsonl").read_text().splitlines()]
    assert sorted(d["reason"] for d in dropped) == ["answer_not_in_choices", "missing_choices"]
    assert result.num_train + result.num_holdout == 2


def test_multiple_choice_with_query_prompt_lists_the_choices_once(mathvista_annotations, tmp_path):
    rows = [r for r in mathvista_annotations.values() if r["question_type"] == "multi_choice"][:6]
    path = tmp_path / "mc.parquet"
    mathvista_dataset(rows).to_parquet(str(path))
    config = load_config(
        "demo",
        [f"data.source={path}", "data.image_size=48", "data.holdout_size=1", "data.include_multi_choice=true",
         "data.prompt_field=query"],
    )
    result = prepare_data(config, tmp_path / "run")
    for item in read_items(result.train_path):
        assert item.prompt.count("(A) ") == 1 and item.prompt.count("Choices:") == 1, item.prompt


def test_prompt_field_query(mathvista_annotations, tmp_path):
    rows = [r for r in mathvista_annotations.values() if r["question_type"] == "free_form"][:30]
    path = tmp_path / "small.parquet"
    mathvista_dataset(rows).to_parquet(str(path))
    config = load_config(
        "demo",
        [f"data.source={path}", "data.image_size=48", "data.holdout_size=5", "data.prompt_field=query"],
    )
    result = prepare_data(config, tmp_path / "run")
    item = read_items(result.train_path)[0]
    assert item.question.startswith("Hint: Please answer the question requiring")


def test_hub_snapshot_folder_reads_only_the_split(mathvista_annotations, tmp_path):
    rows = list(mathvista_annotations.values())
    folder = tmp_path / "MathVista" / "data"
    folder.mkdir(parents=True)
    mathvista_dataset(rows[:40]).to_parquet(str(folder / "testmini-00000-of-00001.parquet"))
    mathvista_dataset(rows[40:50]).to_parquet(str(folder / "test-00000-of-00002.parquet"))
    config = load_config(
        "demo", [f"data.source={folder.parent}", "data.image_size=48", "data.holdout_size=3"]
    )
    assert prepare_data(config, tmp_path / "run").input_rows == 40


def test_save_to_disk_folder(mathvista_annotations, tmp_path):
    rows = [r for r in mathvista_annotations.values() if r["question_type"] == "free_form"][:20]
    mathvista_dataset(rows).save_to_disk(str(tmp_path / "saved"))
    config = load_config(
        "demo", [f"data.source={tmp_path / 'saved'}", "data.image_size=48", "data.holdout_size=3"]
    )
    result = prepare_data(config, tmp_path / "run")
    numeric = sum(r["answer_type"] in ("integer", "float") for r in rows)
    assert (result.input_rows, result.num_train + result.num_holdout) == (20, numeric)


def test_max_items_caps_rows(mathvista_parquet, tmp_path):
    result = prepare_data(
        config_for(mathvista_parquet, "data.max_items=200", "data.holdout_size=10"), tmp_path
    )
    assert result.input_rows == 200


def test_nan_precision_and_bad_answers_in_mathvista_rows(mathvista_annotations, tmp_path):
    base = dict(mathvista_annotations["1"])  # free_form float
    images = tmp_path / "images"
    images.mkdir()
    rows = []
    for k in range(8):
        placeholder_image(f"g{k}").save(images / f"g{k}.png")
        rows.append(
            {**base, "pid": f"g{k}", "image": f"images/g{k}.png", "precision": float("nan"), "answer": "2.50"}
        )
    rows.append({**base, "pid": "words", "image": "images/g0.png", "answer": "about two"})
    rows.append(
        {**base, "pid": "int-but-float", "answer_type": "integer", "image": "images/g1.png", "answer": "2.5"}
    )
    rows.append({**base, "pid": "no-answer", "image": "images/g2.png", "answer": None})
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # json writes NaN, as pandas exports do
    config = load_config("demo", [f"data.source={path}", "data.image_size=48", "data.holdout_size=2"])
    result = prepare_data(config, tmp_path / "run")
    assert result.dropped_by_reason == {"non_numeric_answer": 2, "missing_answer": 1}
    kept = read_items(result.train_path) + read_items(result.holdout_path)
    assert {(i.answer, i.precision) for i in kept} == {("2.50", 2)}  # NaN precision read off the gold
    assert result.summary["converted"] == {"precision_inferred": 8}


# --- other datasets through data.columns ----------------------------------------------------------


def geometry3k_folder(tmp_path):
    """geometry3k-shaped rows: a list of images per row, `problem` with an <image> marker, string answers."""
    (tmp_path / "imgs").mkdir()
    answers = ["3", "8.5", "2\\sqrt{3}", "12", "45", "7.25", "6", "10", "", "9"]
    lines = []
    for k, answer in enumerate(answers):
        placeholder_image(f"geo{k}").save(tmp_path / "imgs" / f"{k}.png")
        lines.append(
            {
                "uid": f"geo-{k}",
                "images": [f"imgs/{k}.png"],
                "problem": f"<image>Find x in figure {k}.",
                "answer": answer,
            }
        )
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_column_mapped_dataset(tmp_path):
    path = geometry3k_folder(tmp_path)
    config = load_config(
        "demo",
        [
            f"data.source={path}",
            "data.image_size=48",
            "data.holdout_size=2",
            "data.columns={image: images, question: problem, answer: answer, id: uid}",
        ],
    )
    result = prepare_data(config, tmp_path / "run")
    # "2\\sqrt{3}" is not a number: read off the gold it is an expression answer, not in data.answer_types
    assert result.dropped_by_reason == {"filtered_answer_type": 1, "missing_answer": 1}
    items = {i.id: i for i in read_items(result.train_path) + read_items(result.holdout_path)}
    assert len(items) == 8 and items["geo-0"].question == "Find x in figure 0."
    assert (items["geo-5"].answer, items["geo-5"].answer_type, items["geo-5"].precision) == (
        "7.25",
        "float",
        2,
    )
    assert items["geo-3"].answer_type == "integer" and items["geo-3"].source == "train"
    assert result.comparable_to_published is None and result.message is None  # not MathVista: no claim


def test_column_mapping_errors(tmp_path):
    path = geometry3k_folder(tmp_path)
    cases = {
        "{image: images, question: question, answer: answer}": "names column",
        "{image: images, question: problem}": "map answer",
    }
    for mapping, message in cases.items():
        config = load_config(
            "demo", [f"data.source={path}", f"data.columns={mapping}", "data.holdout_size=2"]
        )
        with pytest.raises(DataError, match=message):
            prepare_data(config, tmp_path / "run")
    # A key that is no column role is refused when the config loads, before any data is read.
    with pytest.raises(ConfigError, match="'picture' is no column role"):
        picture = "data.columns={image: images, question: problem, answer: answer, picture: x}"
        load_config("demo", [f"data.source={path}", picture, "data.holdout_size=2"])
    unmapped = load_config("demo", [f"data.source={path}", "data.holdout_size=2"])
    with pytest.raises(DataError, match="not in MathVista's schema.*data.columns"):
        prepare_data(unmapped, tmp_path / "run")


def test_unknown_source_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="no such file or folder"):
        prepare_data(load_config("demo", ["data.source=./nowhere/data.parquet"]), tmp_path)


@pytest.mark.parametrize(
    ("text", "allow_unit", "expected"),
    [
        ("42", False, 42.0),
        ("-3", False, -3.0),
        ("1,000", False, 1000.0),
        ("0.5", False, 0.5),
        ("6cm", False, None),
        ("6cm", True, 6.0),
        ("135°", True, 135.0),
        ("Yes", True, None),
        ("3/4", True, None),
        ("nan", False, None),
        ("", False, None),
        (None, False, None),
        (7, False, 7.0),
    ],
)
def test_parse_number(text, allow_unit, expected):
    assert parse_number(text, allow_unit=allow_unit) == expected
