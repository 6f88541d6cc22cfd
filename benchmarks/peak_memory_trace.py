"""What is allocated at each phase's memory peak, plain TRL vs vlmrl (diagnostic for benchmarks/NOTES.md).

Runs `vlmrl bench`'s paths with the CUDA allocator's history recorded (python stacks), replays the trace and,
for the rollout phase (between markers set around each TRL generation call) and for the rest, lists the live
bytes at the phase's peak grouped by the innermost allocation site outside torch. Usage (CUDA):
    python benchmarks/peak_memory_trace.py OUTDIR [COMPLETION] [PROMPTS] [PATHS]
PROMPTS per step (x 4 generations; default 8) and PATHS (default plain,vlmrl): e.g. `OUT 1024 32 vlmrl` looks for
what holds the compiled decode phase's excess over weights + static cache at 128 completions (benchmarks/NOTES.md,
"Memory preflight": about one prompt-sized KV cache, not explained yet).
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

from vlmrl import bench

MARK = {"start": 1001 * 512, "end": 1003 * 512}  # marker allocations: sizes nothing else uses


def site(frames: list[dict]) -> str:
    for f in frames:
        name = f.get("filename", "")
        if "/torch/" not in name and "<" not in name:
            short = name.split("site-packages/")[-1].split("/src/")[-1]
            return f"{short}:{f.get('line')} {f.get('name')}"
    return "torch internals"


def analyse(trace: list[dict]) -> dict:
    live: dict[int, tuple[int, str]] = {}
    total, in_rollout = 0, False
    peaks = {"rollout": (0, None), "rest": (0, None)}
    for event in trace:
        action, size, addr = event["action"], event["size"], event["addr"]
        if action == "alloc":
            if size == MARK["start"]:
                in_rollout = True
            elif size == MARK["end"]:
                in_rollout = False
            live[addr] = (size, site(event.get("frames", [])))
            total += size
            phase = "rollout" if in_rollout else "rest"
            if total > peaks[phase][0]:
                peaks[phase] = (total, Counter())
                for s, where in live.values():
                    peaks[phase][1][where] += s
        elif action in ("free_requested",) and addr in live:
            total -= live.pop(addr)[0]
    return {phase: {"peak_gib": p / 2**30,
                    "sites_mib": [(where, round(b / 2**20, 1)) for where, b in (c or Counter()).most_common(25)]}
            for phase, (p, c) in peaks.items()}


def main(out: Path, completion: int, prompts: int = 8, paths: list[str] | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp())
    settings = bench.BenchSettings(completion=completion, steps=1, prompts=prompts)
    shapes = bench.load_shapes(settings.shapes)
    processor_dir = bench.build_processor(work, settings.image_size)
    dataset = bench.bench_dataset(settings)
    original_wrap = bench.StepClock.wrap_generation

    def wrap_with_markers(self, trainer):
        inner = trainer._generate_single_turn

        def generate(*args, **kwargs):
            start = torch.empty(MARK["start"], dtype=torch.uint8, device="cuda")
            try:
                return inner(*args, **kwargs)
            finally:
                torch.empty(MARK["end"], dtype=torch.uint8, device="cuda")
                del start
        trainer._generate_single_turn = generate
        return original_wrap(self, trainer)

    bench.StepClock.wrap_generation = wrap_with_markers
    report = {}
    for path in paths or ["plain", "vlmrl"]:
        torch.cuda.memory._record_memory_history(max_entries=3_000_000, stacks="python")
        result = bench.run_path(path, settings, shapes, processor_dir, dataset, work)
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        report[path] = {"bench": {k: result[k] for k in ("error", "generation_peak_gib", "training_peak_gib")},
                        **analyse(snapshot["device_traces"][0])}
        print(path, json.dumps(report[path], indent=1), flush=True)
    (out / "peak_memory_trace.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    args = sys.argv[1:]
    main(Path(args[0] if args else "peak-memory"), int(args[1]) if len(args) > 1 else 256,
         int(args[2]) if len(args) > 2 else 8, args[3].split(",") if len(args) > 3 else None)
