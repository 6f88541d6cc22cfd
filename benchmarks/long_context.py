"""Issue 39's long-completion table from `vlmrl bench` outputs: completion length x base x path, each cell the step
time, the time per token position, the peak and the preflight's prediction, or why it has none.

    python benchmarks/long_context.py OUTDIR BENCH.json... [--partial LENGTH:BASE:FILE]... [--note TEXT]

BENCH.json: a `vlmrl bench` record (the commands: benchmarks/suites/h200-long-context.json). --partial: a
bench.partial.json, the raw list a bench writes after each path, for a job that did not finish; it carries no
settings, so LENGTH (completion tokens) and BASE (`4bit` under the 24 GiB cap, or `bf16` uncapped, as the plans
run them) say what it ran, with the rest of the settings the plans' defaults. Every cell of the issue's grid
(2048, 4096 and 8192 tokens x 4-bit and bf16 x vlmrl and plain TRL) is in the table: one no file measured says
"not measured". A path that ran only its first step (compilation included) is marked so; its step time is that
step's. "ms per token position" is the step's generation time over the completion length: one token step of a
rollout of all 32 completions, or the sum of the token steps of the 2, 4 or 8 rollouts the batching splits them
into. Writes OUTDIR/h200_long_context.json and .md; the findings are read off the numbers.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

LENGTHS = (2048, 4096, 8192)
BASES = {"4bit": {"load_in_4bit": True, "memory_cap_gib": 24.0}, "bf16": {"load_in_4bit": False, "memory_cap_gib": None}}
PATHS = ("vlmrl", "plain")


def base_of(settings: dict, source: str) -> str:
    """The table's base for a record's settings: 4-bit under the 24 GiB cap, or bf16 uncapped, computing in bf16;
    a record of other settings (another cap, fp16) has no cell here, and saying so beats filing it under one."""
    base = "4bit" if settings["load_in_4bit"] else "bf16"
    if settings.get("memory_cap_gib") != BASES[base]["memory_cap_gib"] or settings.get("dtype", "bfloat16") != "bfloat16":
        raise SystemExit(f"{source}: {base} with a {settings.get('memory_cap_gib')} GiB cap in "
                         f"{settings.get('dtype')}: the table's rows are 4-bit under a 24 GiB cap and bf16 uncapped")
    return base


def cell(settings: dict, raw: dict, prompt_tokens: int, source: str, summary: dict | None = None) -> dict:
    """One path of one run: its figures (`summary`, the bench's own steady figures for the path; else worked out
    from the raw steps as the bench does), the rollouts a step holds, and the preflight's peak for its settings."""
    from vlmrl.bench.shaped import BenchSettings, batching, seed_overrides
    from vlmrl.bench.summary import rollouts_per_step, steady_steps
    from vlmrl.config.schema import load_config
    from vlmrl.preflight.memory import estimate_memory, load_shapes

    s = {**BenchSettings().__dict__, **settings}
    rollouts, rollout = rollouts_per_step(s)
    steps = [step for step in raw.get("steps") or [] if not step.get("profiled")]
    if summary is None:
        steady = steady_steps(steps, s["warmup_steps"])
        summary = {"step_seconds": sum(st["seconds"] for st in steady) / len(steady) if steady else None,
                   "generate_seconds": sum(st["generate_seconds"] for st in steady) / len(steady) if steady else None}
    step_s, generate_s = summary.get("step_seconds"), summary.get("generate_seconds")
    predicted = None
    if raw["path"] == "vlmrl":  # the preflight predicts what vlmrl runs (fast generation)
        predicted = estimate_memory(load_config("seed", seed_overrides(s)), load_shapes(s["shapes"]),
                                    prompt_tokens=prompt_tokens, fast_generation=True).peak_gib
    peak = raw.get("peak_memory_gib")
    cap = s["memory_cap_gib"]
    return {
        "source": source, "error": raw.get("error"), "steps_measured": len(steps),
        "first_step_only": len(steps) == 1 and raw["path"] != "plain",  # plain TRL compiles nothing
        "step_seconds": step_s, "first_step_seconds": steps[0]["seconds"] if steps else None,
        "generate_seconds": generate_s,
        "ms_per_token_position": 1e3 * generate_s / s["completion"] if generate_s else None,
        "rollouts_per_step": rollouts, "rollout_rows": rollout, "micro_batch": batching(s)[0],
        "peak_gib": peak, "generation_peak_gib": raw.get("generation_peak_gib"),
        "training_peak_gib": raw.get("training_peak_gib"), "peak_reserved_gib": raw.get("peak_reserved_gib"),
        "memory_cap_gib": cap, "within_cap": None if cap is None or peak is None else peak <= cap and not raw.get("error"),
        "predicted_peak_gib": predicted, "measured_over_predicted": peak / predicted if peak and predicted else None,
        "mean_abs_logp_diff": [m["mismatch/logp_diff_mean"] for m in raw.get("rollout_mismatch") or []],
    }


def collect(benches: list[Path], partials: list[str]) -> dict[tuple[int, str, str], dict]:
    cells: dict[tuple[int, str, str], dict] = {}
    for path in benches:
        bench = json.loads(path.read_text())
        s = bench["settings"]
        for raw in bench["raw"]:
            key = (s["completion"], base_of(s, path.name), raw["path"])
            if key in cells:
                raise SystemExit(f"{path.name}: {key} is also in {cells[key]['source']}: give one record per cell")
            cells[key] = cell(s, raw, bench["prompt_tokens"], path.name, bench["paths"].get(raw["path"]))
    for spec in partials:
        length, base, file = spec.split(":", 2)
        if base not in BASES:
            raise SystemExit(f"--partial {spec}: BASE is one of {', '.join(BASES)}")
        settings = {"completion": int(length), **BASES[base]}
        for raw in json.loads(Path(file).read_text()):
            key = (int(length), base, raw["path"])
            if key not in cells:  # a whole record of the same cell wins over a partial one
                cells[key] = cell(settings, raw, 310, Path(file).name + " (partial: the job did not finish)")
    return cells


def findings(cells: dict) -> dict:
    """What the issue asks, read off the cells: does vlmrl run 8192 tokens of the 4-bit recipe under 24 GiB, and
    which lengths plain TRL was measured to fit (a length not measured is neither fit nor out of memory)."""
    v8192 = cells.get((8192, "4bit", "vlmrl"))
    lengths = _lengths(cells)
    plain = {length: cells.get((length, "4bit", "plain")) for length in lengths}
    fits = [length for length, c in plain.items() if c and c["within_cap"]]
    return {
        "vlmrl_8192_4bit_under_24_gib": bool(v8192 and v8192["within_cap"]),
        "plain_4bit_lengths_measured_to_fit": fits,
        "plain_4bit_lengths_failed_or_over_cap": [length for length, c in plain.items() if c and c["within_cap"] is False],
        "plain_4bit_lengths_not_measured": [length for length, c in plain.items() if not c],
        "step_speedup_4bit": _speedups(cells, "4bit"),
        "step_speedup_bf16": _speedups(cells, "bf16"),
        "speedups_across_two_runs": [f"{length} {base}" for base in BASES for length in _speedups(cells, base)
                                     if len({cells[(length, base, path)]["source"] for path in PATHS}) > 1],
    }


def _speedups(cells: dict, base: str) -> dict[int, float]:
    """Plain TRL's step time over vlmrl's, per length where both ran on `base`."""
    return {length: cells[(length, base, "plain")]["step_seconds"] / cells[(length, base, "vlmrl")]["step_seconds"]
            for length in _lengths(cells) if all(_ran(cells.get((length, base, path))) for path in PATHS)}


def _lengths(cells: dict) -> list[int]:
    """The issue's lengths and any other a record measured, in order."""
    return sorted({*LENGTHS, *(key[0] for key in cells)})


def _ran(c: dict | None) -> bool:
    """A cell with a step time (a path that failed has none)."""
    return bool(c) and not c["error"] and c["step_seconds"] is not None


def _f(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def markdown(result: dict) -> str:
    lines = ["# Long completions: vlmrl and plain TRL on the Qwen3-VL-8B seed recipe (issue 39, item 3)", "",
             result["note"], "",
             ("| completion | base | path | step s (first) | ms per token position (rollouts x rows) "
              "| peak GiB (rollouts / rest) | preflight GiB | measured / predicted | record |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        head = f"| {row['completion']} | {row['base']} | {row['path']} "
        c = row.get("measured")
        if not c:
            lines.append(head + "| not measured | | | | | |")
            continue
        if c["error"]:
            lines.append(head + f"| failed: {c['error']} | | | | | {c['source']} |")
            continue
        step = (f"{_f(c['first_step_seconds'])} (first step only, compilation included)" if c["first_step_only"]
                else f"{_f(c['step_seconds'])} ({_f(c['first_step_seconds'])})")
        first = ", first step" if c["first_step_only"] else ""
        lines.append(
            head + f"| {step} | {_f(c['ms_per_token_position'])} ({c['rollouts_per_step']} x {c['rollout_rows']}{first}) "
            f"| {_f(c['peak_gib'], 2)} ({_f(c['generation_peak_gib'], 2)} / {_f(c['training_peak_gib'], 2)}) "
            f"| {_f(c['predicted_peak_gib'], 2)} | {_f(c['measured_over_predicted'], 2)} | {c['source']} |")
    f = result["findings"]
    speedups = ("step_speedup_4bit", "step_speedup_bf16", "speedups_across_two_runs")
    lines += ["", "Findings: " + "; ".join(f"{k}: {v}" for k, v in f.items() if k not in speedups), ""]
    for base, label in (("4bit", "4-bit"), ("bf16", "bf16")):
        ratios = [f"{length} tokens {ratio:.2f}x"
                  + (" (vlmrl and plain TRL in two runs)" if f"{length} {base}" in f["speedups_across_two_runs"]
                     else " (one run)")
                  for length, ratio in f[f"step_speedup_{base}"].items()]
        lines.append(f"{label} step, plain TRL over vlmrl: " + (", ".join(ratios) or "none measured"))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("benches", type=Path, nargs="*")
    parser.add_argument("--partial", action="append", default=[], metavar="LENGTH:BASE:FILE")
    parser.add_argument("--note", default="")
    args = parser.parse_args(argv)
    cells = collect(args.benches, args.partial)
    rows = [{"completion": length, "base": base, "path": path, "measured": cells.get((length, base, path))}
            for length in _lengths(cells) for base in BASES for path in PATHS]
    result = {
        "what": "completion length x (vlmrl, plain TRL) x (step s, peak GiB, or why not), 4-bit under the seed "
                "recipe's 24 GiB cap and bf16 uncapped, Qwen3-VL-8B shapes, 32 completions per optimizer step",
        "command": shlex.join(["python", "benchmarks/long_context.py", *(sys.argv[1:] if argv is None else argv)]),
        "note": args.note, "rows": rows, "findings": findings(cells),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "h200_long_context.json").write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    (args.out / "h200_long_context.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
