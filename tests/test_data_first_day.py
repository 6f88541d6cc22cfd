"""A user's first day with their own data: a huge cell, a lone surrogate, a very wide CSV, an empty file, drawn
figures the contamination guard took for copies, mapped columns a reward asks for by their own name, TRL's
conversational prompts, and a missing image file. Each case failed (out of memory, a traceback, a wrong drop or
a wrong fix text) before the fixes it names."""

from __future__ import annotations

import io
import json
import tracemalloc
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

from tests.conftest import placeholder_image
from vlmrl.common.io import read_json, read_jsonl
from vlmrl.config.schema import load_config
from vlmrl.data.items import DataError, read_items
from vlmrl.data.prepare import prepare_data
from vlmrl.data.sources import MAX_LINE_BYTES, _jsonl_rows
from vlmrl.data.values import MAX_CELL_CHARS

MAPPING = "data.columns={id: id, question: question, answer: answer, image: image}"
SMALL = ["data.image_size=32", "data.holdout_size=1", "train.per_device_train_batch_size=4"]


def rows_file(tmp_path: Path, rows: list[dict], name: str = "rows.jsonl", images: int = 4) -> Path:
    for k in range(images):
        placeholder_image(f"f{k}").save(tmp_path / f"{k}.png")
    path = tmp_path / name
    if name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif name.endswith(".csv"):
        import csv

        with path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def row(k: int, **fields) -> dict:
    return {"id": f"r{k}", "question": "How many?", "answer": str(k), "image": f"{k % 4}.png", **fields}


def prepare(tmp_path: Path, source: Path, *overrides: str, counter=None):
    config = load_config("demo", [f"data.source={source}", *SMALL, *overrides])
    result = prepare_data(config, tmp_path / "run", token_counter=counter)
    dropped = {d["id"]: d for d in read_jsonl(result.data_dir / "dropped.jsonl")}
    kept = {i.id for i in read_items(result.train_path) + read_items(result.holdout_path)}
    assert result.input_rows == len(kept) + len(dropped)  # every row accounted for
    return result, kept, dropped


# --- 1. one long cell ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet", "saved"])
def test_an_over_long_cell_is_dropped_before_anything_tokenizes_it(tmp_path, fmt):
    # before: JSONL and Parquet cells went to the tokenizer whole (200 MB: 24 GB RSS, the OOM killer)
    long = "x" * (MAX_CELL_CHARS + 1)
    rows = [row(0, question=long, note="a"), row(1, note="b"), row(2, note="c"), row(3, note=long)]  # or an extra
    if fmt == "saved":
        import datasets

        rows_file(tmp_path, [], images=4)
        source = tmp_path / "saved"
        datasets.Dataset.from_list(rows).save_to_disk(str(source))
        for k in range(4):
            (source / f"{k}.png").write_bytes((tmp_path / f"{k}.png").read_bytes())
    else:
        source = rows_file(tmp_path, rows, name=f"rows.{fmt}")
    seen: list[int] = []

    def counter(prompt: str, images: list) -> int:
        seen.append(len(prompt))
        return 10

    result, kept, dropped = prepare(tmp_path, source, MAPPING, counter=counter)
    assert kept == {"r1", "r2"} and result.dropped_by_reason == {"cell_too_large": 2}
    assert max(seen) < MAX_CELL_CHARS and "131,073 characters" in next(iter(dropped.values()))["detail"]


def test_an_over_long_jsonl_line_is_never_read_whole(tmp_path, monkeypatch):
    # before: each line was read (and json-parsed) whole: 20 MB cost 4.8 GB and 43 s
    limit = 2 * 1024 * 1024
    monkeypatch.setattr("vlmrl.data.sources.MAX_LINE_BYTES", limit)  # the same code at a size a test can afford
    path = tmp_path / "rows.jsonl"
    with path.open("w") as handle:
        handle.write(json.dumps(row(0)) + "\n")
        handle.write(json.dumps(row(1, question="y" * (5 * limit))) + "\n")
        handle.write(json.dumps(row(2)) + "\n")
    tracemalloc.start()
    rows = list(_jsonl_rows(path))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [r.get("__reason__") for r in rows] == [None, "row_too_large", None]
    assert rows[2]["__where__"] == "rows.jsonl:3" and peak < 3 * limit  # the line is 5x that
    assert MAX_LINE_BYTES >= 8 * MAX_CELL_CHARS  # a row of several cells at the cell limit still fits


# --- 2. a lone surrogate --------------------------------------------------------------------------------


def test_a_lone_surrogate_in_an_id_a_value_or_a_column_name_is_one_drop(tmp_path):
    # before: UnicodeEncodeError out of prepare, for the whole file
    path = tmp_path / "rows.jsonl"
    rows_file(tmp_path, [], images=4)
    lines = [json.dumps(row(0)), '{"id": "a\\ud800", "question": "q?", "answer": "1", "image": "1.png"}',
             json.dumps(row(2, question="x \udc00 y")), json.dumps({**row(3), "col\ud800": 1}), json.dumps(row(4, image="3.png"))]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogatepass")
    result, kept, dropped = prepare(tmp_path, path, MAPPING)
    assert kept == {"r0", "r4"} and result.dropped_by_reason == {"bad_encoding": 3}
    assert "lone surrogate" in dropped["rows.jsonl:2"]["detail"] and "\\ud800" in dropped["rows.jsonl:2"]["detail"]
    summary = read_json(result.data_dir / "summary.json")
    assert summary["drops"][0]["fix"].startswith("save the file as UTF-8")


# --- 3. a very wide CSV ------------------------------------------------------------------------------------


def test_a_csv_with_more_columns_than_the_cap_is_refused_in_one_line(tmp_path):
    # before: 10^6 columns became a 440 MB train.jsonl (118 s, 3 GB RSS)
    header = ["id", "question", "answer", "image"] + [f"c{k}" for k in range(2000)]
    path = tmp_path / "wide.csv"
    path.write_text(",".join(header) + "\n" + ",".join(["r0", "q?", "1", "0.png"] + ["v"] * 2000) + "\n")
    config = load_config("demo", [f"data.source={path}", *SMALL, MAPPING])
    with pytest.raises(DataError, match=r"wide.csv: 2,004 columns, more than vlmrl reads \(1,000\)") as caught:
        prepare_data(config, tmp_path / "run")
    assert "\n" not in str(caught.value)


def test_a_jsonl_row_with_more_columns_than_the_cap_is_dropped(tmp_path):
    wide = row(1, **{f"c{k}": k for k in range(1200)})
    result, kept, _ = prepare(tmp_path, rows_file(tmp_path, [row(0), wide, row(2), row(3)]), MAPPING)
    assert kept == {"r0", "r2", "r3"} and result.dropped_by_reason == {"too_many_columns": 1}


# --- 4. an empty file ------------------------------------------------------------------------------------


@pytest.mark.parametrize("content", ["", "id,question,answer,image\n"])
def test_an_empty_or_header_only_file_says_it_has_no_rows(tmp_path, content):
    # before: "all 0 rows were dropped. Top reasons: ."
    path = tmp_path / ("rows.jsonl" if not content else "rows.csv")
    path.write_text(content)
    config = load_config("demo", [f"data.source={path}", *SMALL, MAPPING])
    with pytest.raises(DataError, match="has no rows: the file is empty or holds only a header line") as caught:
        prepare_data(config, tmp_path / "run")
    assert "Top reasons" not in str(caught.value)


# --- 5. the contamination guard ------------------------------------------------------------------------------


def circle(x: int, y: int, r: int, fill: str) -> Image.Image:
    img = Image.new("RGB", (200, 200), "white")
    ImageDraw.Draw(img).ellipse([x - r, y - r, x + r, y + r], fill=fill, outline="black", width=2)
    return img


def jpeg(img: Image.Image, quality: int = 70) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def circles_source(tmp_path: Path) -> Path:
    import random

    rng = random.Random(0)
    fills = ["red", "blue", "green", "white", "black", "yellow"]
    rows = []
    for k in range(40):  # different positions, sizes and fills: no two are copies
        circle(rng.randrange(40, 160), rng.randrange(40, 160), rng.randrange(10, 40), rng.choice(fills)).save(
            tmp_path / f"c{k}.png")
        rows.append({"id": f"c{k}", "question": "How many?", "answer": str(k), "image": f"c{k}.png"})
    for fill in fills:  # the same circle, filled differently
        circle(100, 100, 30, fill).save(tmp_path / f"same-{fill}.png")
        rows.append({"id": f"same-{fill}", "question": "?", "answer": "1", "image": f"same-{fill}.png"})
    return rows_file(tmp_path, rows, name="circles.jsonl", images=0)


def test_drawn_circles_at_other_positions_or_fills_are_not_contaminated(tmp_path):
    # before: 46% of a set of drawn circles dropped as "near-duplicate ... (dHash distance 0)"
    config = ["data.image_size=64", "data.holdout_size=20", "train.per_device_train_batch_size=4", MAPPING]
    load = load_config("demo", [f"data.source={circles_source(tmp_path)}", *config])
    result = prepare_data(load, tmp_path / "run")
    assert result.dropped_by_reason == {} and result.num_train == 26
    assert result.summary["contamination_check"].startswith("sha256 + dHash <= 4 bits, confirmed by pixels")


def test_a_re_encoded_or_resized_copy_is_dropped_in_near_mode_and_kept_with_exact_or_off(tmp_path):
    base = circle(70, 120, 25, "red")
    (tmp_path / "orig.png").write_bytes(_png(base))
    (tmp_path / "jpeg.jpg").write_bytes(jpeg(base.resize((150, 170))))  # resized and re-encoded
    (tmp_path / "big.png").write_bytes(_png(base.resize((400, 400))))
    rows = [{"id": "orig", "question": "?", "answer": "1", "image": "orig.png"},
            {"id": "jpeg", "question": "?", "answer": "1", "image": "jpeg.jpg"},
            {"id": "big", "question": "?", "answer": "1", "image": "big.png"}]
    for k in range(8):
        circle(20 + 20 * k, 40, 15, "blue").save(tmp_path / f"o{k}.png")
        rows.append({"id": f"o{k}", "question": "?", "answer": "1", "image": f"o{k}.png"})
    path = rows_file(tmp_path, rows, images=0)
    held = "data.holdout_size=1"
    config = load_config("demo", [f"data.source={path}", "data.image_size=64", held, MAPPING,
                                  "train.per_device_train_batch_size=4"])
    from vlmrl.data.splits import choose_holdout

    ids = [r["id"] for r in rows]
    seed = next(s for s in range(100) if choose_holdout(ids, 1, s) == ["orig"])  # hold out the original
    near = prepare_data(config.model_copy(update={"run": config.run.model_copy(update={"seed": seed})}),
                        tmp_path / "near")
    dropped = {d["id"]: d for d in read_jsonl(near.data_dir / "dropped.jsonl")}
    assert set(dropped) == {"jpeg", "big"} and all("near-duplicate of holdout item orig" in d["detail"]
                                                   for d in dropped.values())
    assert "data.contamination: exact" in near.summary["drops"][0]["fix"]
    for mode, expected in (("exact", 0), ("off", 0)):
        data = config.data.model_copy(update={"contamination": mode})
        other = config.model_copy(update={"data": data, "run": config.run.model_copy(update={"seed": seed})})
        result = prepare_data(other, tmp_path / mode)
        assert result.num_train == 10 and len(result.dropped_by_reason) == expected
        assert result.summary["contamination"] == mode


def test_off_keeps_an_identical_picture_in_train_and_later_stages_accept_it(tmp_path):
    from vlmrl.data.prepare import load_prepared

    rows = [row(k, image="0.png") for k in range(6)]  # one picture for every row
    _, kept, _ = prepare(tmp_path, rows_file(tmp_path, rows), MAPPING, "data.contamination=off")
    train, holdout = load_prepared(tmp_path / "run")
    assert len(kept) == 6 and len(train) == 5 and train[0].image_sha256 == holdout[0].image_sha256


def _png(img: Image.Image) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, "PNG")
    return buffer.getvalue()


# --- 8. a missing image file -------------------------------------------------------------------------------


def test_a_missing_image_file_says_the_file_is_missing_with_its_path(tmp_path):
    # before: "map the column holding the image", though the column was mapped
    result, _, dropped = prepare(tmp_path, rows_file(tmp_path, [row(0), row(1, image="gone.png"), row(2), row(3)]),
                                 MAPPING)
    fix = dropped["r1"]["fix"]
    assert result.dropped_by_reason == {"missing_image": 1}
    assert str(tmp_path / "gone.png") in fix and "is missing" in fix and "map the column" not in fix
    assert result.summary["drops"][0]["fix"] == fix


# --- 6. mapped columns under their own names -------------------------------------------------------------------

SOLUTION_REWARD = '''
def solution_match(completions, solution, **kwargs):
    return [1.0 if str(s) in str(c) else 0.0 for c, s in zip(completions, solution)]

def wants_difficulty(completions, difficulty, **kwargs):
    return [0.0 for _ in completions]
'''


def test_a_reward_may_take_a_mapped_column_by_its_own_name_and_validate_says_what_run_would(tmp_path, monkeypatch):
    # before: `reward takes 'solution', which is no column of the data` at run; `config validate` said ok
    from vlmrl.common.io import read_jsonl as records
    from vlmrl.grading import user_rewards
    from vlmrl.train import args

    monkeypatch.setattr(args, "training_problems", lambda config: [])  # TRL's own checks: not this test's
    (tmp_path / "my_rewards.py").write_text(SOLUTION_REWARD)
    rows = [{"id": f"r{k}", "question": "How many?", "solution": k, "image": f"{k % 4}.png"} for k in range(6)]
    source = rows_file(tmp_path, rows)
    mapping = "data.columns={id: id, question: question, answer: solution, image: image}"
    reward = f"rewards=[{{function: '{tmp_path / 'my_rewards.py'}:solution_match'}}]"
    config = load_config("demo", [f"data.source={source}", *SMALL, mapping, reward,
                                  f"run.output_dir={tmp_path / 'runs'}"])
    assert args.validation_problems(config) == []
    prepare_data(config, config.run_dir)
    holdout = records(config.run_dir / "data" / "holdout.jsonl")
    columns = user_rewards.item_columns(holdout[0])  # what the run's reward check (and TRL) hands a reward
    user_rewards._check_arguments(user_rewards.load_rewards(config), columns)  # run's check: no refusal
    assert columns["solution"] == int(columns["answer"])  # the cell as written (a number), as TRL passes it

    missing = f"rewards=[{{function: '{tmp_path / 'my_rewards.py'}:wants_difficulty'}}]"
    bad = load_config("demo", [f"data.source={source}", *SMALL, mapping, missing])
    (problem,) = args.validation_problems(bad)
    assert "takes 'difficulty', which is no column of the data" in problem


# --- 7. prompts: TRL's conversational column, a system prompt, a template ------------------------------------


def test_a_trl_conversational_prompt_column_is_a_question_with_its_system_message(tmp_path):
    # before: the list of messages was refused as `missing_question`
    from vlmrl.data.table import train_table
    from vlmrl.engine.rollout.generation import build_messages

    def prompt(k: int) -> list[dict]:
        return [{"role": "system", "content": "You are a careful counter."},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"<image>How many? ({k})"}]}]

    rows = [{"id": f"r{k}", "prompt": prompt(k), "solution": str(k), "image": f"{k}.png"} for k in range(4)]
    rows.append({"id": "plain", "prompt": "Count them.", "solution": "4", "image": "3.png"})
    rows.append({"id": "few-shot", "prompt": [*prompt(5), {"role": "assistant", "content": "5"}], "solution": "5",
                 "image": "2.png"})
    mapping = "data.columns={id: id, question: prompt, answer: solution, image: image}"
    result, kept, dropped = prepare(tmp_path, rows_file(tmp_path, rows), mapping, "data.holdout_size=1",
                                    "data.system_prompt=Answer briefly.", "data.contamination=off")
    assert kept == {"r0", "r1", "r2", "r3", "plain"} and dropped["few-shot"]["reason"] == "bad_prompt"
    items = {i.id: i for i in read_items(result.train_path) + read_items(result.holdout_path)}
    assert items["r2"].question == "How many? (2)" and items["r2"].prompt.startswith("How many? (2)\n\nFirst think")
    assert items["r2"].system == "You are a careful counter." and items["plain"].system == "Answer briefly."
    table = train_table([items["r2"]], tmp_path / "run")
    assert [m["role"] for m in table["prompt"][0]] == ["system", "user"]
    assert build_messages(items["r2"].prompt, 1, items["r2"].system)[0]["role"] == "system"  # evaluation's too


def test_a_prompt_template_replaces_the_instruction_and_the_contract_still_grades(tmp_path):
    from vlmrl.contract import render_answer
    from vlmrl.grading.rewards import correctness_reward, format_reward

    template = "Look at the picture. {question}\nReason in <think></think>, then answer in \\boxed{}."
    config = load_config("demo", [f"data.source={rows_file(tmp_path, [row(k) for k in range(4)])}", *SMALL, MAPPING,
                                  "contract=think"])
    config.data.prompt_template = template  # (checked on assignment as in a file)
    item = read_items(prepare_data(config, tmp_path / "run").train_path)[0]
    assert item.prompt == "Look at the picture. How many?\nReason in <think></think>, then answer in \\boxed{}."
    completion = [[{"role": "assistant", "content": render_answer("counted", item.answer, "think")}]]
    columns = {k: [v] for k, v in item.columns().items()}
    assert format_reward(completion, contract="think") == [2.0]  # working and answer both well-formed
    assert correctness_reward(completion, contract="think", **columns) == [2.0]  # the exact gold
    with pytest.raises(Exception, match=r"has no \{question\}"):
        load_config("demo", ["data.prompt_template=Answer it."])
