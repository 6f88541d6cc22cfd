"""Dynamic sampling against plain GSPO on the GPU demo at equal cost, from two `demo_gpu_seeds.py` records of the
same seeds: OFF (the demo as shipped) and ON (`train.dynamic_sampling.enabled=true`, each seed given OFF's training
time as `train.time_budget_minutes` through `--budget-from`).

    python benchmarks/dynamic_sampling_pairs.py OFF.json ON.json [--out benchmarks/results/demo_gpu_dynamic_sampling.json]

Per seed and pooled over seeds, on the same held-out items (checked by the hash of their ids): held-out accuracy
after training and the visual gain (accuracy with the true image minus with a swapped one) for each arm with 95%
intervals, and the paired difference ON - OFF item by item with its bootstrap interval (accuracy also with exact
McNemar p). Each arm's training time, steps, rollout tokens and dynamic-sampling totals ride along. Stdlib + numpy
+ vlmrl.common.stats.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vlmrl.common.stats import bootstrap_ci, mcnemar_exact, paired_bootstrap_ci


def bits(text: str) -> list[int]:
    return [int(c) for c in text]


def arm(entry: dict) -> dict:
    """One run's outcomes: accuracy and visual gain after training with intervals, and its cost."""
    true, swapped = bits(entry["after_correct"]), bits(entry["after_swapped_correct"])
    gain = [t - s for t, s in zip(true, swapped)]
    return {"accuracy_after": sum(true) / len(true), "accuracy_after_ci": list(bootstrap_ci(true)),
            "accuracy_delta_from_before": entry["accuracy"]["delta"], "accuracy_before": entry["accuracy"]["before"],
            "visual_gain_after": sum(gain) / len(gain), "visual_gain_after_ci": list(bootstrap_ci(gain)),
            "train": entry.get("train")}


def paired(off: list[int], on: list[int], off_swapped: list[int], on_swapped: list[int]) -> dict:
    """ON - OFF, item by item: accuracy (bootstrap interval, exact McNemar) and the visual gain."""
    gain_off = [t - s for t, s in zip(off, off_swapped)]
    gain_on = [t - s for t, s in zip(on, on_swapped)]
    better = sum(1 for a, b in zip(off, on) if b and not a)
    worse = sum(1 for a, b in zip(off, on) if a and not b)
    n = len(off)
    return {"n": n, "accuracy_diff": (sum(on) - sum(off)) / n, "accuracy_diff_ci": list(paired_bootstrap_ci(off, on)),
            "items_only_on_right": better, "items_only_off_right": worse, "mcnemar_p": mcnemar_exact(better, worse),
            "visual_gain_diff": (sum(gain_on) - sum(gain_off)) / n,
            "visual_gain_diff_ci": list(paired_bootstrap_ci(gain_off, gain_on))}


def compare(off_record: dict, on_record: dict) -> dict:
    off_runs = {e["seed"]: e for e in off_record["runs"]}
    on_runs = {e["seed"]: e for e in on_record["runs"]}
    seeds = sorted(set(off_runs) & set(on_runs))
    per_seed, pooled = [], {"off": [], "on": [], "off_swapped": [], "on_swapped": []}
    for seed in seeds:
        off, on = off_runs[seed], on_runs[seed]
        if off.get("item_ids_sha256") != on.get("item_ids_sha256"):
            raise SystemExit(f"seed {seed}: the two records' held-out items differ (item_ids_sha256)")
        columns = (bits(off["after_correct"]), bits(on["after_correct"]),
                   bits(off["after_swapped_correct"]), bits(on["after_swapped_correct"]))
        for key, column in zip(pooled, columns):
            pooled[key] += column
        per_seed.append({"seed": seed, "off": arm(off), "on": arm(on), "on_minus_off": paired(*columns),
                         # both arms trained the one policy build (ON's cache pointed at OFF's): the same checks
                         "same_policy": off.get("warm_start") == on.get("warm_start")})
    return {"seeds": seeds, "per_seed": per_seed,
            "pooled_on_minus_off": paired(pooled["off"], pooled["on"], pooled["off_swapped"], pooled["on_swapped"])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("off", type=Path)
    parser.add_argument("on", type=Path)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/demo_gpu_dynamic_sampling.json"))
    args = parser.parse_args()
    off_record, on_record = json.loads(args.off.read_text()), json.loads(args.on.read_text())
    result = {
        "what": "vlmrl run demo-gpu with train.dynamic_sampling on against off, each seed's ON run given its OFF run's "
                "training time as train.time_budget_minutes (equal wall-clock cost), on the same held-out items",
        "command": f"python benchmarks/dynamic_sampling_pairs.py {args.off.name} {args.on.name}",
        "off_command": off_record["command"], "on_command": on_record["command"],
        "runs_at_once": off_record["runs_at_once"], "shared_host": True,
        **{key: on_record[key] for key in ("git_commit", "python", "gpu", "versions")},
        "off_git_commit": off_record["git_commit"],
        **compare(off_record, on_record),
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for row in result["per_seed"]:
        d = row["on_minus_off"]
        print(f"seed {row['seed']}: accuracy off {row['off']['accuracy_after']:.3f} on {row['on']['accuracy_after']:.3f}"
              f" diff {d['accuracy_diff']:+.3f} {d['accuracy_diff_ci']} p {d['mcnemar_p']:.3g}; visual gain diff "
              f"{d['visual_gain_diff']:+.3f} {d['visual_gain_diff_ci']}")
    d = result["pooled_on_minus_off"]
    print(f"pooled: accuracy diff {d['accuracy_diff']:+.3f} {d['accuracy_diff_ci']} p {d['mcnemar_p']:.3g}; visual gain "
          f"diff {d['visual_gain_diff']:+.3f} {d['visual_gain_diff_ci']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
