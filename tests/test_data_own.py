"""Your own dataset: JSONL, CSV, Parquet, imagefolder and save_to_disk sources through `data.columns`, every
answer type, several images per row (kept in order, each one checked by the contamination guard), extra
columns kept for reward functions, and every input row accounted for. All on local files (no network)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from tests.conftest import placeholder_image
from vlmrl.common.io import read_jsonl
from vlmrl.config.schema import load_config
from vlmrl.data.items import DataError, read_items
from vlmrl.data.prepare import prepare_data
from vlmrl.data.table import train_table

FULL_MAP = (
    "data.columns={id: uid, question: q, answer: gold, images: pics, answer_type: kind, choices: options, "
    "unit: unit}"
)
ALL_TYPES = "data.answer_types=[integer, float, choice, expression, text]"

# these sets are small: one prompt (4 completions) makes a whole generation batch, so prepare keeps them
SMALL_BATCH = "train.per_device_train_batch_size=4"


def mixed_rows(folder: Path) -> list[dict]:
    """Mixed answer types, two-image rows, extra columns, and rows that must be dropped (with reasons)."""
    for name in ("a", "b", "c", "d", "e", "f"):
        placeholder_image(f"own-{name}").save(folder / f"{name}.png")
    return [
        {
            "uid": "int",
            "q": "How many?",
            "gold": "12345678901234567890",
            "pics": ["a.png"],
            "kind": "integer",
            "difficulty": 3,
        },
        {
            "uid": "two",
            "q": "Left minus right?",
            "gold": "2.50",
            "pics": ["b.png", "c.png"],
            "kind": "float",
            "unit": "cm",
            "difficulty": 1,
            "tags": ["pair"],
        },
        {
            "uid": "mc",
            "q": "Which shape?",
            "gold": "circle",
            "pics": ["d.png"],
            "kind": "choice",
            "options": ["square", "circle"],
            "difficulty": "easy",
        },
        {
            "uid": "expr",
            "q": "Simplify.",
            "gold": "2\\sqrt{3}",
            "pics": ["e.png", "f.png"],
            "kind": "expression",
        },
        {"uid": "free", "q": "Name it.", "gold": "Paris", "pics": ["f.png"]},  # no kind: read off the gold
        {"uid": "bad-kind", "q": "?", "gold": "1", "pics": ["a.png"], "kind": "date"},
        {
            "uid": "not-a-choice",
            "q": "?",
            "gold": "hexagon",
            "pics": ["a.png"],
            "kind": "choice",
            "options": ["square"],
        },
        {"uid": "no-image", "q": "?", "gold": "1", "pics": []},
        {"uid": "missing-second", "q": "?", "gold": "1", "pics": ["a.png", "absent.png"]},
    ]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def all_items(result) -> dict:
    return {i.id: i for i in read_items(result.train_path) + read_items(result.holdout_path)}


def test_mixed_answer_types_and_two_image_rows_are_all_accounted_for(tmp_path):
    rows = mixed_rows(tmp_path)
    path = write_jsonl(tmp_path / "mine.jsonl", rows)
    config = load_config(
        "demo", [SMALL_BATCH, f"data.source={path}", FULL_MAP, ALL_TYPES, "data.image_size=32", "data.holdout_size=2"]
    )
    result = prepare_data(config, tmp_path / "run")
    assert (
        result.input_rows
        == len(rows)
        == result.num_train + result.num_holdout + sum(result.dropped_by_reason.values())
    )
    assert result.dropped_by_reason == {
        "unknown_answer_type": 1,
        "answer_not_in_choices": 1,
        "missing_image": 2,
    }
    missing = next(d for d in read_jsonl(result.data_dir / "dropped.jsonl") if d["id"] == "missing-second")
    assert missing["detail"].startswith("image 2 of 2:")
    items = all_items(result)
    assert {k: (v.answer, v.answer_type) for k, v in items.items()} == {
        "int": ("12345678901234567890", "integer"),  # every digit, never through float
        "two": ("2.50", "float"),
        "mc": ("circle", "choice"),
        "expr": ("2\\sqrt{3}", "expression"),
        "free": ("Paris", "text"),
    }
    two = items["two"]
    assert len(two.images) == 2 and two.images[0] != two.images[1] and two.precision == 2 and two.unit == "cm"
    b, c = placeholder_image("own-b").resize((32, 32)), placeholder_image("own-c").resize((32, 32))
    from PIL import Image

    stored = [Image.open(tmp_path / "run" / p).convert("RGB") for p in two.images]
    import numpy as np

    order = [
        np.abs(np.asarray(s, int) - np.asarray(x.convert("RGB").resize((32, 32)), int)).mean()
        for s, x in zip(stored, (b, c))
    ]
    assert max(order) < 20  # image 1 is b.png and image 2 is c.png: the row's order is kept
    assert items["mc"].choices == ("square", "circle")
    # extra columns, JSON-safe, and the kwargs every reward function receives
    # (mapped columns too, under their own names, as TRL passes every column; `unit` is an item field already)
    assert two.extra == {"difficulty": 1, "tags": ["pair"], "uid": "two", "q": "Left minus right?", "gold": "2.50",
                         "kind": "float"}
    columns = two.columns()
    assert columns["tags"] == ["pair"] and columns["answer"] == "2.50" and columns["unit"] == "cm"
    assert set(columns) >= {
        "id",
        "question",
        "answer",
        "answer_type",
        "precision",
        "unit",
        "choices",
        "category",
        "source",
        "difficulty",
    }


def test_the_trl_table_has_every_image_and_arrow_safe_extra_columns(tmp_path):
    path = write_jsonl(tmp_path / "mine.jsonl", mixed_rows(tmp_path))
    config = load_config(
        "demo", [SMALL_BATCH, f"data.source={path}", FULL_MAP, ALL_TYPES, "data.image_size=32", "data.holdout_size=1"]
    )
    result = prepare_data(config, tmp_path / "run")
    items = read_items(result.train_path) + read_items(result.holdout_path)
    table = train_table(items, tmp_path / "run")
    by_id = dict(zip(table["id"], range(len(items))))
    assert len(table["images"][by_id["two"]]) == 2 and len(table["images"][by_id["int"]]) == 1
    # difficulty holds ints and a string: one column type only through JSON text
    assert table["difficulty"][by_id["two"]] == "1" and table["difficulty"][by_id["mc"]] == '"easy"'
    assert table["difficulty"][by_id["free"]] is None
    import datasets

    dataset = datasets.Dataset.from_dict(table).cast_column("images", datasets.Sequence(datasets.Image()))
    assert [img.size for img in dataset[by_id["two"]]["images"]] == [(32, 32), (32, 32)]


def test_csv_parquet_imagefolder_and_saved_dataset_give_the_same_items(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    keys = ("uid", "q", "gold", "pics", "kind", "options", "unit")  # no extras: their types vary by format
    rows = [
        {k: v for k, v in r.items() if k in keys}
        for r in mixed_rows(tmp_path)
        if r["uid"] in ("int", "two", "mc", "free")
    ]
    config = [FULL_MAP, ALL_TYPES, "data.image_size=32", "data.holdout_size=1"]
    path = write_jsonl(tmp_path / "mine.jsonl", rows)
    expected = {
        k: (v.answer, v.answer_type, len(v.images))
        for k, v in all_items(
            prepare_data(load_config("demo", [SMALL_BATCH, f"data.source={path}", *config]), tmp_path / "j")
        ).items()
    }
    assert len(expected) == 4

    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, ["uid", "q", "gold", "pics", "kind", "options", "unit"])
    writer.writeheader()
    for r in rows:  # list cells hold JSON lists; a missing value is an empty cell
        writer.writerow(
            {
                **r,
                "pics": json.dumps(r["pics"]),
                "options": json.dumps(r["options"]) if "options" in r else "",
            }
        )
    (tmp_path / "mine.csv").write_bytes(b"\xef\xbb\xbf" + buffer.getvalue().encode())  # with Excel's BOM
    found = all_items(
        prepare_data(load_config("demo", [SMALL_BATCH, f"data.source={tmp_path / 'mine.csv'}", *config]), tmp_path / "c")
    )
    assert {k: (v.answer, v.answer_type, len(v.images)) for k, v in found.items()} == expected

    table = pa.Table.from_pylist(
        [{**r, "kind": r.get("kind"), "options": r.get("options"), "unit": r.get("unit")} for r in rows]
    )
    pq.write_table(table, tmp_path / "mine.parquet")
    found = all_items(
        prepare_data(
            load_config("demo", [SMALL_BATCH, f"data.source={tmp_path / 'mine.parquet'}", *config]), tmp_path / "p"
        )
    )
    assert {k: (v.answer, v.answer_type, len(v.images)) for k, v in found.items()} == expected

    # imagefolder: metadata.jsonl beside the images, file_name is the image (no image mapping needed)
    folder = tmp_path / "imagefolder" / "train"
    folder.mkdir(parents=True)
    for r in rows:
        placeholder_image(f"own-{r['pics'][0][0]}").save(folder / r["pics"][0])
    write_jsonl(
        folder / "metadata.jsonl",
        [
            {
                "file_name": r["pics"][0],
                "question": r["q"],
                "answer": r["gold"],
                "kind": r.get("kind"),
                "note": r["uid"],
            }
            for r in rows
        ],
    )
    found = all_items(
        prepare_data(
            load_config(
                "demo",
                [
            SMALL_BATCH,
                    f"data.source={tmp_path / 'imagefolder'}",
                    "data.split=train",
                    ALL_TYPES,
                    "data.image_size=32",
                    "data.holdout_size=1",
                    "data.columns={question: question, answer: answer, answer_type: kind}",
                ],
            ),
            tmp_path / "i",
        )
    )
    assert sorted((v.answer, v.answer_type, v.extra["note"]) for v in found.values()) == sorted(
        (r["gold"], expected[r["uid"]][1], r["uid"]) for r in rows if r["uid"] != "mc"
    )  # mc: no choices here

    saved = tmp_path / "saved"
    datasets.Dataset.from_list(
        [
            {**r, "kind": r.get("kind"), "options": r.get("options") or [], "unit": r.get("unit") or ""}
            for r in rows
        ]
    ).save_to_disk(str(saved))
    (saved / "a.png").write_bytes((tmp_path / "a.png").read_bytes())
    for name in "bcd":
        (saved / f"{name}.png").write_bytes((tmp_path / f"{name}.png").read_bytes())
    (saved / "f.png").write_bytes((tmp_path / "f.png").read_bytes())
    found = all_items(prepare_data(load_config("demo", [SMALL_BATCH, f"data.source={saved}", *config]), tmp_path / "s"))
    assert {k: (v.answer, v.answer_type, len(v.images)) for k, v in found.items()} == expected


def test_every_image_of_a_training_item_is_checked_against_the_holdout(tmp_path):
    placeholder_image("shared").save(tmp_path / "shared.png")
    rows = []
    for k in range(8):
        placeholder_image(f"own-{k}").save(tmp_path / f"{k}.png")
        # every row also shows the shared picture second: whichever rows are held out, the rest share it
        rows.append({"id": f"r{k}", "question": "?", "answer": str(k), "images": [f"{k}.png", "shared.png"]})
    path = write_jsonl(tmp_path / "mine.jsonl", rows)
    config = load_config(
        "demo",
        [
            SMALL_BATCH,
            f"data.source={path}",
            "data.image_size=32",
            "data.holdout_size=2",
            "data.columns={id: id, question: question, answer: answer, images: images}",
        ],
    )
    # every training row shares a holdout image: none is left, and prepare refuses with the reason
    with pytest.raises(DataError, match=r"0 training items left \(2 held out, 6 dropped\).*contaminated_holdout: 6"):
        prepare_data(config, tmp_path / "run")
    dropped = read_jsonl(tmp_path / "run" / "data" / "dropped.jsonl")
    assert [d["reason"] for d in dropped] == ["contaminated_holdout"] * 6


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_vl", "gemma3"])  # qwen2_5_vl passes too (its processor is Qwen3-VL's kin)
def test_two_image_rows_prepare_train_and_evaluate_with_a_tiny_model(tmp_path, monkeypatch, arch):
    """prepare (prompt tokens counted with both images) -> a GRPO step on two-image prompts -> evaluation."""
    from vlmrl.evaluate.stage import evaluate
    from vlmrl.pipeline import prepare_with_budget
    from vlmrl.train.stage import train

    rows = []
    for k in range(12):
        placeholder_image(f"e2e-{k}").save(tmp_path / f"{k}.png")
        rows.append(
            {
                "id": f"r{k}",
                "question": f"Add the two numbers ({k}).",
                "answer": str(k),
                "images": [f"{k}.png", f"{(k + 1) % 12}.png"] if k % 2 else [f"{k}.png"],
                "level": k % 3,
            }
        )
    path = write_jsonl(tmp_path / "mine.jsonl", rows)
    config = load_config(
        "demo",
        [
            SMALL_BATCH,
            f"model.name=tiny:{arch}",
            f"run.output_dir={tmp_path / 'runs'}",
            f"data.source={path}",
            "data.columns={id: id, question: question, answer: answer, images: images}",
            "data.image_size=32",
            "data.holdout_size=4",
            "train.max_completion_length=8",
            "train.max_steps=1",
            "train.per_device_train_batch_size=8",
            "eval.max_new_tokens=8",
            "eval.batch_size=4",
        ],
    )
    seen: list[dict] = []

    def spy(completions, answer, **kwargs):
        seen.append(kwargs)
        return [0.0] * len(completions)

    spy.__name__ = "correctness_reward"
    monkeypatch.setattr("vlmrl.grading.rewards.correctness_reward", spy)
    run_dir = config.run_dir
    prepare_with_budget(config, run_dir)
    summary = json.loads((run_dir / "data" / "summary.json").read_text())
    assert (
        summary["token_budget"]["checked"] is True
    )  # the processor counted every prompt with all its images
    train_items = read_items(run_dir / "data" / "train.jsonl")
    assert any(len(i.images) == 2 for i in train_items)
    # the holdout can hold images of train rows (r3 shows 4.png too): those train rows are dropped, not kept
    holdout = read_items(run_dir / "data" / "holdout.jsonl")
    held = {s for i in holdout for s in i.image_sha256}
    assert not any(s in held for i in train_items for s in i.image_sha256)
    train(config, run_dir)
    assert seen and all("level" in kw and "answer_type" in kw for kw in seen)
    assert (run_dir / "train" / "final").is_dir()
    result = evaluate(config, run_dir, "baseline")
    records = read_jsonl(result.records_path)
    by_id = {i.id: i for i in holdout}
    assert [r["image_sha256"] for r in records] == [list(by_id[r["id"]].image_sha256) for r in records]


def test_the_report_shows_every_image_of_an_item(tmp_path):
    from vlmrl.report.samples import _thumbnail

    for name in ("a", "b"):
        placeholder_image(name).save(tmp_path / f"{name}.png")
    html = _thumbnail({"images": ["a.png", "b.png"]}, tmp_path)
    assert html.count("<img ") == 2 and html.index('alt="a.png"') < html.index('alt="b.png"')
    assert _thumbnail({"image": "a.png"}, tmp_path).count("<img ") == 1  # a manifest from before lists
    assert "image not found: c.png" in _thumbnail({"images": ["a.png", "c.png"]}, tmp_path)


def test_extra_columns_never_shadow_mapped_fields_nor_trls_own_arguments(tmp_path):
    from vlmrl.data.items import Item

    item = Item(
        "a", "q?", "p", "1", "integer", None, None, None, "mine", "mine", ("x.png",), ("s",),
        extra={"answer": "other", "completions": "mine", "images": [1], "level": 2},
    )
    columns = item.columns()
    assert columns["answer"] == "1" and "completions" not in columns and "images" not in columns
    assert (columns["extra_completions"], columns["extra_images"], columns["level"]) == ("mine", [1], 2)
    table = train_table([item], tmp_path)
    assert table["images"] == [[str(tmp_path / "x.png")]] and table["extra_images"] == ["[1]"]
