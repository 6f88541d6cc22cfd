"""The data stage end to end: the demo preset, bad rows, the holdout, the contamination guard, the records."""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from dataclasses import replace

import pytest
from PIL import Image

from tests.conftest import placeholder_image, png_bytes, png_header_only
from vlmrl.common.io import write_jsonl_atomic as write_jsonl
from vlmrl.config.schema import load_config
from vlmrl.data.items import DataError, Item, read_items
from vlmrl.data.prepare import load_prepared, prepare_data
from vlmrl.data.splits import ImageKey, check_no_overlap, choose_holdout, find_contamination


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def assert_counts_add_up(run_dir):
    summary = json.loads((run_dir / "data" / "summary.json").read_text())
    counts = summary["counts"]
    files = {
        name: len(read_jsonl(run_dir / "data" / f"{name}.jsonl")) for name in ("train", "holdout", "dropped")
    }
    assert counts["input_rows"] == counts["train"] + counts["holdout"] + counts["dropped"]
    assert (counts["train"], counts["holdout"], counts["dropped"]) == (
        files["train"],
        files["holdout"],
        files["dropped"],
    )
    assert sum(summary["dropped_by_reason"].values()) == counts["dropped"]
    assert sum(summary["train_by_category"].values()) == counts["train"]
    assert sum(summary["holdout_by_category"].values()) == counts["holdout"]
    return summary


def test_demo_preset_runs_offline_in_seconds(tmp_path):
    config = load_config("demo")
    start = time.perf_counter()
    result = prepare_data(config, tmp_path)
    elapsed = time.perf_counter() - start
    summary = assert_counts_add_up(tmp_path)
    assert summary["counts"] == {"input_rows": 1440, "train": 416, "holdout": 1024, "dropped": 0}
    assert summary["fingerprint"] == config.data_fingerprint() == result.fingerprint
    assert set(summary["train_by_category"]) == set(config.data.families) == {"count_squares", "bar_value"}
    assert summary["token_budget"]["checked"] is False and "not checked" in summary["token_budget"]["note"]
    assert elapsed < 10
    train, holdout = load_prepared(tmp_path)
    for item in train[:20] + holdout[:20]:
        stored = (tmp_path / item.image).read_bytes()
        assert item.image_sha256 == (hashlib.sha256(stored).hexdigest(),)
        assert item.images == (f"data/images/{item.image_sha256[0][:16]}.png",)
        assert Image.open(tmp_path / item.image).size == (128, 128)
        assert item.metadata["family"] == item.category and item.metadata["difficulty"] == 1
    assert len(list((tmp_path / "data" / "images").iterdir())) == summary["images"]["stored"] == 1440


def test_same_config_same_outputs_and_holdout_reused(tmp_path):
    config = load_config("demo", ["data.num_synthetic=60", "data.holdout_size=10"])
    first = prepare_data(config, tmp_path / "a")
    again = prepare_data(config, tmp_path / "a")
    elsewhere = prepare_data(config, tmp_path / "b")
    for name in ("train.jsonl", "holdout.jsonl"):
        assert (first.data_dir / name).read_bytes() == (elsewhere.data_dir / name).read_bytes()
    assert again.holdout_reused and not first.holdout_reused
    assert [i.id for i in read_items(again.holdout_path)] == [i.id for i in read_items(first.holdout_path)]
    other_seed = prepare_data(
        load_config("demo", ["data.num_synthetic=60", "data.holdout_size=10", "run.seed=1"]), tmp_path / "c"
    )
    assert (other_seed.data_dir / "train.jsonl").read_bytes() != (first.data_dir / "train.jsonl").read_bytes()


def test_holdout_kept_when_rows_change_and_rechosen_when_config_changes(tmp_path):
    ids = [f"item-{k}" for k in range(50)]
    holdout = choose_holdout(ids, 10, seed=0)
    assert holdout == choose_holdout(list(reversed(ids)), 10, seed=0)  # order of rows does not matter
    survivors = [i for i in ids if i not in holdout[:3]]
    assert set(holdout[3:]) <= set(choose_holdout(survivors, 10, seed=0))  # the rest stay held out
    assert choose_holdout(ids, 10, seed=1) != holdout
    assert choose_holdout(ids, 10, seed=1, previous=holdout[:4])[:4] == holdout[:4]


def test_token_counter_drops_long_prompts(tmp_path):
    config = load_config(
        "demo", ["data.num_synthetic=60", "data.holdout_size=5", "data.max_prompt_tokens=97"]
    )

    def counter(prompt: str, images: list[Image.Image]) -> int:  # pretend: 1 token per word + 64 image tokens
        (image,) = images
        assert image.size == (128, 128) and image.mode == "RGB"
        return len(prompt.split()) + 64

    result = prepare_data(config, tmp_path, token_counter=counter)
    summary = assert_counts_add_up(tmp_path)
    long_ones = [
        d for d in read_jsonl(tmp_path / "data" / "dropped.jsonl") if d["reason"] == "prompt_too_long"
    ]
    assert long_ones and all("> data.max_prompt_tokens=97" in d["detail"] for d in long_ones)
    kept = read_items(result.train_path) + read_items(result.holdout_path)
    assert kept and all(len(i.prompt.split()) + 64 <= 97 for i in kept)
    assert summary["token_budget"]["checked"] is True


def test_progress_reports_every_row(tmp_path):
    calls = []
    prepare_data(
        load_config("demo", ["data.num_synthetic=30", "data.holdout_size=5"]),
        tmp_path,
        progress=lambda done, total: calls.append((done, total)),
    )
    assert calls == [(k, 30) for k in range(1, 31)]


def write_rows(tmp_path, rows, files):
    for name, payload in files.items():
        (tmp_path / name).write_bytes(payload)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))
    return path


def mv_row(pid, image, **changes):
    row = {
        "pid": pid,
        "question": f"What is shown in picture {pid}?",
        "image": image,
        "choices": None,
        "unit": None,
        "precision": None,
        "answer": "4",
        "question_type": "free_form",
        "answer_type": "integer",
        "metadata": {"split": "testmini", "task": "figure question answering"},
    }
    return {**row, **changes}


def test_bad_rows_are_dropped_with_reasons_and_the_run_completes(tmp_path):
    good = {f"good{k}.png": png_bytes(placeholder_image(f"good{k}")) for k in range(6)}
    truncated = png_bytes(placeholder_image("trunc", size=(300, 200)))
    files = {
        **good,
        "corrupt.png": b"\x89PNG garbage",
        "truncated.png": truncated[: len(truncated) // 2],
        "empty.png": b"",
        "one.png": png_bytes(Image.new("RGB", (1, 1))),
        "bomb.png": png_header_only(20000, 20000),
    }
    rows = [mv_row(f"g{k}", f"good{k}.png") for k in range(6)] + [
        mv_row("corrupt", "corrupt.png"),
        mv_row("truncated", "truncated.png"),
        mv_row("empty", "empty.png"),
        mv_row("one-pixel", "one.png"),
        mv_row("bomb", "bomb.png"),
        mv_row("no-file", "absent.png"),
        mv_row("no-question", "good0.png", question=None),
        mv_row("blank-question", "good0.png", question="   "),
        mv_row("no-answer", "good0.png", answer=None),
        mv_row("words", "good0.png", answer="four"),
        mv_row("g0", "good1.png"),  # duplicated pid
        "{not json\n",
    ]
    result = prepare_data(
        load_config(
            "demo",
            [f"data.source={write_rows(tmp_path, rows, files)}", "data.holdout_size=2", "data.image_size=32"],
        ),
        tmp_path / "run",
    )
    reasons = {d["id"]: d["reason"] for d in read_jsonl(result.data_dir / "dropped.jsonl")}
    assert reasons == {
        "corrupt": "corrupt_image",
        "truncated": reasons["truncated"],
        "empty": "corrupt_image",
        "one-pixel": "too_small",
        "bomb": "too_large",
        "no-file": "missing_image",
        "no-question": "missing_question",
        "blank-question": "missing_question",
        "no-answer": "missing_answer",
        "words": "non_numeric_answer",
        "g0": "duplicate_id",
        "rows.jsonl:18": "bad_row",  # no id: named by its file and line
    }
    assert reasons["truncated"] in ("truncated_image", "corrupt_image")
    assert result.num_train + result.num_holdout == 6
    assert assert_counts_add_up(tmp_path / "run")["counts"]["input_rows"] == len(rows)


def test_everything_dropped_is_a_clear_error(tmp_path):
    rows = [mv_row(f"w{k}", "x.png", answer="many") for k in range(5)] + [mv_row("m", "x.png", question="")]
    config = load_config("demo", [f"data.source={write_rows(tmp_path, rows, {})}", "data.holdout_size=1"])
    with pytest.raises(
        DataError, match=r"all 6 rows were dropped.*non_numeric_answer: 5.*missing_question: 1"
    ):
        prepare_data(config, tmp_path / "run")


def test_holdout_larger_than_the_data_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="holdout_size=1024 would leave nothing to train"):
        prepare_data(load_config("demo", ["data.num_synthetic=1024"]), tmp_path)


def test_contamination_guard_removes_exact_and_near_copies_from_train(tmp_path):
    originals = {f"o{k}": placeholder_image(f"orig{k}") for k in range(20)}
    files, rows = {}, []
    for pid, img in originals.items():
        brighter = img.point(lambda v: min(255, v + 10))
        files.update({f"{pid}.png": png_bytes(img), f"{pid}-b.png": png_bytes(brighter)})
        rows += [
            mv_row(pid, f"{pid}.png"),
            mv_row(f"{pid}-copy", f"{pid}.png"),
            mv_row(f"{pid}-bright", f"{pid}-b.png"),
        ]
    config = load_config(
        "demo",
        [f"data.source={write_rows(tmp_path, rows, files)}", "data.holdout_size=6", "data.image_size=64"],
    )
    result = prepare_data(config, tmp_path / "run")
    summary = assert_counts_add_up(tmp_path / "run")
    train, holdout = load_prepared(tmp_path / "run")
    dropped = [
        d for d in read_jsonl(result.data_dir / "dropped.jsonl") if d["reason"] == "contaminated_holdout"
    ]
    family = {row["pid"]: row["pid"].split("-")[0] for row in rows}  # o3-bright -> o3
    held_families = {family[i.id] for i in holdout}
    assert not any(family[i.id] in held_families for i in train)  # no copy of a held-out picture trains
    exact = [d for d in dropped if d["detail"].startswith("same image as holdout item")]
    near = [d for d in dropped if "near-duplicate" in d["detail"] and "dHash distance" in d["detail"]]
    assert exact and near and len(exact) + len(near) == len(dropped)
    for d in dropped:
        assert family[d["detail"].split("holdout item ")[1].split("'")[0].split(" ")[0]] == family[d["id"]]
    assert len(train) == 3 * 20 - 6 - len(dropped) and summary["contamination_check"].startswith(
        "sha256 + dHash"
    )
    assert result.comparable_to_published is False  # both sides are testmini rows


def test_find_contamination_and_check_no_overlap():
    holdout = [ImageKey("h1", "aa", 0b1111_0000), ImageKey("h2", "bb", 2**63)]
    train = [
        ImageKey("t1", "aa", 12345),
        ImageKey("t2", "cc", 0b1111_0011),
        ImageKey("t3", "dd", 0b1010_1010_1010),
    ]
    found = {c.train_id: c for c in find_contamination(train, holdout)}
    assert found["t1"].kind == "exact" and found["t1"].holdout_id == "h1"
    assert found["t2"].kind == "near" and found["t2"].distance == 2 and "t3" not in found
    assert [c.train_id for c in find_contamination(train, holdout, near_duplicates=False)] == ["t1"]

    item = Item("a", "q?", "p", "1", "integer", None, None, None, "synthetic", "c", ("data/images/x.png",), ("s1",))
    check_no_overlap([item], [replace(item, id="b", image_sha256=("s2",))])
    with pytest.raises(DataError, match="id.*in both train and holdout"):
        check_no_overlap([item], [replace(item, image_sha256=("s2",))])
    two = replace(item, images=("data/images/y.png", "data/images/x.png"), image_sha256=("s3", "s1"))
    with pytest.raises(DataError, match="identical to holdout images.*a ~ b"):  # the second image counts too
        check_no_overlap([two], [replace(item, id="b")])
    with pytest.raises(DataError, match="identical to holdout images.*a ~ b"):
        check_no_overlap([item], [replace(item, id="b")])


def test_item_round_trip_and_read_errors_name_file_and_line(tmp_path):
    item = Item(
        "a",
        "q?",
        "prompt",
        "2.50",
        "float",
        2,
        "cm",
        ("1", "2.50"),
        "synthetic",
        "bar_value",
        ("data/images/x.png", "data/images/y.png"),
        ("f" * 64, "e" * 64),
        {"family": "bar_value", "spec": {"bars": {"A": 2.5}}},
        {"difficulty_note": "hard", "tags": ["a", "b"]},
    )
    assert Item.from_json(json.loads(json.dumps(item.to_json()))) == item
    path = tmp_path / "train.jsonl"
    write_jsonl(path, [item.to_json(), item.to_json()])
    assert read_items(path) == [item, item]
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temp files behind
    path.write_text(json.dumps(item.to_json()) + "\n{broken\n")
    with pytest.raises(DataError, match=r"train.jsonl:2: not a valid item"):
        read_items(path)
    legacy = {**item.to_json(), "image": "data/images/x.png", "image_sha256": "f" * 64}
    del legacy["images"], legacy["extra"]  # a manifest written before several images per item
    assert Item.from_json(legacy).images == ("data/images/x.png",) and Item.from_json(legacy).extra == {}
    path.write_text(json.dumps({**item.to_json(), "answer_type": "essay"}) + "\n")
    with pytest.raises(DataError, match=r"train.jsonl:1.*answer_type"):
        read_items(path)
    with pytest.raises(DataError, match="no such file"):
        read_items(tmp_path / "absent.jsonl")


def test_rerun_with_another_config_replaces_outputs_and_unused_images(tmp_path):
    prepare_data(load_config("demo", ["data.num_synthetic=40", "data.holdout_size=5"]), tmp_path)
    result = prepare_data(
        load_config("demo", ["data.num_synthetic=40", "data.holdout_size=5", "data.image_size=64"]), tmp_path
    )
    assert not result.holdout_reused
    stored = {p.name for p in (tmp_path / "data" / "images").iterdir()}
    used = {i.image.split("/")[-1] for i in read_items(result.train_path) + read_items(result.holdout_path)}
    assert stored == used and len(stored) == 40
    assert Counter(Image.open(tmp_path / "data" / "images" / n).size for n in stored) == {(64, 64): 40}
