"""Stage 7b, before/after comparison: paired statistics on the held-out records.

Records are joined by id; a pair whose prompt or image hash differs is refused (the two evaluations did not
see the same item). For each binary metric: before, after, delta, a 95% paired bootstrap interval and the
exact McNemar p-value on the discordant pairs; for rewards, the same without McNemar: the total, and each
configured reward (built-in or the user's) under its function's name, from the records' `rewards`; and, when
the swapped-image records exist, the visual control (`vlmrl.compare.visual_gain`). Everything is computed
from the two records files, so `comparison.json` can always be regenerated and checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vlmrl.common import stats
from vlmrl.common.io import read_jsonl, write_json_atomic
from vlmrl.compare import visual_gain
from vlmrl.data.items import record_hashes
from vlmrl.run import layout

BINARY_METRICS = {"accuracy": "correct", "mathvista_accuracy": "mathvista_correct", "format_compliance": "format_ok"}
REWARD_METRICS = {"total_reward": "total_reward", "format_reward": "format_reward", "correctness_reward": "correctness_reward"}


class CompareError(RuntimeError):
    pass


@dataclass(frozen=True)
class CompareResult:
    path: Path
    comparison: dict


def compare_runs(run_dir: Path, *, seed: int = 0, top_regressions: int = 10) -> CompareResult:
    """Write `run_dir/comparison.json` from `baseline_records.jsonl` and `after_records.jsonl`."""
    if not Path(run_dir).is_dir():
        raise CompareError(f"{run_dir}: no such run folder (give the folder `vlmrl run` wrote, e.g. runs/demo).")
    before = _load(run_dir / layout.records_file("baseline"))
    after = _load(run_dir / layout.records_file("after"))
    ids = [i for i in before if i in after]
    missing = sorted(set(before) ^ set(after))
    if not ids:
        raise CompareError(f"{run_dir}: baseline and after records share no id; evaluate both stages first.")
    for item_id in ids:
        b, a = before[item_id], after[item_id]
        if (b.get("prompt_sha256"), record_hashes(b)) != (a.get("prompt_sha256"), record_hashes(a)):
            raise CompareError(f"{run_dir}: item {item_id} differs between baseline and after (prompt or image hash).")
    pairs = [(before[i], after[i]) for i in ids]
    metrics = {}
    for name, field in BINARY_METRICS.items():
        metrics[name] = _binary(pairs, field, seed)
    for name, field in REWARD_METRICS.items():
        metrics[name] = _continuous(pairs, field, seed)
    for name in dict.fromkeys(n for b, _ in pairs for n in b.get("rewards") or {}):
        metrics.setdefault(name, _per_reward(pairs, name, seed))  # every configured reward, a user's too, under its name
    flips = {
        "wrong_to_right": [b["id"] for b, a in pairs if not b["correct"] and a["correct"]],
        "right_to_wrong": [b["id"] for b, a in pairs if b["correct"] and not a["correct"]],
        "format_broken_to_ok": [b["id"] for b, a in pairs if not b["format_ok"] and a["format_ok"]],
        "format_ok_to_broken": [b["id"] for b, a in pairs if b["format_ok"] and not a["format_ok"]],
    }
    regressions = sorted(pairs, key=lambda p: p[1]["total_reward"] - p[0]["total_reward"])
    comparison = {
        "n_paired": len(pairs),
        "ids_missing_a_pair": missing,
        "metrics": metrics,
        "flip_counts": {k: len(v) for k, v in flips.items()},
        "flips": flips,
        "largest_regressions": [
            {"id": b["id"], "before": b["total_reward"], "after": a["total_reward"],
             "delta": a["total_reward"] - b["total_reward"]}
            for b, a in regressions[:top_regressions]
            if a["total_reward"] < b["total_reward"]
        ],
        "by_category": _by_category(pairs),
    }
    try:  # present once the swapped-image evaluations exist (`vlmrl compare --visual-control`)
        control = visual_gain.compute(run_dir, seed)
    except visual_gain.VisualGainError as exc:
        raise CompareError(str(exc)) from None
    if control is not None:
        comparison["visual_control"] = control
    path = run_dir / layout.COMPARISON
    write_json_atomic(path, comparison)
    return CompareResult(path, comparison)


def _load(path: Path) -> dict[str, dict]:
    records = read_jsonl(path)
    if not records:
        raise CompareError(f"{path}: no records; run `vlmrl eval --stage {path.name.split('_')[0]}` first.")
    return {r["id"]: r for r in records}


def _binary(pairs: list[tuple[dict, dict]], field: str, seed: int) -> dict:
    b = [float(bool(x[field])) for x, _ in pairs]
    a = [float(bool(y[field])) for _, y in pairs]
    gained = sum(1 for x, y in zip(b, a) if x == 0 and y == 1)
    lost = sum(1 for x, y in zip(b, a) if x == 1 and y == 0)
    result = _continuous_from(b, a, seed)
    result.update(gained=gained, lost=lost, mcnemar_p=stats.mcnemar_exact(gained, lost))
    return result


def _continuous(pairs: list[tuple[dict, dict]], field: str, seed: int) -> dict:
    return _continuous_from([float(x[field]) for x, _ in pairs], [float(y[field]) for _, y in pairs], seed)


def _per_reward(pairs: list[tuple[dict, dict]], name: str, seed: int) -> dict:
    """One reward's before/after over the pairs it scored on both sides (None = it skipped the item)."""
    kept = [(b["rewards"][name], a["rewards"][name]) for b, a in pairs
            if (b.get("rewards") or {}).get(name) is not None and (a.get("rewards") or {}).get(name) is not None]
    result = _continuous_from([float(x) for x, _ in kept], [float(y) for _, y in kept], seed)
    result["n"] = len(kept)
    return result


def _continuous_from(before: list[float], after: list[float], seed: int) -> dict:
    lo, hi = stats.paired_bootstrap_ci(before, after, seed=seed)
    mb, ma = stats.mean(before), stats.mean(after)
    return {"before": mb, "after": ma, "delta": ma - mb, "delta_ci95": [lo, hi]}


def _by_category(pairs: list[tuple[dict, dict]]) -> dict:
    groups: dict[str, list[tuple[dict, dict]]] = {}
    for b, a in pairs:
        groups.setdefault(str(b.get("category") or "unknown"), []).append((b, a))
    return {
        name: {
            "n": len(group),
            "accuracy_before": stats.mean([float(b["correct"]) for b, _ in group]),
            "accuracy_after": stats.mean([float(a["correct"]) for _, a in group]),
            "format_before": stats.mean([float(b["format_ok"]) for b, _ in group]),
            "format_after": stats.mean([float(a["format_ok"]) for _, a in group]),
        }
        for name, group in sorted(groups.items())
    }
