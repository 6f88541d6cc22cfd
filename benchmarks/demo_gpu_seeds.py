"""The GPU demo's claim on several seeds, each from scratch: `vlmrl run demo-gpu --set run.seed=K`, with a
cache folder of its own per seed so that every run builds its demo policy anew, as on a fresh machine.

    PYTHONPATH=src python benchmarks/demo_gpu_seeds.py OUTDIR [--seeds 0 1 2] [--parallel 3] [-- extra --set args]

Writes OUTDIR/h200_demo_gpu_seeds.json (one entry per run: seed, accuracy before/after with its interval and
McNemar p, the visual gain with its interval, the per-family table, the warm start's check curve and whether it
reached its criterion, wall times) and each run's log. Runs in parallel share the GPU and the host (the record
says how many ran at once): their wall times are an upper bound on a run alone, their numbers are not
affected. CPU smoke of the code path: `--smoke` (the `demo-policy-gpu-smoke` recipe, toy sizes).
"""

from __future__ import annotations

import argparse
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


def run_seed(seed: int, work: Path, out: Path, extra: list[str]) -> dict:
    cache, runs = work / f"cache-seed{seed}", work / "runs"
    command = [sys.executable, "-m", "vlmrl.cli", "run", "demo-gpu", "--set", f"run.seed={seed}",
               "--set", f"run.output_dir={runs}", "--set", f"run.name=demo-gpu-seed{seed}"]
    for item in extra:
        command += ["--set", item]
    env = {**os.environ, "VLMRL_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    with open(out / f"demo_gpu_seed{seed}.log", "w") as log:
        status = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    entry: dict = {"seed": seed, "exit_status": status, "wall_s": round(time.perf_counter() - started, 1),
                   "command": " ".join(["vlmrl", *command[3:]])}
    policy = next(cache.glob("demo-policy-*/demo_policy.json"), None)
    if policy is not None:
        info = json.loads(policy.read_text())
        entry["warm_start"] = {"reached_criterion": info.get("reached_criterion"), "kept_step": info.get("kept_step"),
                               "steps_run": info.get("sft_steps_run"), "seconds": info.get("sft_seconds"),
                               "criterion": info["recipe"].get("stop_accuracy"),
                               "checks": info.get("reading_checks", [])}
    comparison = runs / f"demo-gpu-seed{seed}" / "comparison.json"
    if comparison.exists():
        entry.update(summarize(json.loads(comparison.read_text())))
    return entry


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


def holds(entry: dict) -> bool:
    """The claim for one seed: accuracy's and the visual gain's intervals above zero, the warm start at its
    criterion."""
    return (entry.get("exit_status") == 0 and entry.get("accuracy", {}).get("ci", [0])[0] > 0
            and entry.get("visual_gain", {}).get("ci", [0])[0] > 0
            and entry.get("warm_start", {}).get("reached_criterion") is True)


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
    parser.add_argument("extra", nargs="*", help="section.field=value overrides for every run")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    extra = (SMOKE if args.smoke else []) + args.extra
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        entries = list(pool.map(lambda seed: run_seed(seed, args.work, args.out, extra), args.seeds))
    record = {
        "what": "vlmrl run demo-gpu on several seeds, each building its demo policy anew (a cache of its own)",
        "command": "PYTHONPATH=src python benchmarks/demo_gpu_seeds.py OUT " + " ".join(
            [f"--seeds {' '.join(map(str, args.seeds))}", f"--parallel {args.parallel}", *(["--smoke"] if args.smoke else []),
             *args.extra]),
        "runs_at_once": args.parallel, "shared_host": args.parallel > 1, "smoke": args.smoke,
        **environment(), "runs": entries,
        "holds_on_every_seed": all(holds(e) for e in entries),
    }
    name = "cpu_demo_gpu_seeds_smoke.json" if args.smoke else "h200_demo_gpu_seeds.json"
    (args.out / name).write_text(json.dumps(record, indent=2) + "\n")
    for e in entries:
        acc, vis, ws = e.get("accuracy", {}), e.get("visual_gain", {}), e.get("warm_start", {})
        print(f"seed {e['seed']}: exit {e['exit_status']}, {e['wall_s']} s; accuracy {acc.get('before')} -> "
              f"{acc.get('after')} ci {acc.get('ci')}; visual gain {vis.get('gain')} ci {vis.get('ci')}; warm start "
              f"reached {ws.get('reached_criterion')} at {ws.get('kept_step')}", flush=True)
    return 0 if all(e.get("exit_status") == 0 for e in entries) else 1


if __name__ == "__main__":
    sys.exit(main())
