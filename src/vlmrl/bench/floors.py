"""The bench's floors and ceilings: how fast a step could be on this device, from its measured limits.

Decode is bandwidth-bound (weights + KV cache read once per token step), training FLOP-bound (6 x language
parameters x tokens: forward, checkpoint recompute, input-gradient backward; frozen weights get no weight
gradient). The ceilings (bf16 matmul rate, device copy bandwidth) are measured on the same device in the same
run. Pure functions, except `measure_ceilings` (CUDA only); `vlmrl.preflight.memory` reuses the parameter and KV counts.
Left out: the measured paths (`run`), the tables (`summary`).
"""

from __future__ import annotations

import time

import torch

from vlmrl.bench.shaped import GIB


def decode_floor_ms(weight_bytes: float, kv_bytes_per_token: float, batch: int, prompt: int, completion: int,
                    bandwidth: float) -> float:
    """Mean time per decode step if every step only read the weights once plus the KV cache so far."""
    mean_context = prompt + completion / 2
    return 1e3 * (weight_bytes + kv_bytes_per_token * batch * mean_context) / bandwidth


def ragged_decode_floor_ms(weight_bytes: float, kv_bytes_per_token: float, prompt: int, lengths: list[int],
                           bandwidth: float) -> float:
    """Mean time per decode step of a rollout whose rows end at `lengths` (it runs max(lengths) steps), if every
    step read the weights once plus the KV cache of the rows still generating: a finished row's is not read.

    >>> ragged_decode_floor_ms(0.0, 1.0, 0, [2, 2], 1e3) == decode_floor_ms(0.0, 1.0, 2, 0, 1, 1e3)
    True
    """
    steps = max(lengths)
    kv_tokens = sum(n * prompt + n * (n - 1) / 2 for n in lengths)  # row i reads prompt + t at its steps t < n
    return 1e3 * (weight_bytes + kv_bytes_per_token * kv_tokens / steps) / bandwidth


def train_floor_s(language_params: float, tokens: float, flops: float) -> float:
    return 6 * language_params * tokens / flops


def measure_ceilings(device: str = "cuda") -> dict:
    """bf16 matmul TFLOP/s and device copy bandwidth, measured here and now."""
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    reps = 20
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    flops = 2 * n**3 * reps / (time.perf_counter() - start)
    src = torch.empty(2 * GIB, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    bandwidth = 2 * src.numel() * 10 / (time.perf_counter() - start)  # read + write
    del a, b, src, dst
    torch.cuda.empty_cache()
    return {"matmul_tflops": flops / 1e12, "copy_bandwidth_tbs": bandwidth / 1e12}

