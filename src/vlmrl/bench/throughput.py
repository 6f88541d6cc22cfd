"""`vlmrl bench --generation-batches 32,64,128,256`: samples per second and peak memory at each generation batch.

A bigger generation batch (completions per rollout) reads the same weights once per token step for more
sequences, so decode throughput grows until the KV cache and the loss pass fill the card. This measures where that
stops, for the seed recipe's step (GSPO, LoRA r=16, forced full-length completions), one row per batch:

    generation batch B = per-device batch (prompts) x generations, gradient accumulation = generations
    (as the seed: 8 prompts x 4 generations = 32), so one optimizer step is one rollout of B completions and the
    loss pass's micro-batch grows with B (what `train.auto_batch` changes: per_device_train_batch_size).

Kept cheap: one process, `--steps` per batch (2: the first compiles for the new batch shape, the second is the
steady one reported), the processor and data built once, the random weights built from the same seed for each
batch (4-bit: the bf16 weights saved once and reloaded, `shaped.build_shaped_model`). A fresh trainer per batch
keeps each row's LoRA and optimizer its own, and dynamo is reset in between (compiled graphs and CUDA-graph pools
freed; the on-disk compile cache stays).
A batch that fails (out of memory) is recorded with its error, and the larger batches after it are skipped, not
attempted. Every path named in `--paths` gets its rows; the table of record is `--paths vlmrl`.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from vlmrl.bench.run import prepare_device, prompt_tokens_of, run_path
from vlmrl.bench.shaped import BenchSettings, bench_dataset, build_processor, load_shapes
from vlmrl.common import distributed
from vlmrl.common.io import strict_json


def parse_batches(text: str, generations: int) -> list[int]:
    """Generation batches from the command line, ascending; each a positive multiple of `generations`.

    >>> parse_batches("64, 32,256", 4)
    [32, 64, 256]
    >>> parse_batches("30", 4)
    Traceback (most recent call last):
    ...
    ValueError: generation batch 30 is not a positive multiple of the 4 generations per prompt
    """
    batches = []
    for part in text.split(","):
        try:
            batch = int(part.strip())
        except ValueError:
            raise ValueError(f"generation batch {part.strip()!r} is not a whole number") from None
        if batch <= 0 or batch % generations:
            raise ValueError(f"generation batch {batch} is not a positive multiple of the {generations} "
                             "generations per prompt")
        batches.append(batch)
    return sorted(set(batches))


def run_throughput(settings: BenchSettings, batches: list[int], out_dir: Path, work: Path) -> dict:
    """Every path in `settings.paths` at every generation batch; writes throughput.json and throughput.md."""
    compile_cache, work = prepare_device(settings, work)
    shapes = load_shapes(settings.shapes)
    processor_dir = build_processor(work, settings.image_size)
    dataset = bench_dataset(replace(settings, prompts=max(batches) // settings.generations))
    measured: list[tuple[str, int, dict | None]] = []
    for path in settings.paths:
        failed_at = None
        for batch in batches:
            if failed_at is not None:  # a larger batch than one that ran out of memory
                measured.append((path, batch, None))
                continue
            per_batch = replace(settings, prompts=batch // settings.generations)
            # as a new process would start: the last batch's compiled graphs and CUDA-graph memory pools freed
            # (torch keeps the pools process-wide), so its memory does not count in this batch's peak
            torch._dynamo.reset()
            result = run_path(path, per_batch, shapes, processor_dir, dataset, work)
            measured.append((path, batch, result))
            if result["error"]:
                failed_at = batch
            _write(out_dir, "throughput.partial.json", [(p, b, r) for p, b, r in measured])
    summary = {
        "settings": {**asdict(settings), "generation_batches": batches},
        "prompt_tokens": prompt_tokens_of(processor_dir, dataset),
        "compile_cache": compile_cache.as_dict(),
        "rows": throughput_rows(settings, measured),
        "raw": [{"path": p, "generation_batch": b, "result": r} for p, b, r in measured],
    }
    _write(out_dir, "throughput.json", summary)
    if distributed.is_main_process():
        (out_dir / "throughput.md").write_text(throughput_table(summary))
    return summary


def _write(out_dir: Path, name: str, data: Any) -> None:
    if distributed.is_main_process():
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / name).write_text(strict_json(data, indent=2))


def throughput_rows(settings: BenchSettings, measured: list[tuple[str, int, dict | None]]) -> list[dict]:
    """One row per (path, generation batch): the steady step (the first excluded when there are more), samples/s
    and the peaks; a failed batch keeps its error, a skipped one says why."""
    rows = []
    for path, batch, result in measured:
        row: dict[str, Any] = {"path": path, "generation_batch": batch,
                               "per_device_batch": batch // settings.generations}
        if result is None:
            rows.append({**row, "error": "skipped: a smaller batch failed"})
            continue
        steps = result["steps"][1:] if len(result["steps"]) > 1 else result["steps"]
        if not steps:
            rows.append({**row, "error": result["error"] or "no step completed"})
            continue
        step = sum(s["seconds"] for s in steps) / len(steps)
        generate = sum(s["generate_seconds"] for s in steps) / len(steps)
        rows.append({
            **row,
            "error": result["error"],
            "steps_measured": len(steps),
            "first_step_seconds": result["steps"][0]["seconds"],
            "step_seconds": step,
            "samples_per_second": batch * result.get("world_size", 1) / step,
            "generate_seconds": generate,
            "decode_ms_per_step": 1e3 * generate / settings.completion,
            "peak_memory_gib": result["peak_memory_gib"],
            "generation_peak_gib": result.get("generation_peak_gib"),
            "training_peak_gib": result.get("training_peak_gib"),
            "peak_reserved_gib": result.get("peak_reserved_gib"),
        })
    return rows


def throughput_table(summary: dict) -> str:
    s = summary["settings"]
    lines = [
        f"Generation batches, shapes {s['shapes']}, completion {s['completion']} tokens (forced), prompt "
        f"{summary['prompt_tokens']} tokens, {s['generations']} generations per prompt, "
        f"{'4-bit' if s['load_in_4bit'] else 'bf16'}"
        + (f", memory capped at {s['memory_cap_gib']} GiB" if s["memory_cap_gib"] else "")
        + f"; steady step = mean of the steps after the first (of {s['steps']}).",
        "",
        ("| path | generation batch | per-device batch | step s | first step s | samples/s | decode ms/step "
         "| peak GiB | peak in rollouts / rest GiB | reserved GiB |"),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["rows"]:
        head = f"| {r['path']} | {r['generation_batch']} | {r['per_device_batch']} |"
        if "step_seconds" not in r:
            lines.append(f"{head} failed: {r['error']} | | | | | | |")
            continue
        phases = (f"{r['generation_peak_gib']:.1f} / {r['training_peak_gib']:.1f}"
                  if r.get("generation_peak_gib") is not None else "")
        lines.append(f"{head} {r['step_seconds']:.1f} | {r['first_step_seconds']:.1f} | "
                     f"{r['samples_per_second']:.2f} | {r['decode_ms_per_step']:.1f} | {r['peak_memory_gib']:.1f} | "
                     f"{phases} | {r['peak_reserved_gib'] or 0:.1f} |")
    return "\n".join(lines) + "\n"

