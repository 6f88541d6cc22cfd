"""The visual gain: the after-training true-minus-swapped accuracy gap minus the before-training one.

Per item, the gap is accuracy on its true image minus on the swapped one (the records of
`vlmrl.evaluate.visual_control`); the visual gain is the after-training gap minus the before-training gap, with
a 95% paired bootstrap interval (`vlmrl.common.stats`), overall and per family, in
`comparison.json["visual_control"]`.

Public: `compute(run_dir, seed)`, `VisualGainError`.
"""

from __future__ import annotations

from pathlib import Path

from vlmrl.common import stats
from vlmrl.common.io import read_jsonl
from vlmrl.data.items import record_hashes
from vlmrl.run.layout import SWAPPED

FORMAT = "_format"  # a row's key for the record's format_ok
COLUMNS = ("baseline", "after", "baseline" + SWAPPED, "after" + SWAPPED)


class VisualGainError(RuntimeError):
    """The gain cannot be computed from these records; the message names the file and the fix."""


def compute(run_dir: Path, seed: int = 0) -> dict | None:
    """The control from the four records files; None when the swapped evaluations have not run."""
    paths = {name: Path(run_dir) / f"{name}_records.jsonl" for name in COLUMNS}
    if not (paths["baseline" + SWAPPED].exists() and paths["after" + SWAPPED].exists()):
        return None
    sets = {name: {r["id"]: r for r in read_jsonl(path)} for name, path in paths.items()}
    ids = [i for i in sets["baseline"] if all(i in s for s in sets.values())]
    if not ids:
        raise VisualGainError(f"{run_dir}: the true- and swapped-image records share no id; evaluate them first.")
    for item_id in ids:
        _check_pairing(run_dir, item_id, sets)
    rows = [{name: float(bool(sets[name][i]["correct"])) for name in sets}
            | {f"{name}{FORMAT}": float(bool(sets[name][i].get("format_ok"))) for name in sets}
            | {"category": sets["baseline"][i].get("category")} for i in ids]
    by_family: dict[str, list[dict]] = {}
    for row in rows:
        by_family.setdefault(str(row["category"] or "unknown"), []).append(row)
    cross = sum(1 for i in ids if sets["baseline" + SWAPPED][i].get("category") !=
                sets["baseline"].get(sets["baseline" + SWAPPED][i]["image_from"], {}).get("category"))
    return {
        "n_paired": len(ids),
        "ids_missing": sorted(set().union(*sets.values()) - set(ids)),
        "seed": seed,
        "swap": "a fixed derangement within each family (seeded single cycle); no item sees its own image",
        "cross_family_swaps": cross,
        "overall": _block(rows, seed),
        "by_family": {name: _block(group, seed) for name, group in sorted(by_family.items())},
    }


def _check_pairing(run_dir: Path, item_id: str, sets: dict[str, dict[str, dict]]) -> None:
    swapped = sets["baseline" + SWAPPED][item_id]
    donors = {sets[name][item_id].get("image_from") for name in ("baseline" + SWAPPED, "after" + SWAPPED)}
    prompts = {sets[name][item_id].get("prompt_sha256") for name in sets}
    donor = swapped.get("image_from")
    if len(donors) != 1 or donor in (None, item_id) or len(prompts) != 1:
        raise VisualGainError(
            f"{run_dir}: item {item_id}: the swapped records do not pair with the true ones (donor {sorted(map(str, donors))}, "
            "prompt hashes differ, or the item saw its own image); delete the *_swapped_records.jsonl files and evaluate again.")
    donor_record = sets["baseline"].get(donor)
    if donor_record is not None and record_hashes(donor_record) != record_hashes(swapped):
        raise VisualGainError(f"{run_dir}: item {item_id} saw an image that is not item {donor}'s.")


def _block(rows: list[dict], seed: int) -> dict:
    """Accuracies of one group and its visual gain: mean((after true - after swapped) - (before true - before swapped)).

    A policy that answers in the structure more often after training widens the true-minus-swapped gap even if
    it reads no better (more of its readings become gradable), so the block also gives each column's format
    compliance and the same gain over the items whose four answers were all in the structure."""
    col = {name: [r[name] for r in rows] for name in COLUMNS}
    gap_before, gap_after = _gaps(rows)
    gain = stats.mean(gap_after) - stats.mean(gap_before)
    formatted = [r for r in rows if all(r[name + FORMAT] for name in COLUMNS)]
    return {
        "n": len(rows),
        "accuracy": {"before_true": stats.mean(col["baseline"]), "before_swapped": stats.mean(col["baseline" + SWAPPED]),
                     "after_true": stats.mean(col["after"]), "after_swapped": stats.mean(col["after" + SWAPPED])},
        "format_compliance": {key: stats.mean([r[name + FORMAT] for r in rows]) for key, name in
                              zip(("before_true", "after_true", "before_swapped", "after_swapped"), COLUMNS)},
        "gap_before": stats.mean(gap_before),
        "gap_after": stats.mean(gap_after),
        "visual_gain": gain,
        "visual_gain_ci95": list(stats.paired_bootstrap_ci(gap_before, gap_after, seed=seed)),
        "true_delta_ci95": list(stats.paired_bootstrap_ci(col["baseline"], col["after"], seed=seed)),
        "swapped_delta_ci95": list(stats.paired_bootstrap_ci(col["baseline" + SWAPPED], col["after" + SWAPPED], seed=seed)),
        "all_formatted": _formatted_gain(formatted, seed),
    }


def _formatted_gain(rows: list[dict], seed: int) -> dict:
    """The visual gain over the items answered in the structure in all four evaluations (format held fixed)."""
    if len(rows) < 2:
        return {"n": len(rows), "visual_gain": None, "visual_gain_ci95": None}
    before, after = _gaps(rows)
    return {"n": len(rows), "visual_gain": stats.mean(after) - stats.mean(before),
            "visual_gain_ci95": list(stats.paired_bootstrap_ci(before, after, seed=seed))}


def _gaps(rows: list[dict]) -> tuple[list[float], list[float]]:
    """Per item, correct on the true image minus on the swapped one: before training, and after."""
    return ([r["baseline"] - r["baseline" + SWAPPED] for r in rows], [r["after"] - r["after" + SWAPPED] for r in rows])


