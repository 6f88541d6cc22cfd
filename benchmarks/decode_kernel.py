"""A token step's attention at Qwen3-VL-8B's rollout shapes: PyTorch's SDPA over the whole static cache (what
vlmrl_sdpa ran before) beside vlmrl's Triton kernel (`vlmrl.engine.rollout.decode_attention`), for several filled lengths
and kernel settings, with each one's error against a float32 reference. Each variant's time is GPU time: 36 calls
(a token step's layers) recorded in a CUDA graph, as the compiled decode step replays them.

    python benchmarks/decode_kernel.py OUTDIR     (one CUDA GPU; ~1 minute)

Writes OUTDIR/decode_kernel.json and .md; exits 1 when the kernel's error is over twice SDPA's (+1e-3), so a
job queued after it can wait for a kernel that computes the right thing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from vlmrl.engine.rollout import decode_attention as kernel

BATCH, KV_HEADS, GROUPS, DIM = 32, 8, 4, 128  # 8 prompts x 4 generations; Qwen3-VL-8B's attention
CACHE = 1344  # 310-token prompts + 1,024 new tokens, bucketed to 64
FILLED = (320, 832, 1344)  # the first token step, the mean, the last


def timed_us(fn, calls: int = 36, replays: int = 20) -> float:
    """GPU time per call: `calls` calls (one token step's layers) recorded in one CUDA graph, as a compiled decode
    step runs them, so the host's launch overhead is not timed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * calls)


def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    device = torch.device("cuda")
    query = torch.randn(BATCH, KV_HEADS, GROUPS, DIM, device=device, dtype=torch.bfloat16)
    key = torch.randn(BATCH, KV_HEADS, CACHE, DIM, device=device, dtype=torch.bfloat16)
    value = torch.randn(BATCH, KV_HEADS, CACHE, DIM, device=device, dtype=torch.bfloat16)
    bytes_per_position = BATCH * KV_HEADS * DIM * 2 * 2  # keys and values, bf16
    rows, worst = [], 0.0
    for filled in FILLED:
        mask = torch.zeros(BATCH, 1, 1, CACHE, dtype=torch.bool, device=device)
        mask[..., :filled] = True
        key[:, :, filled:] = 0  # an unwritten static cache holds zeros
        value[:, :, filled:] = 0
        reference = torch.nn.functional.scaled_dot_product_attention(query.float(), key.float(), value.float(),
                                                                     attn_mask=mask)

        def sdpa(mask=mask):
            return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask)

        sdpa_error = (sdpa().float() - reference).abs().max().item()
        us = timed_us(sdpa)
        rows.append({"filled": filled, "variant": "sdpa, whole cache", "us": us, "max_abs_err": sdpa_error,
                     "read_tb_s": bytes_per_position * CACHE / us / 1e6})
        for block in (32, 64, 128):
            for warps in (4, 8):
                for splits in (0, 2, 4, 8):
                    kernel.WARPS = warps

                    def run(mask=mask, block=block, splits=splits):
                        return kernel.decode_attention(query, key, value, mask, block=block, splits=splits)

                    error = (run().float() - reference).abs().max().item()
                    worst = max(worst, error - 2 * sdpa_error)
                    us = timed_us(run)
                    read = -(-filled // block) * block
                    rows.append({"filled": filled, "variant": f"kernel block {block}, {warps} warps, splits "
                                 f"{splits or kernel.splits_for(BATCH, KV_HEADS, CACHE, device, block)}"
                                 f"{' (auto)' if not splits else ''}", "us": us, "max_abs_err": error,
                                 "read_tb_s": bytes_per_position * read / us / 1e6})
        kernel.WARPS = 4
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "shapes": {"batch": BATCH, "kv_heads": KV_HEADS, "groups": GROUPS, "dim": DIM, "cache": CACHE},
              "rows": rows, "numerics_ok": worst <= 1e-3}
    (out / "decode_kernel.json").write_text(json.dumps(result, indent=1))
    lines = [(f"{result['device']}, torch {torch.__version__}; batch {BATCH}, {KV_HEADS} KV heads x {GROUPS} query "
             f"rows, dim {DIM}, static cache {CACHE} positions, bf16. read TB/s: the attended blocks' keys and values "
             "(SDPA reads the whole cache) per second."), "",
             "| filled | variant | us per layer | read TB/s | max abs err vs fp32 |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['filled']} | {r['variant']} | {r['us']:.1f} | {r['read_tb_s']:.2f} | "
                     f"{r['max_abs_err']:.4f} |")
    (out / "decode_kernel.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if result["numerics_ok"] else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "decode-kernel-out")))
