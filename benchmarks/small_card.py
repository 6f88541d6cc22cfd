"""Issue 39's small-card record from `vlmrl bench` outputs: the seed-16gb batching in fp16 under a 15 GiB cap,
the same in bf16 beside it, and the preflight's prediction for those settings.

    python benchmarks/small_card.py OUTDIR --fp16 BENCH.json --bf16 BENCH.json [--varied BENCH.json]
                                    [--alone BENCH.json] [--bf16-alone BENCH.json] [--record BENCH.json]
                                    [--note TEXT]

--fp16 / --bf16: `vlmrl bench --paths vlmrl --load-in-4bit --micro-batch 4 --steps-per-generation 4
--memory-cap-gib 15 --dtype float16|bfloat16`; --varied: a run with
`--varied-reward`, whose steps have non-zero advantages (a random-weight model earns nothing from the seed's
rewards, so without it every gradient is exactly zero); --alone: the --fp16 settings run again alone on the host
for a step time that no other job slowed; --bf16-alone: the --bf16
settings alone on the host; --record: the 24 GiB 4-bit record, for its step
time. fp16_over_bf16_step compares --fp16 with --bf16, which ran under the same conditions, and
fp16_over_bf16_step_alone the two alone runs.
Writes OUTDIR/h200_small_card.json and .md. The criteria are read off the numbers; nothing is tuned to pass them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

CAP_GIB = 15.0
PREFLIGHT_TOLERANCE = 0.25  # the issue: the preflight predicts the peak within 25%


def run_block(path: Path) -> dict:
    """One bench.json's vlmrl path: settings, steps, per-step loss / grad norm / reward, peak, prediction."""
    from vlmrl.config.schema import load_config
    from vlmrl.preflight.memory import estimate_memory, load_shapes

    bench = json.loads(path.read_text())
    s = bench["settings"]
    raw = next(r for r in bench["raw"] if r["path"] == "vlmrl")
    steps = [{"loss": row.get("loss"), "grad_norm": row.get("grad_norm"), "reward": row.get("reward"),
              "reward_std": row.get("reward_std")} for row in raw.get("log") or []]
    config = load_config("seed-16gb", [f"train.max_completion_length={s['completion']}"])
    predicted = estimate_memory(config, load_shapes(s["shapes"]), prompt_tokens=bench["prompt_tokens"],
                                fast_generation=True).peak_gib
    path_summary = bench["paths"]["vlmrl"]
    values = [v for step in steps for v in (step["loss"], step["grad_norm"], step["reward"])]
    return {
        "file": path.name, "settings": s, "device": bench.get("device"), "error": raw.get("error"),
        "steps_completed": len(steps), "per_step": steps,
        "all_finite": bool(values) and all(isinstance(v, (int, float)) and math.isfinite(v) for v in values),
        "nonzero_gradients": any((step["grad_norm"] or 0) > 0 for step in steps),
        "step_seconds": path_summary.get("step_seconds"), "first_step_seconds": path_summary.get("first_step_seconds"),
        "step_seconds_each": [round(step["seconds"], 1) for step in raw.get("steps") or []],
        "decode_ms_per_step": path_summary.get("decode_ms_per_step"),
        "peak_gib": raw.get("peak_memory_gib"), "peak_reserved_gib": raw.get("peak_reserved_gib"),
        "predicted_peak_gib": predicted,
        "measured_over_predicted": raw["peak_memory_gib"] / predicted if raw.get("peak_memory_gib") else None,
        "rollout_mismatch": raw.get("rollout_mismatch"),
        "engine": (raw.get("fast_generation") or {}).get("adapters"),
    }


def criteria(fp16: dict, varied: dict | None) -> dict:
    return {
        "three_fp16_steps_complete": fp16["steps_completed"] >= 3 and not fp16["error"],
        "fp16_loss_rewards_gradients_finite": fp16["all_finite"] and (varied is None or varied["all_finite"]),
        "fp16_nonzero_gradients_finite": None if varied is None else varied["nonzero_gradients"] and varied["all_finite"],
        "fp16_peak_within_15_gib": fp16["peak_gib"] is not None and fp16["peak_gib"] <= CAP_GIB,
        "preflight_within_25_percent": abs(fp16["measured_over_predicted"] - 1) <= PREFLIGHT_TOLERANCE,
    }


def _within_cap(block: dict) -> bool:
    return block["steps_completed"] >= 3 and not block["error"] and block["peak_gib"] is not None \
        and block["peak_gib"] <= CAP_GIB


def _ratio(fp16: dict | None, bf16: dict | None) -> float | None:
    """fp16's step time over bf16's, where both have one."""
    if not fp16 or not bf16 or not fp16["step_seconds"] or not bf16["step_seconds"]:
        return None
    return fp16["step_seconds"] / bf16["step_seconds"]


def markdown(result: dict) -> str:
    lines = ["# The 16 GB recipe on an H200 under a 15 GiB cap (issue 39)", "", result["note"], "",
             ("| run | steps | step s (first) | decode ms/step | peak GiB (reserved) | preflight GiB | measured / predicted "
             "| loss, grad norm, reward per step |"), "|---|---|---|---|---|---|---|---|"]
    for name, block in result["runs"].items():
        if not block:
            continue
        s = block["settings"]
        per_step = "; ".join(f"{st['loss']:.3g}, {st['grad_norm']:.3g}, {st['reward']:.3g}" for st in block["per_step"])
        lines.append(
            f"| {name}: {s['dtype']}, {s['completion']} tokens{', varied reward' if s.get('varied_reward') else ''} "
            f"| {block['steps_completed']} | {block['step_seconds']:.1f} ({block['first_step_seconds']:.1f}) "
            f"| {block['decode_ms_per_step']:.1f} | {block['peak_gib']:.2f} ({block['peak_reserved_gib']:.2f}) "
            f"| {block['predicted_peak_gib']:.2f} | {block['measured_over_predicted']:.2f} | {per_step} |")
    record = result.get("record_24gib")
    if record:
        lines += ["", (f"Beside: the 4-bit bf16 record under a 24 GiB cap ({record['file']}, 8 completions per "
                  f"micro-step, one rollout of 32 per step, alone on the host): step {record['step_seconds']:.1f} s, "
                  f"peak {record['peak_gib']:.2f} GiB.")]
    for key, what in (("fp16_over_bf16_step", "the contended pair"), ("fp16_over_bf16_step_alone", "the alone runs")):
        if result.get(key):
            lines += ["", f"fp16 step over bf16 step, {what}: {result[key]:.2f}x."]
    lines += ["", "Criteria: " + ", ".join(f"{k}: {v}" for k, v in result["criteria"].items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--fp16", type=Path, required=True)
    parser.add_argument("--bf16", type=Path, required=True)
    parser.add_argument("--varied", type=Path)
    parser.add_argument("--alone", type=Path)
    parser.add_argument("--bf16-alone", type=Path)
    parser.add_argument("--record", type=Path)
    parser.add_argument("--note", default="")
    args = parser.parse_args(argv)
    runs = {"fp16": run_block(args.fp16), "bf16": run_block(args.bf16),
            "fp16_varied_reward": run_block(args.varied) if args.varied else None,
            "fp16_alone": run_block(args.alone) if args.alone else None,
            "bf16_alone": run_block(args.bf16_alone) if args.bf16_alone else None}
    record = None
    if args.record:
        bench = json.loads(args.record.read_text())
        vlmrl = next(r for r in bench["raw"] if r["path"] == "vlmrl")
        record = {"file": args.record.name, "step_seconds": bench["paths"]["vlmrl"]["step_seconds"],
                  "peak_gib": vlmrl["peak_memory_gib"]}
    fp16, bf16 = runs["fp16"], runs["bf16"]
    result = {
        "what": "the seed-16gb batching (4-bit base, 4 completions per micro-step, 4 micro-steps per rollout, 32 per "
                "optimizer step) under a 15 GiB cap, fp16 beside bf16, with the preflight's prediction (issue 39)",
        "command": "python benchmarks/small_card.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "note": args.note, "runs": runs, "record_24gib": record,
        "fp16_over_bf16_step": _ratio(fp16, bf16),
        "fp16_over_bf16_step_alone": _ratio(runs["fp16_alone"], runs["bf16_alone"]),
        "criteria": {**criteria(fp16, runs["fp16_varied_reward"]),
                     **({"fp16_alone_three_steps_within_15_gib": _within_cap(runs["fp16_alone"])}
                        if runs["fp16_alone"] else {})},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "h200_small_card.json").write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    (args.out / "h200_small_card.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
