"""Every JSON file vlmrl writes is strict JSON (issue 37): a NaN or an infinity is written as null. Before, a
reward that skipped every item left NaN in comparison.json, which strict parsers (JavaScript's JSON.parse, jq)
refuse, and a NaN loss did the same to metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

from vlmrl.common.io import append_jsonl, read_jsonl, write_json_atomic, write_jsonl_atomic
from vlmrl.compare.stage import compare_runs


def strict(text: str):
    """Parse as a strict parser does: NaN, Infinity and -Infinity are errors."""
    def refuse(token: str):
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_are_written_as_null(tmp_path):
    row = {"loss": float("nan"), "grad_norm": float("inf"), "nested": [1.5, {"x": float("-inf")}], "ok": 2.0}
    expected = {"loss": None, "grad_norm": None, "nested": [1.5, {"x": None}], "ok": 2.0}
    write_json_atomic(tmp_path / "a.json", row)
    write_jsonl_atomic(tmp_path / "b.jsonl", [row])
    append_jsonl(tmp_path / "c.jsonl", [row, {"step": 2}])
    assert strict((tmp_path / "a.json").read_text()) == expected
    assert [strict(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()] == [expected]
    assert read_jsonl(tmp_path / "c.jsonl") == [expected, {"step": 2}]
    assert all(strict(line) for line in (tmp_path / "c.jsonl").read_text().splitlines())


def record(item_id: str, skipped: float | None) -> dict:
    return {"id": item_id, "correct": False, "mathvista_correct": False, "format_ok": True, "format_reward": 2.0,
            "correctness_reward": 0.0, "total_reward": 0.6, "prompt_sha256": "p", "image_sha256": "i" + item_id,
            "category": "c", "rewards": {"format_reward": 2.0, "picky": skipped}}


def test_comparison_json_is_strict_when_a_reward_skipped_every_item(tmp_path: Path):
    write_jsonl_atomic(tmp_path / "baseline_records.jsonl", [record(f"i{k}", None) for k in range(4)])
    write_jsonl_atomic(tmp_path / "after_records.jsonl", [record(f"i{k}", None) for k in range(4)])
    comparison = compare_runs(tmp_path).comparison
    assert comparison["metrics"]["picky"]  # the reward is compared, with no number to show
    parsed = strict((tmp_path / "comparison.json").read_text())
    assert parsed["n_paired"] == 4
