"""Driver of benchmarks/gpu_visual_learning.sh: the GPU demo, its two controls, one result file.

Steps, each timed and printed as it ends (so a killed run still shows where the time went):
  1. build the demo-gpu policy (the supervised warm start; cached under VLMRL_CACHE);
  2. `vlmrl run demo-gpu` (prepare, baseline, GSPO, after, the swapped-image evaluations, compare, export,
     report), every output line echoed with the seconds since the start; then OUTDIR/h200_visual_learning.json
     and .md from its comparison.json (the control marked as not run yet), so a call that runs out of time
     still leaves the main result;
  3. the same run with the correctness reward's sign flipped (format weight 0), the reward control, after the
     main run (side by side in the first H200 run, each step took 4-6x longer);
  4. the main run's adapter evaluated once more with the other decoding (greedy <-> sampled at the run's
     temperature), in a copy of its folder: the same items, images and weights, only the decoding differs
     (about a minute on an H200; VLMRL_VISUAL_OTHER_DECODING=0 skips it, and a failed main run skips it);
  5. the result files again, with all comparisons, and both runs' report.html. The run folders themselves and
     the policy cache stay under VLMRL_VISUAL_WORK (default /tmp/vlmrl-visual; VLMRL_CACHE defaults to its
     cache/ folder).

VLMRL_VISUAL_SMOKE=1 swaps in the recipe's CPU twin (model.name=demo-policy-gpu-smoke) and toy sizes: the same
code, minutes on two cores. Left out: any threshold tuning; the file states the issue's criteria as booleans.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import threading
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


class Run:
    """One `vlmrl run demo-gpu` subprocess, its output echoed line by line (prefixed with `label`) by a thread,
    and the seconds of each stage it ran, read off its `[run]` lines."""

    def __init__(self, label: str, runs: Path, overrides: list[str]) -> None:
        command = [sys.executable, "-m", "vlmrl.cli", "run", "demo-gpu", "--set", f"run.output_dir={runs}"]
        for item in overrides:
            command += ["--set", item]
        say(f"{label}: $ " + " ".join(command))
        self.label, self.stages, self.current, self.ended = label, {}, None, 0.0
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            line = line.rstrip()
            if line.startswith(("[run]", "[skip]")):
                self._close_stage()
                self.current = (line.split("]", 1)[1].split(":")[0].strip(), time.perf_counter())
            say(f"{self.label}| {line}")
        self._close_stage()  # its output ended: the process is exiting
        self.ended = time.perf_counter()

    def _close_stage(self) -> None:
        if self.current:
            self.stages[self.current[0]] = round(time.perf_counter() - self.current[1], 1)

    def wait(self) -> tuple[float, dict[str, float], int]:
        """Its seconds, each stage's seconds and its exit status. A run that fails after its comparison (the
        export's checks refuse an adapter that never moved, as a control whose groups all score alike can leave
        it) still counts; one that fails before it stops the script."""
        status = self.proc.wait()
        self.reader.join()
        seconds = round(self.ended - self.started, 1)
        say(f"{self.label}: {seconds} s, exit {status}, stages {self.stages}")
        if status and "compare" not in self.stages:
            raise SystemExit(status)
        return seconds, self.stages, status


def build_policy(name: str) -> dict:
    from vlmrl.models.demo import RECIPES, ensure_demo_policy

    started = time.perf_counter()
    # model.name=FOLDER: a policy already built (benchmarks/warm_start_check.py --keep FOLDER, a recipe variant)
    folder = Path(name) if name not in RECIPES else ensure_demo_policy(RECIPES[name], say=say)
    if not (folder / "demo_policy.json").is_file():
        raise SystemExit(f"model.name={name}: neither a demo recipe ({', '.join(RECIPES)}) nor a built policy folder")
    info = json.loads((folder / "demo_policy.json").read_text())
    losses = info.get("sft_losses") or []
    return {"name": name, "folder": str(folder), "seconds": round(time.perf_counter() - started, 1),
            "recipe": info.get("recipe"), "sft_seconds": info.get("sft_seconds"),
            "sft_steps_run": info.get("sft_steps_run"), "reading_checks": info.get("reading_checks"),
            "sft_loss_first_last": [losses[0], losses[-1]] if losses else None}


def criteria(main: dict, control: dict | None) -> dict:
    """The issue's "done when", read off the two comparisons (booleans, None for a control not run; nothing is
    tuned to pass them)."""
    accuracy = main["metrics"]["accuracy"]
    visual = (main.get("visual_control") or {}).get("overall") or {}
    return {
        "accuracy_rises_ci_excludes_zero": accuracy["delta_ci95"][0] > 0,
        "visual_gain_ci_excludes_zero": bool(visual) and visual["visual_gain_ci95"][0] > 0,
        "control_accuracy_does_not_rise": None if control is None else control["metrics"]["accuracy"]["delta"] <= 0,
    }


def markdown(result: dict) -> str:
    lines = [f"# GPU visual-learning demo ({result['gpu'] or 'no GPU: smoke run'})", "",
             f"Command: `{result['command']}` (commit {result.get('git_commit')})", ""]
    if result.get("evaluation"):
        lines += [f"Held-out set evaluated {_decoding_text(result['evaluation'])}.", ""]
    lines += _tables(result["comparison"], result["control_comparison"])
    lines += ["", "Criteria: " + ", ".join(f"{k}: {v}" for k, v in result["criteria"].items())]
    other = result.get("other_decoding")
    if other:
        lines += ["", f"## The same adapter, evaluated {_decoding_text(other)}", ""]
        lines += _tables(other["comparison"], None)
        lines += ["", "Criteria: " + ", ".join(f"{k}: {v}" for k, v in other["criteria"].items())]
    lines += ["", "Timings (s): " + json.dumps(result["timings"]),
              "", "Exit status of the runs: " + json.dumps(result["exit_status"])]
    return "\n".join(lines) + "\n"


def _decoding_text(decoding: dict) -> str:
    """How a held-out set was decoded, from `_decoding`'s fields."""
    if decoding["do_sample"]:
        return f"by sampling at temperature {decoding['temperature']}, one draw per item"
    return "greedily"


def _tables(main: dict, control: dict | None) -> list[str]:
    """The metrics table (with the control's accuracy when given) and the visual control per family."""
    lines = ["| metric | before | after | delta | 95% CI |", "|---|---|---|---|---|"]
    for name in ("accuracy", "format_compliance", "total_reward"):
        m = main["metrics"][name]
        lines.append(f"| {name} | {m['before']:.3f} | {m['after']:.3f} | {m['delta']:+.3f} | "
                     f"[{m['delta_ci95'][0]:+.3f}, {m['delta_ci95'][1]:+.3f}] |")
    if control is not None:
        m = control["metrics"]["accuracy"]
        lines.append(f"| accuracy, sign-flipped control | {m['before']:.3f} | {m['after']:.3f} | {m['delta']:+.3f} | "
                     f"[{m['delta_ci95'][0]:+.3f}, {m['delta_ci95'][1]:+.3f}] |")
    visual = main.get("visual_control")
    if visual:
        lines += ["", "Visual control (accuracy on true / swapped images):", "",
                  ("| family | n | before true | before swapped | after true | after swapped | visual gain | 95% CI "
                   "| format true before/after | gain, items formatted in all four (n) | 95% CI |"),
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, b in [("all", visual["overall"]), *sorted(visual["by_family"].items())]:
            a, (lo, hi) = b["accuracy"], b["visual_gain_ci95"]
            f, held = b.get("format_compliance") or {}, b.get("all_formatted") or {}
            fixed = (f"{held['visual_gain']:+.3f} ({held['n']}) | [{held['visual_gain_ci95'][0]:+.3f}, "
                     f"{held['visual_gain_ci95'][1]:+.3f}]") if held.get("visual_gain") is not None else "- | -"
            lines.append(f"| {name} | {b['n']} | {a['before_true']:.3f} | {a['before_swapped']:.3f} | "
                         f"{a['after_true']:.3f} | {a['after_swapped']:.3f} | {b['visual_gain']:+.3f} | [{lo:+.3f}, {hi:+.3f}] "
                         f"| {f.get('before_true', float('nan')):.3f} / {f.get('after_true', float('nan')):.3f} | {fixed} |")
    return lines


def main() -> int:
    out = Path(sys.argv[1]).resolve()
    # The run folders (adapters with their base copied in, images) and the policy cache stay out of OUTDIR, so
    # what comes back from the GPU machine is small: the result files, the log and the two reports.
    runs = Path(os.environ.get("VLMRL_VISUAL_WORK", "/tmp/vlmrl-visual")).resolve() / "runs"
    extra = sys.argv[2:]
    smoke = os.environ.get("VLMRL_VISUAL_SMOKE", "") not in ("", "0")
    overrides = (SMOKE if smoke else []) + extra
    model = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("model.name=")), "demo-policy-gpu")
    say(f"visual-learning demo into {out} (runs in {runs}; smoke: {smoke}; cache {os.environ.get('VLMRL_CACHE')})")
    timings: dict = {}
    policy = build_policy(model)
    timings["policy_build"] = policy["seconds"]
    say(f"policy ready in {policy['seconds']} s (warm start {policy['sft_seconds']} s, {policy['sft_steps_run']} steps, "
        f"loss {policy['sft_loss_first_last']}, reading checks {policy['reading_checks']})")
    main_dir = runs / next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("run.name=")), "demo-gpu")
    control_dir = runs / "demo-gpu-control"
    status = {}
    timings["run"], timings["run_stages"], status["run"] = Run("demo-gpu", runs, overrides).wait()
    write_result(out, extra, overrides, smoke, policy, timings, status, main_dir, None)
    timings["control"], timings["control_stages"], status["control"] = Run("control", runs, overrides + CONTROL).wait()
    write_result(out, extra, overrides, smoke, policy, timings, status, main_dir, control_dir)
    other = None
    if status["run"] == 0 and os.environ.get("VLMRL_VISUAL_OTHER_DECODING", "1") != "0":
        started = time.perf_counter()
        other = other_decoding(main_dir)
        timings["other_decoding"] = round(time.perf_counter() - started, 1)
    timings["total"] = round(time.perf_counter() - STARTED, 1)
    result = write_result(out, extra, overrides, smoke, policy, timings, status, main_dir, control_dir, other)
    print(markdown(result))
    return status["run"]


def other_decoding(main_dir: Path) -> Path:
    """A copy of the main run's folder whose held-out set (true and swapped images, before and after) is evaluated
    again with `eval.do_sample` flipped: greedy shows the policy's most likely answer, sampling at the rollout
    temperature the distribution GSPO trained. Same items, images, adapter; only the decoding differs."""
    from vlmrl.config.schema import dump_config, load_config

    copy = main_dir.with_name(main_dir.name + "-other-decoding")
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(main_dir, copy, ignore=shutil.ignore_patterns("checkpoint-*"))
    config = load_config(str(copy / "config.yaml"))
    config.eval.do_sample = not config.eval.do_sample
    config.run.name, config.run.output_dir = copy.name, str(copy.parent)
    (copy / "config.yaml").write_text(dump_config(config))
    for path in [*copy.glob("baseline*"), *copy.glob("after*"), copy / "comparison.json"]:
        path.unlink(missing_ok=True)
    say(f"other decoding (do_sample={config.eval.do_sample}) of the main run's adapter, in {copy}")
    cli = [sys.executable, "-m", "vlmrl.cli"]
    for command in ([*cli, "eval", str(copy), "--run-dir", str(copy), "--stage", "baseline"],
                    [*cli, "eval", str(copy), "--run-dir", str(copy), "--stage", "after"],
                    [*cli, "compare", str(copy), "--visual-control"]):
        done = subprocess.run(command, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        say(f"other decoding| $ {' '.join(command[3:])}: exit {done.returncode}; " + done.stdout[-2000:].strip())
        if done.returncode:
            raise SystemExit(done.returncode)
    return copy


def _decoding(run_dir: Path) -> dict:
    from vlmrl.config.schema import load_config

    decoding = load_config(str(run_dir / "config.yaml")).eval
    return {"do_sample": decoding.do_sample, "temperature": decoding.temperature}


def _commit() -> str | None:
    """The checkout's commit, with "+changes" when the tree differs from it; None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if dirty else "")


def write_result(out: Path, extra: list[str], overrides: list[str], smoke: bool, policy: dict, timings: dict,
                 status: dict, main_dir: Path, control_dir: Path | None, other_dir: Path | None = None) -> dict:
    """OUTDIR/h200_visual_learning.json and .md (and the runs' report.html) from the run folders as they are."""
    env = json.loads((main_dir / "env.json").read_text())
    cuda = env.get("cuda") or {}
    result = {
        "what": "vlmrl run demo-gpu and its sign-flipped reward control; comparison.json of each, with the visual control",
        "command": "bash benchmarks/gpu_visual_learning.sh " + " ".join([str(out), *extra]),
        "smoke": smoke,
        "overrides": overrides,
        "evaluation": _decoding(main_dir),  # which decoding the criteria above were read under
        "git_commit": _commit(),
        "gpu": (cuda.get("devices") or [{}])[0].get("name"),
        "environment": {"python": env.get("python"), "platform": platform.platform(), "packages": env.get("packages"),
                        "cuda": cuda},
        "policy": policy,
        "timings": timings,
        "exit_status": status,
        "comparison": json.loads((main_dir / "comparison.json").read_text()),
        "control_comparison": json.loads((control_dir / "comparison.json").read_text()) if control_dir else None,
    }
    result["criteria"] = criteria(result["comparison"], result["control_comparison"])
    if other_dir:  # the same adapter under the other decoding: reported beside, never in place of, the run's own
        other = json.loads((other_dir / "comparison.json").read_text())
        # no control criterion: the control run was evaluated with the main run's decoding, not this one
        result["other_decoding"] = {**_decoding(other_dir), "comparison": other, "criteria": criteria(other, None)}
    (out / "h200_visual_learning.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "h200_visual_learning.md").write_text(markdown(result))
    for name, folder in (("report.html", main_dir), ("control_report.html", control_dir)):
        if folder and (folder / "report.html").exists():
            shutil.copyfile(folder / "report.html", out / name)
    say(f"wrote {out / 'h200_visual_learning.json'} and .md; criteria {result['criteria']}")
    return result


if __name__ == "__main__":
    raise SystemExit(main())
