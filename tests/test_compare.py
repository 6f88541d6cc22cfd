"""Before/after comparison from records: flips, McNemar, intervals, refusal of mismatched pairs."""

from __future__ import annotations

import math

import pytest

from vlmrl.common.io import write_jsonl_atomic
from vlmrl.compare.stage import CompareError, compare_runs


def _record(item_id: str, correct: bool, format_ok: bool, *, prompt: str = "p", category: str = "c") -> dict:
    return {
        "id": item_id, "correct": correct, "mathvista_correct": correct, "format_ok": format_ok,
        "format_reward": 2.0 if format_ok else 0.0, "correctness_reward": 2.0 if correct else 0.0,
        "total_reward": (0.6 if format_ok else 0.0) + (2.0 if correct else 0.0),
        "prompt_sha256": prompt, "image_sha256": "img" + item_id, "category": category,
    }


def _write(run_dir, before, after):
    write_jsonl_atomic(run_dir / "baseline_records.jsonl", before)
    write_jsonl_atomic(run_dir / "after_records.jsonl", after)


def test_flips_and_mcnemar(tmp_path):
    # 10 items: 6 wrong->right, 1 right->wrong, 3 unchanged right; format: 2 broken->ok
    before = [_record(f"i{k}", correct=k >= 6, format_ok=k >= 2) for k in range(10)]
    after = [_record(f"i{k}", correct=k != 6, format_ok=True) for k in range(10)]
    _write(tmp_path, before, after)
    c = compare_runs(tmp_path).comparison
    acc = c["metrics"]["accuracy"]
    assert (acc["before"], acc["after"], acc["gained"], acc["lost"]) == (0.4, 0.9, 6, 1)
    assert math.isclose(acc["delta"], 0.5)
    assert math.isclose(acc["mcnemar_p"], 2 * (1 + 7) / 2**7)  # b=6, c=1
    assert c["flip_counts"] == {"wrong_to_right": 6, "right_to_wrong": 1, "format_broken_to_ok": 2,
                                "format_ok_to_broken": 0}
    assert c["flips"]["right_to_wrong"] == ["i6"]
    assert [r["id"] for r in c["largest_regressions"]] == ["i6"]
    lo, hi = acc["delta_ci95"]
    assert lo <= 0.5 <= hi
    assert (tmp_path / "comparison.json").exists()


def test_mismatched_prompt_hash_is_refused(tmp_path):
    _write(tmp_path, [_record("a", True, True)], [_record("a", True, True, prompt="other")])
    with pytest.raises(CompareError, match="differs between baseline and after"):
        compare_runs(tmp_path)


def test_image_hashes_compare_as_lists_old_records_included(tmp_path):
    old = _record("a", True, True)  # image_sha256 "imga": one string, as records were before image lists
    _write(tmp_path, [old], [{**old, "image_sha256": ["imga"]}])
    assert compare_runs(tmp_path).comparison["n_paired"] == 1  # before: refused as a different image
    _write(tmp_path, [{**old, "image_sha256": ["imga", "imgb"]}], [{**old, "image_sha256": ["imga", "imgc"]}])
    with pytest.raises(CompareError, match="differs between baseline and after"):  # the second image differs
        compare_runs(tmp_path)


def test_missing_records_is_a_clear_error(tmp_path):
    with pytest.raises(CompareError, match="no records"):
        compare_runs(tmp_path)


def test_by_category(tmp_path):
    before = [_record("a", False, True, category="bar"), _record("b", True, True, category="pie")]
    after = [_record("a", True, True, category="bar"), _record("b", True, True, category="pie")]
    _write(tmp_path, before, after)
    cats = compare_runs(tmp_path).comparison["by_category"]
    assert cats["bar"]["accuracy_before"] == 0.0 and cats["bar"]["accuracy_after"] == 1.0


def test_a_missing_run_folder_is_named_as_such(tmp_path):
    """Before: the error blamed missing records, of a folder that does not exist."""
    from vlmrl.compare.stage import CompareError, compare_runs

    with pytest.raises(CompareError, match=r"no such run folder"):
        compare_runs(tmp_path / "nope")
