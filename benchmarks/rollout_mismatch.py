"""Issue 40's GPU evidence: does correcting the rollout/loss-pass mismatch cost learning, and how large is it?

    python benchmarks/rollout_mismatch.py OUTDIR [--bench-bf16 FILE] [--bench-4bit FILE] [--only tis|none|--record-only]
                                          [section.field=value ...]
    python benchmarks/rollout_mismatch.py cost [--preset demo] [--repeats 3]

OUTDIR mode, from the repository root on one CUDA GPU:
  1. the demo-gpu policy, built once (cached under VLMRL_CACHE, default VLMRL_MISMATCH_WORK/cache);
  2. `vlmrl run demo-gpu` with train.rollout_correction=tis (run.name demo-gpu-tis), then with none
     (demo-gpu-none): the same seed, data, policy and held-out set; the run folders stay under
     VLMRL_MISMATCH_WORK (default /tmp/vlmrl-mismatch). `vlmrl run` skips what a run already finished, so calling
     the script again after a device time-out continues where it stopped (`--only` runs one of the two);
  3. OUTDIR/h200_rollout_mismatch.json and .md, rewritten after each run: per run the held-out accuracy (before,
     after, delta, 95% CI) and the visual gain (95% CI) from its comparison.json, its `rollout_correction` record
     (train/summary.json) and the per-step mismatch (train/metrics.jsonl); tis minus none paired per held-out
     item (after-training accuracy, and the true-minus-swapped gap, 95% paired bootstrap); and, for each bench
     record given (`vlmrl bench`'s bench.json, e.g. from gpu_record_bf16.sh / gpu_record_4bit.sh), every
     path's per-step mismatch (`raw[*].rollout_mismatch`).
`--record-only` starts nothing and writes the record from what there is (a missing run shows as not run).
VLMRL_MISMATCH_SMOKE=1 runs the same code on the CPU with demo-gpu's CPU twin and toy sizes (minutes).

`cost`: what measuring costs, on the preset's policy (demo: the CPU demo): ms per `generate` call with and
without the sampler's recorder (same seed, same tokens; compiled decoding on CUDA), and the per-micro-batch
statistics and TIS factor at the preset's generation batch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/visual_learning.py: Run, build_policy

SMOKE = [
    "model.name=demo-policy-gpu-smoke", "data.image_size=64", "data.num_synthetic=40", "data.holdout_size=24",
    "eval.batch_size=8", "train.max_steps=2", "train.per_device_train_batch_size=16", "train.save_steps=1",
]
CORRECTIONS = ("tis", "none")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="OUTDIR for the results, or `cost`")
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides for both runs")
    parser.add_argument("--bench-bf16", type=Path, help="a bf16 bench.json (benchmarks/gpu_record_bf16.sh)")
    parser.add_argument("--bench-4bit", type=Path, help="a 4-bit bench.json (benchmarks/gpu_record_4bit.sh)")
    parser.add_argument("--only", choices=CORRECTIONS, help="run one of the two (the other's folder is read if there)")
    parser.add_argument("--record-only", action="store_true",
                        help="start nothing: write the record from the run folders and bench files there are")
    parser.add_argument("--preset", default="demo", help="cost: the preset whose policy and batch are measured")
    parser.add_argument("--repeats", type=int, default=3, help="cost: alternating measurements of each")
    return parser.parse_intermixed_args(argv)  # overrides may follow the options


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.out == "cost":
        print(json.dumps(cost(args.preset, args.repeats), indent=1))
        return 0
    from visual_learning import Run, build_policy, say

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("VLMRL_MISMATCH_WORK", "/tmp/vlmrl-mismatch")).resolve()
    os.environ.setdefault("VLMRL_CACHE", str(work / "cache"))
    smoke = os.environ.get("VLMRL_MISMATCH_SMOKE", "") not in ("", "0")
    overrides = (SMOKE if smoke else []) + list(args.overrides)
    if args.record_only:
        print(markdown(write_result(out, args, overrides, smoke, work / "runs", {})))
        return 0
    model = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("model.name=")), "demo-policy-gpu")
    policy = build_policy(model)
    say(f"policy ready ({policy['seconds']} s); runs in {work / 'runs'}")
    status: dict[str, int] = {}
    for correction in CORRECTIONS:
        if args.only and correction != args.only:
            continue
        run = Run(f"demo-gpu-{correction}", work / "runs",
                  [*overrides, f"run.name=demo-gpu-{correction}", f"train.rollout_correction={correction}"])
        status[correction] = run.wait()[2]
        write_result(out, args, overrides, smoke, work / "runs", status)
    result = write_result(out, args, overrides, smoke, work / "runs", status)
    print(markdown(result))
    return max(status.values(), default=0)


def run_block(run_dir: Path) -> dict | None:
    """One run's numbers, or None when it has no comparison yet."""
    from vlmrl.engine.rollout.mismatch import step_rows

    comparison_path = run_dir / "comparison.json"
    if not comparison_path.is_file():
        return None
    comparison = json.loads(comparison_path.read_text())
    accuracy = comparison["metrics"]["accuracy"]
    visual = (comparison.get("visual_control") or {}).get("overall") or {}
    summary_path = run_dir / "train" / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    metrics = run_dir / "train" / "metrics.jsonl"
    rows = step_rows([json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]) \
        if metrics.is_file() else []
    return {
        "run_dir": str(run_dir),
        "accuracy": {k: accuracy.get(k) for k in ("before", "after", "delta", "delta_ci95")},
        "visual_gain": visual.get("visual_gain"), "visual_gain_ci95": visual.get("visual_gain_ci95"),
        "rollout_correction": summary.get("rollout_correction"),
        "fast_generation": (summary.get("fast_generation") or {}).get("enabled"),
        "train_seconds": summary.get("train_seconds"),
        "mismatch_summary": summarize_steps(rows),
        "mismatch_per_step": rows,
    }


def summarize_steps(rows: list[dict]) -> dict:
    """Median over steps of each column, and the largest per-token |Δ log p| of any step."""
    from vlmrl.engine.rollout.mismatch import COLUMNS, LOGP_DIFF_MAX

    out: dict = {"steps": len(rows)}
    for key in COLUMNS:
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        out[f"{key} median"] = statistics.median(values) if values else None
    largest = [r[LOGP_DIFF_MAX] for r in rows if isinstance(r.get(LOGP_DIFF_MAX), (int, float))]
    out[f"{LOGP_DIFF_MAX} largest"] = max(largest) if largest else None
    return out


def paired_difference(tis_dir: Path, none_dir: Path, seed: int = 0) -> dict:
    """tis minus none per held-out item: after-training accuracy, and the after-training true-minus-swapped gap
    (the visual gain's after half; both runs share the baseline), each with a 95% paired bootstrap interval."""
    from vlmrl.common import stats

    def correct(run_dir: Path, name: str) -> dict[str, float]:
        path = run_dir / f"{name}_records.jsonl"
        if not path.is_file():
            return {}
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return {r["id"]: float(bool(r["correct"])) for r in rows}

    out = {}
    for label, names in (("after_accuracy", ("after",)), ("after_visual_gap", ("after", "after_swapped"))):
        runs = [[correct(d, n) for n in names] for d in (tis_dir, none_dir)]
        ids = sorted(set.intersection(*(set(c) for run in runs for c in run))) if all(all(r) for r in runs) else []
        if not ids:
            out[label] = None
            continue
        value = [[run[0][i] - (run[1][i] if len(run) > 1 else 0.0) for i in ids] for run in runs]
        out[label] = {"n": len(ids), "tis_minus_none": stats.mean(value[0]) - stats.mean(value[1]),
                      "ci95": list(stats.paired_bootstrap_ci(value[1], value[0], seed=seed))}
    baselines = [correct(d, "baseline") for d in (tis_dir, none_dir)]
    out["same_baseline"] = bool(baselines[0]) and baselines[0] == baselines[1]
    return out


def bench_mismatch(path: Path | None) -> dict | None:
    """Every path's per-step mismatch in one bench.json, with its median and largest figures."""
    if path is None:
        return None
    if not path.is_file():
        return {"error": f"{path}: no such file"}
    summary = json.loads(path.read_text())
    paths = {r["path"]: r.get("rollout_mismatch") for r in summary.get("raw") or []}
    return {"file": str(path), "device": summary.get("device"), "settings": summary.get("settings"),
            "paths": {name: {"summary": summarize_steps(rows or []), "per_step": rows} for name, rows in paths.items()}}


def criteria(runs: dict, difference: dict | None) -> dict:
    """The issue's question, read off the numbers (booleans; None where a run is missing)."""
    out: dict = {}
    for name, block in runs.items():
        out[f"{name}_accuracy_ci_above_zero"] = None if not block else block["accuracy"]["delta_ci95"][0] > 0
        out[f"{name}_visual_gain_ci_above_zero"] = (None if not block or not block["visual_gain_ci95"]
                                                    else block["visual_gain_ci95"][0] > 0)
    accuracy = (difference or {}).get("after_accuracy")
    out["tis_costs_no_accuracy"] = None if not accuracy else accuracy["ci95"][1] >= 0  # no interval below zero
    return out


def write_result(out: Path, args: argparse.Namespace, overrides: list[str], smoke: bool, runs_dir: Path,
                 status: dict) -> dict:
    from visual_learning import _commit, say

    runs = {c: run_block(runs_dir / f"demo-gpu-{c}") for c in CORRECTIONS}
    difference = (paired_difference(runs_dir / "demo-gpu-tis", runs_dir / "demo-gpu-none")
                  if all(runs.values()) else None)
    env_path = next((runs_dir / f"demo-gpu-{c}" / "env.json" for c in CORRECTIONS
                     if (runs_dir / f"demo-gpu-{c}" / "env.json").is_file()), None)
    env = json.loads(env_path.read_text()) if env_path else {}
    bench = {"bf16": bench_mismatch(args.bench_bf16), "4bit": bench_mismatch(args.bench_4bit)}
    result = {
        "what": "vlmrl run demo-gpu with train.rollout_correction=tis beside none (same seed), and the bench records' "
                "per-step rollout/loss-pass mismatch (issue 40)",
        "command": "python benchmarks/rollout_mismatch.py " + " ".join(sys.argv[1:]),
        "smoke": smoke, "overrides": overrides, "git_commit": _commit(), "exit_status": status,
        "gpu": ((env.get("cuda") or {}).get("devices") or [{}])[0].get("name")
               or next((b.get("device") for b in bench.values() if b and b.get("device")), None),
        "environment": {"python": env.get("python"), "platform": platform.platform(),
                        "packages": env.get("packages")},
        "runs": runs,
        "tis_minus_none": difference,
        "bench": bench,
    }
    result["criteria"] = criteria(runs, difference)
    (out / "h200_rollout_mismatch.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "h200_rollout_mismatch.md").write_text(markdown(result))
    say(f"wrote {out / 'h200_rollout_mismatch.json'}; criteria {result['criteria']}")
    return result


def markdown(result: dict) -> str:
    from vlmrl.engine.rollout.mismatch import LOGP_DIFF_MAX, LOGP_DIFF_MEAN, OUTSIDE_CAP, SEQUENCE_KL

    def num(x: object, fmt: str = "+.3f") -> str:
        return "-" if not isinstance(x, (int, float)) else format(x, fmt)

    def ci(pair: object) -> str:
        return "-" if not pair else f"[{pair[0]:+.3f}, {pair[1]:+.3f}]"

    lines = [f"# Rollout correction on demo-gpu ({result['gpu'] or 'no GPU: smoke run'})", "",
             f"Command: `{result['command']}` (commit {result['git_commit']})", "",
             ("| correction | accuracy before | after | delta | 95% CI | visual gain | 95% CI | mean abs dlogp "
              "(median step) | largest abs dlogp | KL per completion (median) | outside cap (median) |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, block in result["runs"].items():
        if not block:
            lines.append(f"| {name} | not run | | | | | | | | | |")
            continue
        a, m = block["accuracy"], block["mismatch_summary"]
        lines.append(f"| {name} | {num(a['before'], '.3f')} | {num(a['after'], '.3f')} | {num(a['delta'])} | "
                     f"{ci(a['delta_ci95'])} | {num(block['visual_gain'])} | {ci(block['visual_gain_ci95'])} | "
                     f"{num(m[f'{LOGP_DIFF_MEAN} median'], '.4f')} | {num(m[f'{LOGP_DIFF_MAX} largest'], '.4f')} | "
                     f"{num(m[f'{SEQUENCE_KL} median'], '.4f')} | {num(m[f'{OUTSIDE_CAP} median'], '.4f')} |")
    for label, block in (result.get("tis_minus_none") or {}).items():
        if isinstance(block, dict):
            lines.append(f"\ntis minus none, {label.replace('_', ' ')} (paired, n={block['n']}): "
                         f"{block['tis_minus_none']:+.3f} {ci(block['ci95'])}")
    for precision, bench in result["bench"].items():
        for path, block in ((bench or {}).get("paths") or {}).items():
            s = block["summary"]
            lines.append(f"\nbench {precision}, path {path}: {s['steps']} steps, mean abs dlogp (median step) "
                         f"{num(s[f'{LOGP_DIFF_MEAN} median'], '.4f')}, largest {num(s[f'{LOGP_DIFF_MAX} largest'], '.4f')}")
    lines += ["", "Criteria: " + ", ".join(f"{k}: {v}" for k, v in result["criteria"].items())]
    return "\n".join(lines) + "\n"


def cost(preset: str, repeats: int) -> dict:
    """ms per generate call with and without the recorder, and the per-micro-batch statistics, on `preset`."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlmrl.config.schema import load_config
    from vlmrl.data.synthetic import generate_items
    from vlmrl.engine.rollout.generation import generate_batch
    from vlmrl.engine.rollout.mismatch import micro_batch_stats, tis_factor
    from vlmrl.engine.rollout.sampling import SamplerLogprobs, _with_processor
    from vlmrl.models.demo import RECIPES, ensure_demo_policy

    config = load_config(preset)
    t = config.train
    folder = ensure_demo_policy(RECIPES[config.model.name])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    processor = AutoProcessor.from_pretrained(str(folder))
    processor.tokenizer.padding_side = "left"
    prompts = t.per_device_train_batch_size // t.num_generations
    items = list(generate_items(prompts, seed=0, size=config.data.image_size,
                                families=config.data.families))
    questions = [i.question for i in items for _ in range(t.num_generations)]
    images = [i.image for i in items for _ in range(t.num_generations)]

    def call(recorded: bool) -> tuple[float, int]:
        torch.manual_seed(0)
        recorder = SamplerLogprobs(t.temperature)
        context = _with_processor(model, recorder) if recorded else contextlib.nullcontext()
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        with context:
            generate_batch(model, processor, questions, images, max_new_tokens=t.max_completion_length,
                           do_sample=True, temperature=t.temperature, compiled=device == "cuda")
        if device == "cuda":
            torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - started), len(recorder.steps) + 1

    call(False), call(True)  # warm-up (compilation on CUDA)
    timings: dict[str, list[float]] = {"plain": [], "recorded": []}
    steps = 0
    for _ in range(repeats):
        timings["plain"].append(call(False)[0])
        ms, steps = call(True)
        timings["recorded"].append(ms)
    rows, width = t.per_device_train_batch_size, t.max_completion_length
    vocab = model.get_output_embeddings().weight.shape[0]
    logits, ids = torch.randn(rows, vocab, device=device), torch.zeros(rows, 1, dtype=torch.long, device=device)
    recorder = SamplerLogprobs(t.temperature)

    def per_call(fn: object, calls: int = 200) -> float:  # ms, the least of 5 rounds (other load only adds)
        rounds = []
        for _ in range(5):
            if device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(calls):
                fn()
            if device == "cuda":
                torch.cuda.synchronize()
            rounds.append(1e3 * (time.perf_counter() - started) / calls)
        return min(rounds)

    def step() -> None:  # one decode step's work: gather the last token, keep this step's scaled logits
        recorder(ids, logits)
        recorder.steps.clear()

    reference = torch.randn(rows, width, device=device).clamp(max=0) - 1
    sampled, mask = reference + 0.01 * torch.randn_like(reference), torch.ones(rows, width, device=device)
    return {"preset": preset, "device": device, "batch": len(questions), "vocab": vocab, "decode_steps": steps,
            "generate_ms": {"plain": min(timings["plain"]), "recorded": min(timings["recorded"]), "all": timings},
            "recorder_ms_per_decode_step": per_call(step),
            "stats_and_factor_ms_per_micro_batch": per_call(lambda: (
                micro_batch_stats(reference, sampled, mask, 3.0),
                tis_factor(reference, sampled, mask, level="sequence" if t.algorithm == "gspo" else "token", cap=3.0)))}


if __name__ == "__main__":
    raise SystemExit(main())
