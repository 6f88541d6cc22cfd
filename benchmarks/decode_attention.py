"""Decode-step attention at the seed recipe's shapes, one layer (diagnostic for benchmarks/NOTES.md).

Qwen3-VL-8B decoding 32 sequences: 32 query heads over 8 KV heads (folded: 4 query rows per KV head), a static
cache of 1,408 positions of which `filled` are written. Times each formulation per call (CUDA events, 200 calls)
and the bandwidth it reaches reading the whole cache. Usage (CUDA): python benchmarks/decode_attention.py OUTDIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, *args, calls: int = 200) -> float:
    for _ in range(10):
        fn(*args)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls  # microseconds


def main(out: Path) -> None:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    out.mkdir(parents=True, exist_ok=True)
    batch, kv_heads, groups, dim, length, filled = 32, 8, 4, 128, 1408, 896
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(batch, kv_heads, groups, dim, device=dev, dtype=dt)
    k = torch.randn(batch, kv_heads, length, dim, device=dev, dtype=dt)
    v = torch.randn_like(k)
    pad = torch.randint(0, 64, (batch,), device=dev)
    pos = torch.arange(length, device=dev)
    mask = ((pos[None, :] >= pad[:, None]) & (pos[None, :] < filled))[:, None, None, :]  # [B, 1, 1, L]
    scale = dim ** -0.5

    def sdpa(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale)

    def math(q, k, v, m):
        s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
        s = s.masked_fill(~m, float("-inf"))
        return torch.matmul(s.softmax(-1).to(v.dtype), v)

    reference = math(q, k, v, mask)
    results = {}

    def record(name, fn, *args):
        try:
            got = fn(*args)
            err = (got.float() - reference.float()).abs().max().item()
            us = timed(fn, *args)
            results[name] = {"us": us, "max_abs_err": err, "cache_tb_s": 2 * k.nbytes / us / 1e6}
        except RuntimeError as exc:  # a backend that refuses these shapes is a result too
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print(name, results[name], flush=True)

    record("sdpa default (cuDNN)", sdpa, q, k, v, mask)
    for backend in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        with sdpa_kernel(backend):
            record(f"sdpa {backend.name}", sdpa, q, k, v, mask)
    record("matmul-softmax-matmul eager", math, q, k, v, mask)
    record("matmul-softmax-matmul compiled", torch.compile(math, dynamic=False), q, k, v, mask)

    # flex: the padding mask read per element; blocks past the filled length skipped (kv_num_blocks)
    block = 128
    n_blocks = length // block + (length % block > 0)

    def padded(b, h, q_idx, kv_idx):
        return mask[b, 0, 0, kv_idx]

    def block_mask_for(m):
        visible = m[:, 0, 0, :]
        last = (visible * pos).amax(-1)  # last visible position per row
        counts = (last // block + 1).to(torch.int32)[:, None, None].expand(batch, kv_heads, 1).contiguous()
        indices = torch.arange(n_blocks, device=dev, dtype=torch.int32).expand(batch, kv_heads, 1, n_blocks)
        return BlockMask.from_kv_blocks(counts, indices.contiguous(), BLOCK_SIZE=(block, block), mask_mod=padded,
                                        seq_lengths=(groups, length))

    flex = torch.compile(flex_attention, dynamic=False)

    def flex_skip(q, k, v, m):
        return flex(q, k, v, block_mask=block_mask_for(m), scale=scale)

    record("flex, unfilled blocks skipped", torch.compile(flex_skip, dynamic=False), q, k, v, mask)
    (out / "decode_attention.json").write_text(json.dumps({"shapes": {"batch": batch, "kv_heads": kv_heads,
        "query_rows": groups, "dim": dim, "cache": length, "filled": filled}, "results": results}, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "decode-attention"))
