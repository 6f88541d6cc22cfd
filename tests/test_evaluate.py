"""Stages 5 and 7, evaluation: one record per held-out item, a summary that is the records' own, resume
after a kill, sampled evaluation, and bad inputs refused before any model loads.

Each family's run is prepared once per module (tiny model, 40 synthetic items, 6 held out, 12-token
completions); tests that write records work on a copy.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers import copy_run, quick_config
from vlmrl.common.io import read_json, read_jsonl
from vlmrl.config.schema import Config
from vlmrl.engine.rollout.generation import Generation
from vlmrl.evaluate.stage import EvalError, evaluate, make_record, summarize
from vlmrl.grading.rewards import score_completion
from vlmrl.models.tiny import TINY_ARCHS
from vlmrl.pipeline import prepare_with_budget
from vlmrl.run.layout import read_holdout as load_holdout

MAX_NEW_TOKENS = 12
HOLDOUT = 6
EVAL_RUN = (  # the demo preset's training settings; `model.name` is set per family
    "model.name=tiny:qwen3_vl", "data.num_synthetic=40", f"data.holdout_size={HOLDOUT}",
    f"eval.max_new_tokens={MAX_NEW_TOKENS}", "eval.do_sample=false",
    "eval.batch_size=2",  # three batches of two: a kill can land between them
)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> dict[str, Path]:
    """A prepared (not evaluated) run directory per family; never written to by the tests."""
    runs = {}
    for arch in TINY_ARCHS:
        output_dir = tmp_path_factory.mktemp(f"eval_{arch}")
        config = quick_config(output_dir, f"model.name=tiny:{arch}", base=EVAL_RUN)
        prepare_with_budget(config, config.run_dir)
        runs[arch] = config.run_dir
    return runs


@pytest.fixture(scope="module")
def baseline(prepared, tmp_path_factory) -> dict[str, tuple[Config, Path]]:
    """Every family evaluated once at baseline (greedy), each in its own copy of the prepared run."""
    done = {}
    for arch, run_dir in prepared.items():
        out = tmp_path_factory.mktemp(f"baseline_{arch}")
        config = quick_config(out, f"model.name=tiny:{arch}", base=EVAL_RUN)
        copy_run(run_dir, out)
        evaluate(config, config.run_dir, "baseline")
        done[arch] = (config, config.run_dir)
    return done


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if anything loads a model: the checks under test must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("load_model was called before the input was checked")

    monkeypatch.setattr("vlmrl.models.loading.load_model", refuse)


# ---------------------------------------------------------------------------------------------------------------
# records: an explicit schema (jsonschema is not a dependency)

NUMBER = (int, float)
RECORD_SCHEMA: dict[str, tuple[type, ...]] = {
    "id": (str,),
    "stage": (str,),
    "question": (str,),
    "gold": (str,),
    "answer_type": (str,),
    "precision": (int, type(None)),
    "contract": (str,),  # the answer form the completion was read under (seed | think)
    "completion": (str,),
    "pred": (str, type(None)),
    "format_ok": (bool,),
    "format_reward": NUMBER,
    "correctness_reward": NUMBER,
    "total_reward": NUMBER,
    "rewards": (dict,),
    "correct": (bool,),
    "exact_match": (bool,),
    "degenerate": (bool,),
    "mathvista_normalized": (str, type(None)),
    "mathvista_correct": (bool,),
    "generated_tokens": (int,),
    "truncated": (bool,),
    "image_sha256": (list,),  # one sha256 per image, in order
    "prompt_sha256": (str,),
    "category": (str, type(None)),
    "metadata": (dict,),
    "generation": (dict,),
    "rewards_fingerprint": (str, type(None)),
    "seconds": NUMBER,
    "provenance": (dict,),  # vlmrl_version and git_commit (issue 20)
}
SAMPLED_SCHEMA: dict[str, tuple[type, ...]] = {
    "samples": (list,),
    "pass_at_k": (bool,),
    "majority_pred": (str, type(None)),
    "majority_correct": (bool,),
}
SAMPLE_KEYS = {
    "completion", "pred", "format_ok", "format_reward", "correctness_reward", "total_reward", "rewards", "correct",
    "exact_match", "degenerate", "mathvista_normalized", "mathvista_correct", "generated_tokens", "truncated",
}  # fmt: skip
GENERATION_KEYS = {"max_new_tokens", "do_sample", "temperature", "num_samples", "model", "adapter"}


def schema_problems(record: dict, sampled: bool = False) -> list[str]:
    """Every way `record` departs from the schema (missing, unexpected or wrongly typed keys)."""
    schema = {**RECORD_SCHEMA, **(SAMPLED_SCHEMA if sampled else {})}
    problems = [f"missing {key}" for key in schema if key not in record]
    problems += [f"unexpected {key}" for key in record if key not in schema]
    for key, types in schema.items():
        value = record.get(key)
        if key not in record:
            continue
        if isinstance(value, bool) and bool not in types:  # bool is an int subclass: not a number here
            problems.append(f"{key}: bool where {types} expected")
        elif not isinstance(value, types):
            problems.append(f"{key}: {type(value).__name__} where {types} expected")
    generation = record.get("generation")
    if isinstance(generation, dict) and set(generation) != GENERATION_KEYS | (
            {"adapter_digest"} if generation.get("adapter") else set()):  # an adapter's content identity
        problems.append(f"generation keys {sorted(generation)}")
    for sample in record.get("samples", []) if sampled else []:
        if set(sample) != SAMPLE_KEYS:
            problems.append(f"sample keys {sorted(set(sample) ^ SAMPLE_KEYS)}")
    return problems


def test_schema_check_itself_catches_a_bad_record() -> None:
    good = {key: types[0]() if types[0] not in (int, float) else 0 for key, types in RECORD_SCHEMA.items()}
    good["generation"] = dict.fromkeys(GENERATION_KEYS)
    good["format_ok"] = good["correct"] = False
    assert schema_problems(good) == []
    bad = {**good, "correct": 1, "seconds": True, "extra": 1}
    del bad["pred"]
    assert sorted(schema_problems(bad)) == sorted(
        ["missing pred", "unexpected extra", "correct: int where (<class 'bool'>,) expected",
         f"seconds: bool where {NUMBER} expected"]
    )


def check_records_against_holdout(records: list[dict], items: list[dict], stage: str, sampled: bool = False):
    """One record per item in holdout order; schema; hashes and scores consistent with what they record."""
    assert [r["id"] for r in records] == [i["id"] for i in items]
    for record, item in zip(records, items):
        assert schema_problems(record, sampled) == [], record["id"]
        assert record["stage"] == stage
        assert record["gold"] == item["answer"] and record["question"] == item["question"]
        assert record["prompt_sha256"] == hashlib.sha256(item["prompt"].encode()).hexdigest()[:16]
        assert record["image_sha256"] == item["image_sha256"]
        assert 1 <= record["generated_tokens"] <= MAX_NEW_TOKENS
        if record["truncated"]:
            assert record["generated_tokens"] == MAX_NEW_TOKENS
        # every derived field is what the raw completion gives when scored again
        scored = score_completion(record["completion"], record["gold"])
        assert (record["pred"], record["format_reward"], record["correctness_reward"], record["correct"]) == (
            scored["pred"], scored["format"], scored["correctness"], scored["correct"]
        )
        assert record["total_reward"] == pytest.approx(scored["total"])
        # each configured reward (the defaults here) under its function's name, called as TRL calls it
        assert record["rewards"] == {"format_reward": scored["format"], "correctness_reward": scored["correctness"]}


# ---------------------------------------------------------------------------------------------------------------
# baseline on every family


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_baseline_writes_one_valid_record_per_holdout_item(arch: str, baseline) -> None:
    config, run_dir = baseline[arch]
    records = read_jsonl(run_dir / "baseline_records.jsonl")
    items = load_holdout(config, run_dir)
    assert len(items) == HOLDOUT
    check_records_against_holdout(records, items, "baseline")
    expected_settings = {"max_new_tokens": MAX_NEW_TOKENS, "do_sample": False, "temperature": None,
                         "num_samples": 1, "model": f"tiny:{arch}", "adapter": None}
    assert all(r["generation"] == expected_settings for r in records)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_summary_file_is_recomputed_from_the_records(arch: str, baseline) -> None:
    config, run_dir = baseline[arch]
    records = read_jsonl(run_dir / "baseline_records.jsonl")
    summary = read_json(run_dir / "baseline_summary.json")
    n = len(records)
    assert summary["stage"] == "baseline" and summary["n"] == n == HOLDOUT

    def mean(key: str) -> float:
        return sum(float(r[key]) for r in records) / n

    for metric, key in [("accuracy", "correct"), ("mathvista_accuracy", "mathvista_correct"),
                        ("exact_match", "exact_match"), ("format_compliance", "format_ok"),
                        ("format_reward", "format_reward"), ("correctness_reward", "correctness_reward"),
                        ("total_reward", "total_reward")]:  # fmt: skip
        assert summary[metric]["mean"] == pytest.approx(mean(key)), metric
        lo, hi = summary[metric]["ci95"]
        assert lo <= summary[metric]["mean"] <= hi
    assert summary["truncation_rate"] == pytest.approx(mean("truncated"))
    assert summary["gibberish_rate"] == pytest.approx(mean("degenerate"))
    assert summary["mean_generated_tokens"] == pytest.approx(mean("generated_tokens"))
    seconds = sum(r["seconds"] for r in records)
    tokens = sum(r["generated_tokens"] for r in records)
    assert summary["tokens_per_second"] == pytest.approx(tokens / seconds, rel=1e-6)
    # and the whole file is exactly what `summarize` gives for these records
    recomputed = json.loads(json.dumps(summarize(records, stage="baseline", seed=config.run.seed)))
    # who wrote it and when, and what the reward check before it measured: the parts not computed from the records
    provenance, check = summary.pop("provenance"), summary.pop("reward_check")
    assert recomputed == summary
    assert set(check) == {"format_reward", "correctness_reward"} and check["format_reward"]["well_formed"] == 2.0
    assert provenance["vlmrl_version"] and provenance["started_at"] <= provenance["finished_at"]
    assert "pass_at_k" not in summary  # greedy: one sample per item


def test_a_finished_evaluation_rerun_loads_no_model_and_keeps_the_records(baseline, no_model_load) -> None:
    config, run_dir = baseline["qwen3_vl"]
    before = (run_dir / "baseline_records.jsonl").read_bytes()
    result = evaluate(config, run_dir, "baseline")
    assert (run_dir / "baseline_records.jsonl").read_bytes() == before
    assert result.summary["n"] == HOLDOUT


# ---------------------------------------------------------------------------------------------------------------
# resume after a kill


def test_resume_after_a_kill_gives_exactly_one_record_per_id(baseline, tmp_path: Path) -> None:
    _, full_run = baseline["qwen3_vl"]
    config = quick_config(tmp_path, base=EVAL_RUN)
    run_dir = copy_run(full_run, tmp_path)
    path = run_dir / "baseline_records.jsonl"
    full = path.read_text().splitlines(keepends=True)
    assert len(full) == HOLDOUT
    items = load_holdout(config, run_dir)

    damages = {  # batch_size=2: lines 0-1 are the first batch, 2-3 the second
        "killed after the first batch": (2, False),
        "killed while writing the second batch's first line": (2, True),
        "killed while writing the second batch's second line": (3, True),
    }
    for damage, (complete, torn) in damages.items():
        kept = full[:complete]
        path.write_text("".join(kept) + (full[complete][: len(full[complete]) // 2] if torn else ""))
        evaluate(config, run_dir, "baseline")
        text = path.read_text()
        assert text.startswith("".join(kept)), damage  # earlier records untouched
        records = read_jsonl(path)
        assert Counter(r["id"] for r in records) == Counter(i["id"] for i in items), damage
        check_records_against_holdout(records, items, "baseline")
        # greedy decoding over the same batches: the regenerated records say what the lost ones said
        assert [r["completion"] for r in records] == [json.loads(line)["completion"] for line in full], damage
        written = read_json(run_dir / "baseline_summary.json")
        written.pop("provenance"), written.pop("reward_check")  # not computed from the records
        assert json.loads(json.dumps(summarize(records, stage="baseline"))) == written


# ---------------------------------------------------------------------------------------------------------------
# sampled evaluation


def test_sampled_evaluation_records_pass_at_k_and_majority(prepared, tmp_path: Path) -> None:
    sampled = ["eval.do_sample=true", "eval.num_samples=3", "eval.temperature=1.0"]
    config = quick_config(tmp_path, *sampled, base=EVAL_RUN)
    run_dir = copy_run(prepared["qwen3_vl"], tmp_path)
    result = evaluate(config, run_dir, "baseline")
    records = read_jsonl(result.records_path)
    items = load_holdout(config, run_dir)
    check_records_against_holdout(records, items, "baseline", sampled=True)
    for record in records:
        samples = record["samples"]
        assert len(samples) == 3
        assert record["completion"] == samples[0]["completion"]  # the headline fields are the first sample's
        assert record["pass_at_k"] == any(s["correct"] for s in samples)
        votes = Counter(s["pred"] for s in samples if s["pred"] is not None)
        assert record["majority_pred"] == (votes.most_common(1)[0][0] if votes else None)
        if record["majority_pred"] is None:
            assert record["majority_correct"] is False
        assert record["generation"]["num_samples"] == 3 and record["generation"]["do_sample"] is True
    # sampling really happened: a random model writes three different completions for some item
    assert any(len({s["completion"] for s in r["samples"]}) > 1 for r in records)
    summary = result.summary
    assert summary["pass_at_k"]["mean"] == pytest.approx(sum(r["pass_at_k"] for r in records) / len(records))
    assert summary["majority_accuracy"]["mean"] == pytest.approx(
        sum(r["majority_correct"] for r in records) / len(records)
    )

    # seeded per batch: a resumed sampled evaluation regenerates exactly what was lost, even when the kill
    # tore the second batch's lines (its first record kept, its second cut short)
    path = result.records_path
    full = path.read_text().splitlines(keepends=True)
    path.write_text("".join(full[:3]) + full[3][: len(full[3]) // 2])
    evaluate(config, run_dir, "baseline")
    text = path.read_text()
    assert text.startswith("".join(full[:3]))
    again = read_jsonl(path)
    assert [r["id"] for r in again] == [i["id"] for i in items]
    assert [[s["completion"] for s in r["samples"]] for r in again] == [
        [s["completion"] for s in json.loads(line)["samples"]] for line in full
    ]


def test_sampled_fields_from_hand_made_generations() -> None:
    item = _item(answer="7")
    gens = [_gen("<REASONING>a</REASONING><SOLUTION>7</SOLUTION>"),
            _gen("<REASONING>b</REASONING><SOLUTION>5</SOLUTION>"),
            _gen("<REASONING>c</REASONING><SOLUTION>5</SOLUTION>")]  # fmt: skip
    record = make_record(item, gens, {}, 0.1, "baseline")
    assert record["correct"] is True  # first sample
    assert record["pass_at_k"] is True
    assert record["majority_pred"] == "5" and record["majority_correct"] is False
    assert [s["correct"] for s in record["samples"]] == [True, False, False]


# ---------------------------------------------------------------------------------------------------------------
# our verdict vs MathVista's (no model: make_record on hand-made generations)


def _item(answer: str, answer_type: str = "integer", precision: int | None = None) -> dict:
    return {"id": "x1", "question": "How long?", "prompt": "How long? ...", "answer": answer,
            "answer_type": answer_type, "precision": precision, "choices": None, "image_sha256": "ab" * 32,
            "category": "bar_value", "metadata": {}}  # fmt: skip


def _gen(text: str, tokens: int = 5, truncated: bool = False) -> Generation:
    return Generation(text=text, tokens=tokens, truncated=truncated)


@pytest.mark.parametrize(
    ("solution", "gold", "answer_type", "precision", "ours", "mathvista"),
    [
        # integer gold 3, answer 3.9: we require the number; MathVista truncates 3.9 to 3 and accepts it
        ("3.9", "3", "integer", None, False, True),
        # thousands separator: we read 1,000 as 1000; MathVista's float("1,000") fails, so None != "1000"
        ("1,000", "1000", "integer", None, True, False),
        # both agree on a plain match and on a plain miss
        ("42", "42", "integer", None, True, True),
        ("41", "42", "integer", None, False, False),
        # float gold with 1 decimal: 2.46 rounds to 2.5 for both
        ("2.46", "2.5", "float", 1, True, True),
    ],
)
def test_our_verdict_and_mathvistas_differ_where_the_rules_differ(
    solution: str, gold: str, answer_type: str, precision: int | None, ours: bool, mathvista: bool
) -> None:
    completion = f"<REASONING>\nread the chart\n</REASONING>\n<SOLUTION>{solution}</SOLUTION>"
    item = _item(gold, answer_type, precision)
    record = make_record(item, [_gen(completion)], {"model": "m"}, 0.5, "after")
    assert record["pred"] == solution
    assert record["correct"] is ours
    assert record["mathvista_correct"] is mathvista
    assert record["format_ok"] is True and "samples" not in record
    assert schema_problems({**record, "generation": dict.fromkeys(GENERATION_KEYS)}) == []


def test_record_of_an_unformatted_truncated_completion() -> None:
    generation = _gen("the answer is 3", tokens=12, truncated=True)
    record = make_record(_item("3"), [generation], {}, 0.25, "baseline")
    assert record["pred"] is None and record["correct"] is False and record["mathvista_correct"] is False
    assert record["format_ok"] is False and record["truncated"] is True and record["generated_tokens"] == 12
    assert record["seconds"] == 0.25


# ---------------------------------------------------------------------------------------------------------------
# bad input: one line naming the path, before any model loads


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    return message


def test_missing_adapter_folder(prepared, tmp_path: Path, no_model_load) -> None:
    config = quick_config(tmp_path, base=EVAL_RUN)
    run_dir = copy_run(prepared["qwen3_vl"], tmp_path)
    missing = tmp_path / "no-such-adapter"
    with pytest.raises(EvalError) as info:
        evaluate(config, run_dir, "after", adapter=missing)
    assert str(missing) in _one_line(info)
    with pytest.raises(EvalError) as info:  # the default, train/final, before training
        evaluate(config, run_dir, "after")
    assert str(run_dir / "train" / "final") in _one_line(info)
    assert not (run_dir / "after_records.jsonl").exists()


def test_adapter_for_another_base_model(prepared, tmp_path: Path, no_model_load) -> None:
    config = quick_config(tmp_path, base=EVAL_RUN)
    run_dir = copy_run(prepared["qwen3_vl"], tmp_path)
    adapter = tmp_path / "foreign-adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": "Qwen/Qwen2.5-VL-3B-Instruct", "peft_type": "LORA"})
    )
    with pytest.raises(EvalError) as info:
        evaluate(config, run_dir, "after", adapter=adapter)
    message = _one_line(info)
    assert str(adapter) in message and "Qwen/Qwen2.5-VL-3B-Instruct" in message


def test_holdout_prepared_by_another_config(prepared, tmp_path: Path, no_model_load) -> None:
    run_dir = copy_run(prepared["qwen3_vl"], tmp_path)
    other = quick_config(tmp_path, "data.num_synthetic=41", base=EVAL_RUN)
    with pytest.raises(EvalError) as info:
        evaluate(other, run_dir, "baseline")
    message = _one_line(info)
    assert str(run_dir / "data" / "holdout.jsonl") in message and "prepare" in message


def test_missing_holdout(tmp_path: Path, no_model_load) -> None:
    config = quick_config(tmp_path, base=EVAL_RUN)
    with pytest.raises(EvalError) as info:
        evaluate(config, config.run_dir, "baseline")
    assert str(config.run_dir / "data" / "holdout.jsonl") in _one_line(info)


def test_empty_holdout_file(prepared, tmp_path: Path, no_model_load) -> None:
    config = quick_config(tmp_path, base=EVAL_RUN)
    run_dir = copy_run(prepared["qwen3_vl"], tmp_path)
    (run_dir / "data" / "holdout.jsonl").write_text("")
    with pytest.raises(EvalError) as info:
        evaluate(config, run_dir, "baseline")
    message = _one_line(info)
    assert str(run_dir / "data" / "holdout.jsonl") in message and "empty" in message


def test_records_made_with_other_generation_settings(baseline, tmp_path: Path, no_model_load) -> None:
    _, full_run = baseline["qwen3_vl"]
    run_dir = copy_run(full_run, tmp_path)
    path = run_dir / "baseline_records.jsonl"
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:2]))  # a partial evaluation...
    longer = quick_config(tmp_path, "eval.max_new_tokens=24", base=EVAL_RUN)  # ...resumed with other settings
    with pytest.raises(EvalError) as info:
        evaluate(longer, run_dir, "baseline")
    message = _one_line(info)
    assert str(path) in message and "generation settings" in message
    assert len(read_jsonl(path)) == 2  # nothing mixed in


def test_unknown_stage(prepared, tmp_path: Path, no_model_load) -> None:
    config = quick_config(tmp_path, base=EVAL_RUN)
    with pytest.raises(EvalError, match="baseline or after"):
        evaluate(config, prepared["qwen3_vl"], "before")
