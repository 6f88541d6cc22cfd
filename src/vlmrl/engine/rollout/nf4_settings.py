"""The nf4 token-step kernel's tile settings: which tile, warps, pipeline stages and K splits a launch of
`vlmrl.engine.rollout.nf4` takes for a shape, a row count and a GPU.

Public: `config(rows, n, k, blocksize, device)` -> [block_n, block_kh (packed bytes a step), warps, stages, split]:
`TUNED_SM90`'s where it has the shape on sm_90 (`MEASURED_MAJOR`), else `rule_config`'s, whose tiles `tile_shape`
gives, K split by `split_k` to about `PROGRAMS_PER_SM` programs an SM, small tiles in Triton's interpreter
(`interpreter_config`); `block_rows(rows)`, the rows a program takes; `TILE_PAIRS`, packed bytes a step by rule.
benchmarks/nf4_sass.py builds these tiles offline; benchmarks/NOTES.md has how they were chosen. Limits: measured on
sm_90 at Qwen3-VL-8B's shapes only; elsewhere the rule's settings, which no sweep checked.
"""

from __future__ import annotations

import functools

import torch

MEASURED_MAJOR = 9  # compute capability where the kernel was measured faster than bitsandbytes: sm_90 (H100/H200)
TILE_PAIRS = 64  # packed bytes per weight row per loop step on a GPU (128 weights), by rule
PROGRAMS_PER_SM = 4  # split K until the grid has about this many programs per SM


# [block_n, block_kh, warps, stages, split] per (out_features, in_features, blocksize, block_rows(rows)) on sm_90:
# the best settings of two H200 tile sweeps at 16 and 32 rows (the same in every cell, up to k/v's split count,
# which `launch` caps at 16 either way), timed as a whole token step beside `rule_config`'s in one run
# (benchmarks/results/h200_nf4_matmul_tuned.{json,md}). Qwen3-VL-8B's shapes.
TUNED_SM90: dict[tuple[int, int, int, int], list[int]] = {
    (4096, 4096, 64, 16): [128, 64, 4, 1, 8],
    (1024, 4096, 64, 16): [64, 128, 4, 1, 64],
    (12288, 4096, 64, 16): [64, 64, 4, 1, 6],
    (4096, 12288, 64, 16): [64, 32, 4, 1, 16],
    (4096, 4096, 64, 32): [64, 128, 4, 1, 4],
    (1024, 4096, 64, 32): [64, 128, 4, 1, 32],
    (12288, 4096, 64, 32): [128, 64, 4, 1, 6],
    (4096, 12288, 64, 32): [128, 64, 4, 1, 8],
}


def config(rows: int, n: int, k: int, blocksize: int, device: torch.device) -> list[int]:
    """[block_n, block_kh, warps, stages, split]: `TUNED_SM90`'s measured settings where it has the shape and the
    GPU is sm_90, else `rule_config`'s."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == MEASURED_MAJOR:
        tuned = TUNED_SM90.get((n, k, blocksize, block_rows(rows)))
        if tuned is not None:
            return list(tuned)
    return rule_config(rows, n, k, blocksize, device)


def rule_config(rows: int, n: int, k: int, blocksize: int, device: torch.device) -> list[int]:
    """The settings by rule, reasoned from sm_90 builds (Triton 3.6 and 3.8): steps of 64 x 64 packed bytes (32 x
    128 for blocksize 256) over 4 warps, 32 bytes a thread, 80-180 registers without spills (8 warps for blocksize
    256 past 16 rows, which spill on 4), so several programs an SM, each with its next step's bytes in flight; 1
    stage, since with more Triton's pipeliner stages every table lookup through shared memory, 4 bytes a copy; K
    split until the grid has about `PROGRAMS_PER_SM` programs an SM. Near, not at, the best settings an H200 sweep
    found per shape (benchmarks/NOTES.md). Small tiles in the interpreter."""
    if device.type != "cuda":
        return interpreter_config(k, blocksize)
    block_n, tile, warps = tile_shape(rows, blocksize)
    return [block_n, tile, warps, 1, split_k(rows, n, k, block_n, tile, device)]


def tile_shape(rows: int, blocksize: int) -> tuple[int, int, int]:
    """(block_n, packed bytes a step, warps) on a GPU; `rule_config` says why."""
    tile = max(blocksize // 2, TILE_PAIRS)
    return 4096 // tile, tile, 8 if tile > 64 and rows > 16 else 4


def interpreter_config(k: int, blocksize: int) -> list[int]:
    """Small tiles, one block a step, K split in two where it can be: the code paths, quickly, on a CPU."""
    return [32, blocksize // 2, 4, 1, min(2, k // blocksize)]


def split_k(rows: int, n: int, k: int, block_n: int, tile: int, device: torch.device) -> int:
    """K splits that bring the grid to about PROGRAMS_PER_SM programs per SM, at most one per tile."""
    programs = -(-n // block_n) * -(-rows // block_rows(rows))
    return max(1, min(-(-k // (2 * tile)), round(PROGRAMS_PER_SM * _sms(device) / programs)))


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def block_rows(rows: int) -> int:
    return min(64, max(16, 1 << (rows - 1).bit_length()))  # tl.dot takes 16 rows at least
