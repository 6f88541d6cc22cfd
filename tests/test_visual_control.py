"""The visual control's bookkeeping (not its gain): the derangement, the swapped evaluation's records, the
pairing by id and the interval.

One tiny Qwen3-VL run (8 held-out synthetic items of two families) is prepared and evaluated greedily on true
and swapped images; the after-training sides are the baseline records with chosen verdicts flipped, so the
visual gain and its interval have a value computed by hand here.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from vlmrl.common import stats
from vlmrl.common.io import read_jsonl, write_jsonl_atomic
from vlmrl.compare.stage import CompareError, compare_runs
from vlmrl.config.schema import load_config
from vlmrl.data.items import record_hashes
from vlmrl.evaluate.stage import evaluate
from vlmrl.evaluate.swap import derangement, swap_images
from vlmrl.pipeline import prepare_with_budget
from vlmrl.report import build_report
from vlmrl.run.layout import read_holdout as load_holdout


def _items(counts: dict[str, int]) -> list[dict]:
    items = [{"id": f"{family}-{k}", "category": family} for family, n in counts.items() for k in range(n)]
    random.Random(0).shuffle(items)  # holdout order is not family order
    return items


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_derangement_has_no_fixed_point_and_stays_within_family(seed):
    items = _items({"bar_value": 9, "count_squares": 2, "circle_area": 5, "lonely_a": 1, "lonely_b": 1})
    family = {i["id"]: i["category"] for i in items}
    donors = derangement(items, seed)
    assert sorted(donors) == sorted(family)
    assert sorted(donors.values()) == sorted(family)  # a permutation: every image is shown exactly once
    assert all(item_id != donor for item_id, donor in donors.items())
    for item_id, donor in donors.items():
        if family[item_id].startswith("lonely"):  # alone in their families: swapped with each other
            assert family[donor].startswith("lonely") and family[donor] != family[item_id]
        else:
            assert family[donor] == family[item_id]
    assert derangement(items, seed) == donors  # the same seed gives the same swap
    grown = derangement(items + [{"id": "pie-0", "category": "pie"}, {"id": "pie-1", "category": "pie"}], seed)
    assert {k: v for k, v in grown.items() if not k.startswith("pie")} == donors  # another family changes no swap


def test_derangement_is_seeded_and_one_lonely_item_borrows():
    items = _items({"bar_value": 12})
    assert derangement(items, 0) != derangement(items, 1)
    one = _items({"bar_value": 3}) + [{"id": "x", "category": "alone"}]
    donors = derangement(one, 0)
    assert donors["x"] != "x" and all(k != v for k, v in donors.items())
    with pytest.raises(RuntimeError, match="at least 2 held-out items"):
        derangement([{"id": "a"}], 0)


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    config = load_config("demo", [
        "model.name=tiny:qwen3_vl", f"run.output_dir={tmp_path_factory.mktemp('visual')}", "data.num_synthetic=24",
        "data.holdout_size=8", "eval.max_new_tokens=4", "eval.do_sample=false", "eval.batch_size=8",
        "eval.visual_control=true"])
    prepare_with_budget(config, config.run_dir)
    evaluate(config, config.run_dir, "baseline")
    evaluate(config, config.run_dir, "baseline", swap_seed=config.run.seed)
    return config


def test_swapped_records_name_their_donor_and_show_its_image(evaluated):
    run_dir = evaluated.run_dir
    items = load_holdout(evaluated, run_dir)
    donors = derangement(items, evaluated.run.seed)
    true = {r["id"]: r for r in read_jsonl(run_dir / "baseline_records.jsonl")}
    swapped = read_jsonl(run_dir / "baseline_swapped_records.jsonl")
    assert [r["id"] for r in swapped] == [i["id"] for i in items]
    for record in swapped:
        donor = donors[record["id"]]
        assert record["image_from"] == donor != record["id"]
        assert record["category"] == true[donor]["category"]  # two families of four: always within family
        assert record_hashes(record) == record_hashes(true[donor]) != record_hashes(true[record["id"]])
        assert record["prompt_sha256"] == true[record["id"]]["prompt_sha256"]
        assert record["generation"]["image_swap_seed"] == evaluated.run.seed
    assert "image_from" not in next(iter(true.values()))
    assert (run_dir / "baseline_swapped_summary.json").exists()


def _flip(records: list[dict], ids: set[str]) -> list[dict]:
    return [{**r, "correct": (not r["correct"]) if r["id"] in ids else r["correct"]} for r in records]


def test_visual_gain_pairs_by_id_and_matches_a_hand_computed_interval(evaluated, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(evaluated.run_dir, run_dir)
    baseline = read_jsonl(run_dir / "baseline_records.jsonl")
    swapped = read_jsonl(run_dir / "baseline_swapped_records.jsonl")
    ids = [r["id"] for r in baseline]
    for name, records in (("baseline", baseline), ("baseline_swapped", swapped)):  # a known before: all wrong
        write_jsonl_atomic(run_dir / f"{name}_records.jsonl", [{**r, "correct": False} for r in records])
    after_true = _flip([{**r, "correct": False} for r in baseline], set(ids[:5]))  # 5 of 8 right on true images
    after_swapped = _flip([{**r, "correct": False} for r in swapped], {ids[0]})  # 1 of 8 right on swapped ones
    write_jsonl_atomic(run_dir / "after_records.jsonl", list(reversed(after_true)))  # pairing is by id, not line
    write_jsonl_atomic(run_dir / "after_swapped_records.jsonl", after_swapped[3:] + after_swapped[:3])
    control = compare_runs(run_dir, seed=3).comparison["visual_control"]
    overall = control["overall"]
    gap_after = [(1.0 if i in ids[:5] else 0.0) - (1.0 if i == ids[0] else 0.0) for i in ids]
    assert overall["n"] == control["n_paired"] == 8 and control["cross_family_swaps"] == 0
    assert overall["accuracy"] == {"before_true": 0.0, "before_swapped": 0.0, "after_true": 5 / 8, "after_swapped": 1 / 8}
    assert overall["visual_gain"] == pytest.approx(0.5)
    # the interval by hand: resample the 8 per-item gains (gap after - gap before, here gap after) 10,000 times
    draws = np.random.default_rng(3).integers(0, 8, size=(stats.BOOTSTRAP_SAMPLES, 8))
    means = np.asarray(gap_after)[draws].mean(axis=1)
    assert overall["visual_gain_ci95"] == pytest.approx(list(np.quantile(means, [0.025, 0.975])))
    families = control["by_family"]
    assert sum(b["n"] for b in families.values()) == 8
    assert sum(b["visual_gain"] * b["n"] for b in families.values()) == pytest.approx(0.5 * 8)
    assert "Visual control" in build_report(run_dir) and "+0.500" in build_report(run_dir)


def test_a_gain_that_only_comes_from_more_formatted_answers_vanishes_when_format_is_held_fixed(evaluated, tmp_path):
    """Before: items 0-3 unformatted (and wrong), 4-7 formatted and read right on the true image only. After: all
    formatted, all read right on the true image. The gap widens by 0.5, all of it from format."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(evaluated.run_dir, run_dir)
    ids = [r["id"] for r in read_jsonl(run_dir / "baseline_records.jsonl")]
    late = set(ids[4:])
    for name in ("baseline", "baseline_swapped", "after", "after_swapped"):
        records = read_jsonl(run_dir / f"{name.replace('after', 'baseline')}_records.jsonl")
        rows = []
        for r in records:
            formatted = name.startswith("after") or r["id"] in late
            rows.append({**r, "format_ok": formatted, "correct": formatted and "swapped" not in name})
        write_jsonl_atomic(run_dir / f"{name}_records.jsonl", rows)
    overall = compare_runs(run_dir, seed=3).comparison["visual_control"]["overall"]
    assert overall["visual_gain"] == pytest.approx(0.5)
    assert overall["format_compliance"] == {"before_true": 0.5, "after_true": 1.0, "before_swapped": 0.5,
                                            "after_swapped": 1.0}
    assert overall["all_formatted"] == {"n": 4, "visual_gain": 0.0, "visual_gain_ci95": [0.0, 0.0]}


def test_a_swapped_record_that_saw_its_own_image_is_refused(evaluated, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(evaluated.run_dir, run_dir)
    write_jsonl_atomic(run_dir / "after_records.jsonl", read_jsonl(run_dir / "baseline_records.jsonl"))
    swapped = read_jsonl(run_dir / "baseline_swapped_records.jsonl")
    write_jsonl_atomic(run_dir / "after_swapped_records.jsonl", [{**swapped[0], "image_from": swapped[0]["id"]},
                                                                 *swapped[1:]])
    with pytest.raises(CompareError, match="do not pair"):
        compare_runs(run_dir)


def test_swap_images_keeps_everything_but_the_image():
    items = [{"id": "a", "question": "qa", "images": ["a.png"], "image_sha256": ["ha"], "category": "c"},
             {"id": "b", "question": "qb", "images": ["b.png"], "image_sha256": ["hb"], "category": "c"}]
    out = swap_images(items, {"a": "b", "b": "a"})
    assert out[0] == {"id": "a", "question": "qa", "images": ["b.png"], "image_sha256": ["hb"], "category": "c",
                      "image_from": "b"}
    assert items[0]["images"] == ["a.png"]  # the originals are untouched


def test_demo_gpu_preset_says_in_one_line_that_it_needs_cuda(monkeypatch):
    import torch

    from vlmrl.preflight.needs import RequirementError, check_requirements

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = load_config("demo-gpu")
    assert config.eval.visual_control and config.data.holdout_size >= 384
    with pytest.raises(RequirementError, match="CUDA GPU and this machine has none") as caught:
        check_requirements(config)
    assert "\n" not in str(caught.value)
    check_requirements(load_config("demo-gpu", ["model.name=demo-policy-gpu-smoke"]))  # its CPU twin: nothing missing
