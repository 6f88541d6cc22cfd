"""Driver of benchmarks/gpu_visual_learning.sh: the GPU demo, its two controls, one result file.

Steps, each timed and printed as it ends (so a killed run still shows where the time went):
  1. build the demo-gpu policy (the supervised warm start; cached under VLMRL_CACHE);
  2. `vlmrl run demo-gpu` (prepare, baseline, GSPO, after, the swapped-image evaluations, compare, export,
     report), every output line echoed with the seconds since the start;
  3. the same run with the correctness reward's sign flipped (format weight 0), the reward control;
  4. OUTDIR/h200_visual_learning.json and .md from the two comparison.json files and the run folders.

VLMRL_VISUAL_SMOKE=1 swaps in the recipe's CPU twin (model.name=demo-policy-gpu-smoke) and toy sizes: the same
code, minutes on two cores. Left out: any threshold tuning; the file states the issue's criteria as booleans.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

SMOKE = [
    "model.name=demo-policy-gpu-smoke", "data.image_size=64", "data.num_synthetic=40", "data.holdout_size=24",
    "eval.batch_size=8", "train.max_steps=2",
    "train.per_device_train_batch_size=16", "train.save_steps=1",
]
CONTROL = ["run.name=demo-gpu-control", "rewards=[{name: format, weight: 0.0}, {name: correctness, weight: -1.0}]"]
STARTED = time.perf_counter()


def say(message: str) -> None:
    print(f"[{time.perf_counter() - STARTED:7.1f}s] {message}", flush=True)


def vlmrl_run(out: Path, overrides: list[str]) -> tuple[float, dict[str, float], int]:
    """`vlmrl run demo-gpu` with `overrides`; returns its seconds, the seconds of each stage it ran and its exit
    status. A run that fails after its comparison (the export's checks refuse an adapter that never moved, as a
    control whose groups all score alike can leave it) still counts; one that fails before it stops the script."""
    command = [sys.executable, "-m", "vlmrl.cli", "run", "demo-gpu", "--set", f"run.output_dir={out / 'runs'}"]
    for item in overrides:
        command += ["--set", item]
    say("$ " + " ".join(command))
    started, stages, current = time.perf_counter(), {}, None
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        for line in proc.stdout:
            line = line.rstrip()
            if line.startswith(("[run]", "[skip]")):
                now = time.perf_counter()
                if current:
                    stages[current[0]] = round(now - current[1], 1)
                current = (line.split("]", 1)[1].split(":")[0].strip(), now)
            say(line)
    if current:
        stages[current[0]] = round(time.perf_counter() - current[1], 1)
    if proc.returncode:
        say(f"vlmrl run exited {proc.returncode} after stage {current[0] if current else None!r}")
        if "compare" not in stages:
            raise SystemExit(proc.returncode)
    return round(time.perf_counter() - started, 1), stages, proc.returncode


def build_policy(name: str) -> dict:
    from vlmrl.models.demo import RECIPES, ensure_demo_policy

    started = time.perf_counter()
    folder = ensure_demo_policy(RECIPES[name], say=say)
    info = json.loads((folder / "demo_policy.json").read_text())
    losses = info.get("sft_losses") or []
    return {"name": name, "folder": str(folder), "seconds": round(time.perf_counter() - started, 1),
            "recipe": info.get("recipe"), "sft_seconds": info.get("sft_seconds"),
            "sft_loss_first_last": [losses[0], losses[-1]] if losses else None}


def criteria(main: dict, control: dict) -> dict:
    """The issue's "done when", read off the two comparisons (booleans; nothing is tuned to pass them)."""
    accuracy = main["metrics"]["accuracy"]
    visual = (main.get("visual_control") or {}).get("overall") or {}
    return {
        "accuracy_rises_ci_excludes_zero": accuracy["delta_ci95"][0] > 0,
        "visual_gain_ci_excludes_zero": bool(visual) and visual["visual_gain_ci95"][0] > 0,
        "control_accuracy_does_not_rise": control["metrics"]["accuracy"]["delta"] <= 0,
    }


def markdown(result: dict) -> str:
    main, control = result["comparison"], result["control_comparison"]
    lines = [f"# GPU visual-learning demo ({result['gpu'] or 'no GPU: smoke run'})", "",
             f"Command: `{result['command']}`", "", "| metric | before | after | delta | 95% CI |", "|---|---|---|---|---|"]
    for name in ("accuracy", "format_compliance", "total_reward"):
        m = main["metrics"][name]
        lines.append(f"| {name} | {m['before']:.3f} | {m['after']:.3f} | {m['delta']:+.3f} | "
                     f"[{m['delta_ci95'][0]:+.3f}, {m['delta_ci95'][1]:+.3f}] |")
    m = control["metrics"]["accuracy"]
    lines.append(f"| accuracy, sign-flipped control | {m['before']:.3f} | {m['after']:.3f} | {m['delta']:+.3f} | "
                 f"[{m['delta_ci95'][0]:+.3f}, {m['delta_ci95'][1]:+.3f}] |")
    visual = main.get("visual_control")
    if visual:
        lines += ["", "Visual control (accuracy on true / swapped images):", "",
                  "| family | n | before true | before swapped | after true | after swapped | visual gain | 95% CI |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, b in [("all", visual["overall"]), *sorted(visual["by_family"].items())]:
            a, (lo, hi) = b["accuracy"], b["visual_gain_ci95"]
            lines.append(f"| {name} | {b['n']} | {a['before_true']:.3f} | {a['before_swapped']:.3f} | "
                         f"{a['after_true']:.3f} | {a['after_swapped']:.3f} | {b['visual_gain']:+.3f} | [{lo:+.3f}, {hi:+.3f}] |")
    lines += ["", "Criteria: " + ", ".join(f"{k}: {v}" for k, v in result["criteria"].items()),
              "", "Timings (s): " + json.dumps(result["timings"]),
              "", "Exit status of the runs: " + json.dumps(result["exit_status"])]
    return "\n".join(lines) + "\n"


def main() -> int:
    out = Path(sys.argv[1]).resolve()
    extra = sys.argv[2:]
    smoke = os.environ.get("VLMRL_VISUAL_SMOKE", "") not in ("", "0")
    overrides = (SMOKE if smoke else []) + extra
    model = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("model.name=")), "demo-policy-gpu")
    say(f"visual-learning demo into {out} (smoke: {smoke}; cache {os.environ.get('VLMRL_CACHE')})")
    timings: dict = {}
    policy = build_policy(model)
    timings["policy_build"] = policy["seconds"]
    say(f"policy ready in {policy['seconds']} s (warm start {policy['sft_seconds']} s, loss {policy['sft_loss_first_last']})")
    timings["run"], timings["run_stages"], main_status = vlmrl_run(out, overrides)
    say(f"demo-gpu run: {timings['run']} s {timings['run_stages']}")
    timings["control"], timings["control_stages"], control_status = vlmrl_run(out, overrides + CONTROL)
    say(f"control run: {timings['control']} s {timings['control_stages']}")
    runs = out / "runs"
    main_dir = runs / next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("run.name=")), "demo-gpu")
    env = json.loads((main_dir / "env.json").read_text())
    cuda = env.get("cuda") or {}
    result = {
        "what": "vlmrl run demo-gpu and its sign-flipped reward control; comparison.json of each, with the visual control",
        "command": "bash benchmarks/gpu_visual_learning.sh " + " ".join([str(out), *extra]),
        "smoke": smoke,
        "overrides": overrides,
        "gpu": (cuda.get("devices") or [{}])[0].get("name"),
        "environment": {"python": env.get("python"), "platform": platform.platform(), "packages": env.get("packages"),
                        "cuda": cuda},
        "policy": policy,
        "timings": timings,
        "exit_status": {"run": main_status, "control": control_status},
        "comparison": json.loads((main_dir / "comparison.json").read_text()),
        "control_comparison": json.loads((runs / "demo-gpu-control" / "comparison.json").read_text()),
    }
    result["criteria"] = criteria(result["comparison"], result["control_comparison"])
    (out / "h200_visual_learning.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "h200_visual_learning.md").write_text(markdown(result))
    say(f"wrote {out / 'h200_visual_learning.json'} and .md; criteria {result['criteria']}")
    print(markdown(result))
    return main_status


if __name__ == "__main__":
    raise SystemExit(main())
