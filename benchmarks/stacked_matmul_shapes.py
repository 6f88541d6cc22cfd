"""How fast cuBLAS runs a token step's stacked projection matmuls (`vlmrl.engine.rollout.stacked`) at Qwen3-VL-8B shapes,
by how many rows the stacked tensor has: the base weight alone, with the adapters' first-factor rows below it (what
runs now), and with those rows padded with zeros up to a multiple of 64, 128 or 256.

Why: in the stacked default's token-step profile (`h200_decode_variants_guards.md`) the q/k/v and o matmuls run as
split-K kernels at about half the bandwidth the gate/up matmul reaches. The kernel cuBLAS picks depends on the
output width; this measures whether a padded width gets a faster one. Each matmul is `x @ W.T` with x the batch
of 32 token rows in bf16 and W [rows, in] row-major as the stacked tensors are, timed inside one CUDA graph of 64
calls that cycle through 16 distinct copies of W (so each call reads W from memory, not from L2), 20 replays.
Reports microseconds per call, the bandwidth over W's bytes, and the kernel's name (one profiled replay).
Usage (CUDA): python benchmarks/stacked_matmul_shapes.py OUTDIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

BATCH, HIDDEN, INTERMEDIATE, RANK = 32, 4096, 12288, 16
GROUPS = {  # name: (base output rows, input width, first-factor rows stacked below)
    "q/k/v": (4096 + 1024 + 1024, HIDDEN, 3 * RANK),
    "o": (HIDDEN, 4096, RANK),
    "gate/up": (2 * INTERMEDIATE, HIDDEN, 2 * RANK),
    "down": (HIDDEN, INTERMEDIATE, RANK),
}
COPIES, CALLS, REPLAYS = 16, 64, 20


def padded(rows: int, multiple: int) -> int:
    return -(-rows // multiple) * multiple


def graph_of(calls: list) -> tuple[torch.cuda.CUDAGraph, list]:
    """`calls` (no-argument callables) recorded in one CUDA graph, after a warm-up on a side stream (kernels built and
    cuBLAS's choices cached outside the capture); the graph and what the captured calls returned."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [call() for call in calls]
    return graph, outs


def replay_us(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Microseconds per replay of `graph` (CUDA events, after one untimed replay)."""
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / replays


def measure(rows: int, width: int) -> dict:
    weights = [torch.randn(rows, width, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
    x = torch.randn(BATCH, width, device="cuda", dtype=torch.bfloat16)
    graph, _ = graph_of([lambda w=weights[i % COPIES]: torch.nn.functional.linear(x, w) for i in range(CALLS)])
    us = replay_us(graph, REPLAYS) / CALLS
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.nn.functional.linear(x, weights[0])
        torch.cuda.synchronize()
    kernels = [e.key for e in prof.key_averages() if e.device_type.name == "CUDA"]
    return {"rows": rows, "us_per_call": us, "tb_per_s": rows * width * 2 / us / 1e6, "kernels": kernels}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"device": torch.cuda.get_device_name(), "batch": BATCH, "rank": RANK, "groups": {}}
    lines = [f"{result['device']}; x [{BATCH}, in] @ W.T, bf16, W cycling through {COPIES} copies in one CUDA graph", "",
             "| group | rows | in | us per call | TB/s over W | kernel(s) |", "|---|---|---|---|---|---|"]
    for name, (base, width, lora) in GROUPS.items():
        stacked = base + lora
        shapes = {"base alone": base, "stacked (now)": stacked}
        shapes |= {f"stacked, padded to {m}": padded(stacked, m) for m in (64, 128, 256)}
        rows_seen: dict[int, dict] = {}
        result["groups"][name] = {}
        for label, rows in shapes.items():
            if rows not in rows_seen:
                rows_seen[rows] = measure(rows, width)
            m = rows_seen[rows]
            result["groups"][name][label] = m
            lines.append(f"| {name}: {label} | {rows} | {width} | {m['us_per_call']:.1f} | {m['tb_per_s']:.2f} | "
                         f"{', '.join(k[:60] for k in m['kernels'])} |")
            print(lines[-1], flush=True)
    (out / "stacked_matmul_shapes.json").write_text(json.dumps(result, indent=2))
    (out / "stacked_matmul_shapes.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
