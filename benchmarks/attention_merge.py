"""The decode attention kernel's shares merged by the last one to finish, against a second kernel merging them, over a
token step's 36 layers (`vlmrl.engine.rollout.decode_attention`; the A/B of its in-kernel merge).

Qwen3-VL-8B decoding 32 sequences: 32 query heads over 8 KV heads (folded: 4 query rows per KV head), head dim 128,
a static cache of 1,408 positions of which `filled` are attended, one cache per layer (so no layer reads another's
from L2). Each way is 36 calls in one CUDA graph, replayed 50 times; the outputs of both ways are compared bit for
bit. The second-kernel way is the product's own code with no counters to be had (`arrivals.COUNTERS` = 0).
Usage (CUDA): python benchmarks/attention_merge.py OUTDIR [FILLED ...]   (default 128 512 1024)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from stacked_matmul_shapes import graph_of, replay_us

from vlmrl.engine.rollout import arrivals
from vlmrl.engine.rollout.decode_attention import decode_attention, splits_for

LAYERS, BATCH, KV_HEADS, GROUPS, DIM, POSITIONS, REPLAYS = 36, 32, 8, 4, 128, 1408, 50


def main(out: Path, filled_lengths: list[int]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    caches = [(torch.randn(BATCH, KV_HEADS, POSITIONS, DIM, device=dev, dtype=dt),
               torch.randn(BATCH, KV_HEADS, POSITIONS, DIM, device=dev, dtype=dt)) for _ in range(LAYERS)]
    query = torch.randn(BATCH, KV_HEADS, GROUPS, DIM, device=dev, dtype=dt)
    result = {"device": torch.cuda.get_device_name(), "layers": LAYERS, "batch": BATCH, "positions": POSITIONS,
              "splits": splits_for(BATCH, KV_HEADS, POSITIONS, dev), "rows": []}
    lines = [(f"{result['device']}: {LAYERS} layers' decode attention in one CUDA graph, {BATCH} rows, {KV_HEADS} KV "
              f"heads x {GROUPS}, dim {DIM}, {POSITIONS} cache positions, {result['splits']} shares a (row, head)"), "",
             "| attended positions | merged in the kernel us | second kernel us | saved us | outputs equal |",
             "|---|---|---|---|---|"]
    for filled in filled_lengths:
        mask = torch.zeros(BATCH, 1, 1, POSITIONS, dtype=torch.bool, device=dev)
        mask[..., :filled] = True
        calls = [lambda k=k, v=v, mask=mask: decode_attention(query, k, v, mask) for k, v in caches]
        merged_graph, merged_outs = graph_of(calls)
        saved, arrivals.COUNTERS = arrivals.COUNTERS, 0
        try:
            second_graph, second_outs = graph_of(calls)
        finally:
            arrivals.COUNTERS = saved
        merged_us, second_us = replay_us(merged_graph, REPLAYS), replay_us(second_graph, REPLAYS)
        merged_graph.replay()
        second_graph.replay()
        torch.cuda.synchronize()
        equal = all(torch.equal(a, b) for a, b in zip(merged_outs, second_outs, strict=True))
        result["rows"].append({"filled": filled, "merged_us": merged_us, "second_kernel_us": second_us,
                               "equal": equal})
        lines.append(f"| {filled} | {merged_us:.1f} | {second_us:.1f} | {second_us - merged_us:.1f} | {equal} |")
        print(lines[-1], flush=True)
    (out / "attention_merge.json").write_text(json.dumps(result, indent=2))
    (out / "attention_merge.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), [int(a) for a in sys.argv[2:]] or [128, 512, 1024])
