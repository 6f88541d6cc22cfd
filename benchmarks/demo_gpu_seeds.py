"""The GPU demo's claim on several seeds, each from scratch: `vlmrl run demo-gpu --set run.seed=K`, with a
cache folder of its own per seed so that every run builds its demo policy anew, as on a fresh machine.

    PYTHONPATH=src python benchmarks/demo_gpu_seeds.py OUTDIR [--seeds 0 1 2] [--parallel 3] [-- extra --set args]

Writes OUTDIR/demo_gpu_seeds.json (one entry per run: seed, accuracy before/after with its interval and
McNemar p, the visual gain with its interval, the per-family table, the warm start's check curve and whether it
reached its criterion, wall times, the training's clock and steps, each held-out item's outcome) and each run's
log. `--budget-from RECORD` gives each seed `train.time_budget_minutes` equal to its training time in RECORD
and writes demo_gpu_seeds_budgeted.json: the dynamic-sampling comparison at equal cost is

    python benchmarks/demo_gpu_seeds.py OUT --seeds 0 1 2 --parallel 3 --work W
    mkdir -p W2; for s in 0 1 2; do ln -s "$(realpath W)/cache-seed$s" W2/; done  # the same policy builds
    python benchmarks/demo_gpu_seeds.py OUT2 --seeds 0 1 2 --parallel 3 --work W2 --budget-from
        OUT/demo_gpu_seeds.json train.dynamic_sampling.enabled=true
    python benchmarks/dynamic_sampling_pairs.py OUT/demo_gpu_seeds.json OUT2/demo_gpu_seeds_budgeted.json

(both with the same number of runs at once, so that the two share the machine alike). Runs in parallel share
the GPU and the host (the record says how many ran at once): their wall times are an upper bound on a run alone, their numbers are not
affected. CPU smoke of the code path: `--smoke` (the `demo-policy-gpu-smoke` recipe, toy sizes).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SMOKE = ["model.name=demo-policy-gpu-smoke", "data.image_size=64", "data.num_synthetic=48", "data.holdout_size=16",
         "train.max_steps=2", "train.per_device_train_batch_size=8", "train.num_generations=4", "eval.batch_size=16",
         "train.save_steps=1"]


def run_seed(seed: int, work: Path, out: Path, extra: list[str], budget: dict[int, float] | None = None) -> dict:
    cache, runs = work / f"cache-seed{seed}", work / "runs"
    command = [sys.executable, "-m", "vlmrl.cli", "run", "demo-gpu", "--set", f"run.seed={seed}",
               "--set", f"run.output_dir={runs}", "--set", f"run.name=demo-gpu-seed{seed}"]
    if budget is not None:
        extra = [*extra, f"train.time_budget_minutes={budget[seed] / 60!r}"]
    for item in extra:
        command += ["--set", item]
    env = {**os.environ, "VLMRL_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    with open(out / f"demo_gpu_seed{seed}.log", "w") as log:
        status = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    return {"seed": seed, "exit_status": status, "wall_s": round(time.perf_counter() - started, 1),
            "command": " ".join(["vlmrl", *command[3:]]), **read_seed(seed, work)}


def finished(seed: int, work: Path, out: Path) -> bool:
    log = out / f"demo_gpu_seed{seed}.log"
    return ((work / "runs" / f"demo-gpu-seed{seed}" / "report.html").exists()
            or (log.exists() and log.read_text().rstrip().endswith("report.html")))


def largest_drop(checks: list[dict]) -> float:
    """How far a check fell below the best one before it (0 for a curve that never falls)."""
    best, drop = 0.0, 0.0
    for check in checks:
        drop = max(drop, best - check["greedy_accuracy"])
        best = max(best, check["greedy_accuracy"])
    return round(drop, 4)


def read_seed(seed: int, work: Path) -> dict:
    """What one seed's run left in `work`: its policy's warm start and its comparison."""
    cache, runs = work / f"cache-seed{seed}", work / "runs"
    entry: dict = {}
    policy = next(cache.glob("demo-policy-*/demo_policy.json"), None)
    if policy is not None:
        info = json.loads(policy.read_text())
        entry["warm_start"] = {"reached_criterion": info.get("reached_criterion"), "kept_step": info.get("kept_step"),
                               "steps_run": info.get("sft_steps_run"), "seconds": info.get("sft_seconds"),
                               "criterion": info["recipe"].get("stop_accuracy"),
                               "largest_drop": largest_drop(info.get("reading_checks", [])),
                               "collapsed": collapsed(info.get("reading_checks", [])),
                               "checks": info.get("reading_checks", [])}
    run = runs / f"demo-gpu-seed{seed}"
    comparison = run / "comparison.json"
    if comparison.exists():
        entry.update(summarize(json.loads(comparison.read_text())))
    entry.update(training(run))
    return entry


def training(run: Path) -> dict:
    """The RL stage's cost and the held-out outcomes item by item (for paired comparisons between records): the
    training's own clock (`elapsed_s` of its last step, what `train.time_budget_minutes` counts), its steps, why
    it stopped, the dynamic-sampling totals, and per item (sorted by id) 1/0 for correct after training, with the
    true image and with the swapped one."""
    out: dict = {}
    summary = run / "train" / "summary.json"
    if summary.exists():
        info = json.loads(summary.read_text())
        steps = [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines()
                 if line.strip() and "train_runtime" not in line]
        out["train"] = {"steps": info.get("steps"), "elapsed_s": steps[-1].get("elapsed_s") if steps else None,
                        "rollout_tokens": steps[-1].get("rollout_tokens") if steps else None,
                        "stopped_by": info.get("stopped_by"), "dynamic_sampling": info.get("dynamic_sampling")}
    for name, key in (("after_records.jsonl", "after_correct"), ("after_swapped_records.jsonl", "after_swapped_correct")):
        if (run / name).exists():
            rows = sorted((json.loads(line) for line in (run / name).read_text().splitlines() if line.strip()),
                          key=lambda r: r["id"])
            out[key] = "".join("1" if r.get("correct") else "0" for r in rows)
            out["item_ids_sha256"] = hashlib.sha256("\n".join(r["id"] for r in rows).encode()).hexdigest()
    return out


def summarize(comparison: dict) -> dict:
    accuracy = comparison["metrics"]["accuracy"]
    result = {"accuracy": {"before": accuracy["before"], "after": accuracy["after"], "delta": accuracy["delta"],
                           "ci": accuracy["delta_ci95"], "mcnemar_p": accuracy.get("mcnemar_p")},
              "n_heldout": comparison["n_paired"]}
    control = comparison.get("visual_control")
    if control:
        overall = control["overall"]
        result["visual_gain"] = {"gain": overall["visual_gain"], "ci": overall["visual_gain_ci95"]}
        result["by_family"] = {name: {"n": block["n"], **block["accuracy"], "visual_gain": block["visual_gain"],
                                      "visual_gain_ci": block["visual_gain_ci95"]}
                               for name, block in control["by_family"].items()}
    return result


def collapsed(checks: list[dict]) -> bool:
    """A check below half the best one before it: the warm start lost what it had learned (e.g. fell to 0)."""
    best = 0.0
    for check in checks:
        if check["greedy_accuracy"] < best / 2:
            return True
        best = max(best, check["greedy_accuracy"])
    return False


def holds(entry: dict) -> bool:
    """The claim for one seed: accuracy's and the visual gain's intervals above zero, the warm start at its
    criterion without a collapse on the way."""
    warm = entry.get("warm_start", {})
    return (entry.get("exit_status") == 0 and entry.get("accuracy", {}).get("ci", [0])[0] > 0
            and entry.get("visual_gain", {}).get("ci", [0])[0] > 0
            and warm.get("reached_criterion") is True and warm.get("collapsed") is False)


def environment() -> dict:
    import torch

    from vlmrl.common.provenance import git_commit, package_version

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    # a copy of the tree without .git (a GPU machine's) names its commit through VLMRL_RECORD_COMMIT
    return {"git_commit": os.environ.get("VLMRL_RECORD_COMMIT") or git_commit(), "python": platform.python_version(), "gpu": gpu,
            "versions": {name: package_version(name) for name in ("torch", "transformers", "trl", "peft", "accelerate")}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--work", type=Path, default=Path("/tmp/vlmrl-demo-gpu-seeds"))
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--collect", action="store_true",
                        help="run nothing: the record from the run folders and caches already in --work and the "
                             "logs in OUT (a run whose report.html exists, or whose log ends listing it, finished)")
    parser.add_argument("--budget-from", type=Path,
                        help="an earlier record of these seeds: each run gets train.time_budget_minutes = that "
                             "seed's training time there (its train.elapsed_s), to compare settings at equal cost")
    parser.add_argument("extra", nargs="*", help="section.field=value overrides for every run")
    args = parser.parse_intermixed_args()
    args.out.mkdir(parents=True, exist_ok=True)
    extra = (SMOKE if args.smoke else []) + args.extra
    budget = None
    if args.budget_from:
        earlier = {e["seed"]: e.get("train", {}).get("elapsed_s") for e in json.loads(args.budget_from.read_text())["runs"]}
        budget = {seed: float(earlier[seed]) for seed in args.seeds}  # a seed the record lacks: KeyError, on purpose
    if args.collect:
        entries = [{"seed": seed, "collected": True, "exit_status": 0 if finished(seed, args.work, args.out) else None,
                    **read_seed(seed, args.work)} for seed in args.seeds]
    else:
        with ThreadPoolExecutor(max_workers=args.parallel) as pool:
            entries = list(pool.map(lambda seed: run_seed(seed, args.work, args.out, extra, budget), args.seeds))
    record = {
        "what": "vlmrl run demo-gpu on several seeds, each building its demo policy anew (a cache of its own)",
        "command": "PYTHONPATH=src python benchmarks/demo_gpu_seeds.py OUT " + " ".join(
            [f"--seeds {' '.join(map(str, args.seeds))}", f"--parallel {args.parallel}", *(["--smoke"] if args.smoke else []),
             *([f"--budget-from {args.budget_from.name}"] if args.budget_from else []), *args.extra]),
        "budget_s": budget,
        "runs_at_once": args.parallel, "shared_host": args.parallel > 1, "smoke": args.smoke,
        **environment(), "runs": entries,
        "holds": {str(e["seed"]): holds(e) for e in entries},
        "holds_on_every_seed": all(holds(e) for e in entries),
    }
    name = "cpu_demo_gpu_seeds_smoke.json" if args.smoke else "demo_gpu_seeds.json"
    name = name.replace(".json", "_budgeted.json") if budget else name
    (args.out / name).write_text(json.dumps(record, indent=2) + "\n")
    for e in entries:
        acc, vis, ws = e.get("accuracy", {}), e.get("visual_gain", {}), e.get("warm_start", {})
        print(f"seed {e['seed']}: exit {e['exit_status']}, {e.get('wall_s')} s; accuracy {acc.get('before')} -> "
              f"{acc.get('after')} ci {acc.get('ci')}; visual gain {vis.get('gain')} ci {vis.get('ci')}; warm start "
              f"reached {ws.get('reached_criterion')} at {ws.get('kept_step')}", flush=True)
    return 0 if all(e.get("exit_status") == 0 for e in entries) else 1


if __name__ == "__main__":
    sys.exit(main())
