"""The visual control: how much of a before/after gain needs the image?

Accuracy can rise without any better reading of the figure (a better answer prior, answers in a gradable
form). So the held-out set is also evaluated with each item's image(s) swapped for another held-out item's,
before training (base policy) and after (the adapter), by the same records code as stage 5/7 (`evaluate`
with `swap_seed`): `baseline_swapped_records.jsonl`, `after_swapped_records.jsonl`, each record naming the
item whose image it saw (`image_from`). Per item, the gap is accuracy on its true image minus on the swapped
one; the visual gain is the after-training gap minus the before-training gap, with a 95% paired bootstrap
interval (`vlmrl.stats`), overall and per family, in `comparison.json["visual_control"]`.

The swap is a fixed derangement: within each family (record `category`) of >= 2 items, a seeded random
single cycle (Sattolo's algorithm), so no item keeps its own image and the question still matches the kind of
figure; the items of single-item families are deranged among themselves (cross-family, counted). The same seed
and held-out set give the same swap on every machine. Left out: several swaps per item (one derangement is
already paired per item; more would only tighten the swapped side), and any judgement of *why* a gap moves.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from html import escape
from pathlib import Path

from vlmrl import stats
from vlmrl.data.items import record_hashes
from vlmrl.io import read_jsonl

SWAPPED = "_swapped"  # records/summary names: baseline_swapped_records.jsonl, after_swapped_summary.json
FORMAT = "_format"  # a row's key for the record's format_ok
COLUMNS = ("baseline", "after", "baseline" + SWAPPED, "after" + SWAPPED)
IMAGE_FIELDS = ("images", "image", "image_sha256")


class VisualControlError(RuntimeError):
    """The control cannot be computed from these records; the message names the file and the fix."""


def derangement(items: list[dict], seed: int) -> dict[str, str]:
    """Item id -> the id of the item whose image it is shown: no item keeps its own, within family where it can.

    >>> items = [{"id": f"a{k}", "category": "a"} for k in range(3)] + [{"id": "b0", "category": "b"}]
    >>> d = derangement(items, 0)
    >>> sorted(d) == ["a0", "a1", "a2", "b0"], all(k != v for k, v in d.items()), d == derangement(items, 0)
    (True, True, True)
    >>> sorted(d[k] for k in ("a0", "a1", "a2")), d["b0"][0]  # a family's images stay in it; a lone item borrows
    (['a0', 'a1', 'a2'], 'a')
    """
    if len(items) < 2:
        raise VisualControlError("the visual control needs at least 2 held-out items to swap images between.")
    groups: dict[str, list[str]] = {}
    for item in items:
        groups.setdefault(str(item.get("category") or "unknown"), []).append(item["id"])
    donors: dict[str, str] = {}
    lonely: list[str] = []
    for name in sorted(groups):
        ids = groups[name]
        if len(ids) < 2:
            lonely += ids
            continue
        donors.update(_cycle(ids, random.Random(f"{seed}:{name}")))
    if len(lonely) >= 2:
        donors.update(_cycle(lonely, random.Random(f"{seed}:cross-family")))
    elif lonely:  # one item alone in its family and no other alone: it borrows the first other item's image
        only = lonely[0]
        donors[only] = next(item["id"] for item in items if item["id"] != only)
    return donors


def _cycle(ids: list[str], rng: random.Random) -> dict[str, str]:
    """A uniformly random single cycle over `ids` (Sattolo): every id maps to another one.

    >>> c = _cycle(["x", "y", "z"], random.Random(1)); sorted(c.values()), any(k == v for k, v in c.items())
    (['x', 'y', 'z'], False)
    """
    order = list(ids)
    for i in range(len(order) - 1, 0, -1):
        j = rng.randrange(i)  # j < i, never i itself: this is what makes one cycle, hence no fixed point
        order[i], order[j] = order[j], order[i]
    return {ids[k]: order[k] for k in range(len(ids))}


def swap_images(items: list[dict], donors: dict[str, str]) -> list[dict]:
    """Copies of `items` whose image fields are their donor's, each naming its donor in `image_from`."""
    by_id = {item["id"]: item for item in items}
    out = []
    for item in items:
        donor = by_id[donors[item["id"]]]
        swapped = {k: v for k, v in item.items() if k not in IMAGE_FIELDS}
        swapped.update({k: donor[k] for k in IMAGE_FIELDS if k in donor}, image_from=donor["id"])
        out.append(swapped)
    return out


def evaluate_swapped(config, run_dir: Path, progress_factory: Callable[[str], object] | None = None) -> None:
    """Evaluate both stages on swapped images (a stage whose summary is complete is skipped)."""
    from vlmrl.evaluate import evaluate
    from vlmrl.pipeline import eval_done

    for stage in ("baseline", "after"):
        if not eval_done(config, run_dir, stage + SWAPPED):
            progress = progress_factory(stage + SWAPPED) if progress_factory else None
            evaluate(config, run_dir, stage, swap_seed=config.run.seed, progress=progress)


def compute(run_dir: Path, seed: int = 0) -> dict | None:
    """The control from the four records files; None when the swapped evaluations have not run."""
    paths = {name: Path(run_dir) / f"{name}_records.jsonl" for name in COLUMNS}
    if not (paths["baseline" + SWAPPED].exists() and paths["after" + SWAPPED].exists()):
        return None
    sets = {name: {r["id"]: r for r in read_jsonl(path)} for name, path in paths.items()}
    ids = [i for i in sets["baseline"] if all(i in s for s in sets.values())]
    if not ids:
        raise VisualControlError(f"{run_dir}: the true- and swapped-image records share no id; evaluate them first.")
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
        raise VisualControlError(
            f"{run_dir}: item {item_id}: the swapped records do not pair with the true ones (donor {sorted(map(str, donors))}, "
            "prompt hashes differ, or the item saw its own image); delete the *_swapped_records.jsonl files and evaluate again.")
    donor_record = sets["baseline"].get(donor)
    if donor_record is not None and record_hashes(donor_record) != record_hashes(swapped):
        raise VisualControlError(f"{run_dir}: item {item_id} saw an image that is not item {donor}'s.")


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


def report_html(control: dict | None) -> str:
    """The report's section: one row per family and one overall."""
    if not isinstance(control, dict) or not isinstance(control.get("overall"), dict):
        return ('<p class="missing">No visual control in comparison.json: run <code>vlmrl compare RUN_DIR '
                "--visual-control</code> (or set eval.visual_control: true).</p>")
    rows = [_row("all", control["overall"])] + [_row(name, b) for name, b in sorted(control["by_family"].items())]
    head = "".join(f"<th>{h}</th>" for h in ("family", "n", "before true", "before swapped", "after true",
                                              "after swapped", "visual gain", "95% CI"))
    return (f'<p class="src">From comparison.json "visual_control": each held-out item also evaluated with another '
            f"item's image (same family; {control.get('cross_family_swaps', 0)} cross-family). Visual gain = "
            "(after true − after swapped) − (before true − before swapped) accuracy, paired per item.</p>"
            f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>")


def _row(name: str, block: dict) -> str:
    acc = block["accuracy"]
    lo, hi = block["visual_gain_ci95"]
    cells = [f"{acc[k]:.3f}" for k in ("before_true", "before_swapped", "after_true", "after_swapped")]
    return (f"<tr><th>{escape(name)}</th><td>{block['n']}</td>" + "".join(f"<td>{c}</td>" for c in cells)
            + f"<td>{block['visual_gain']:+.3f}</td><td>[{lo:+.3f}, {hi:+.3f}]</td></tr>")
