"""An nf4 token-step kernel that looks each packed byte up once: a 256-entry table of weight pairs, not two lookups
of a nibble each. An experiment beside the product's kernel (`vlmrl.engine.rollout.nf4`), for `benchmarks/nf4_matmul.py
--kernels v2,pairs`.

Why: under Nsight Compute the product's tile loop is bound by its own instructions (benchmarks/NOTES.md, "What the
nf4 kernel waits on"): each nibble's lookup is a global load with its own 64-bit address (LEA, LEA.HI.X, LDG) after
a shift or mask. Here the byte itself is the index into 256 (first, second) float32 pairs, one 8-byte load a byte;
the pair's halves are the two weights' table values, exactly those of the 16-value table, so the values are the
product's (bitsandbytes' dequantize-then-matmul up to summation order). Built offline for sm_90 the loop takes
fewer instructions per weight (benchmarks/NOTES.md has the counts). What it may cost instead: a warp's 32 lookups now land on up to 16 of the
2 KB table's cache lines, where the 16-value table fits one, so L1 serves each load in several passes; only a GPU
run says which wins.

Public: `nf4_matmul_pairs` (the arguments and values of `nf4.nf4_matmul`), `pair_table(lut)`. The tile kernel is the
product's `nf4_tiles` with its two lookups replaced (the same settings, launch and split sum).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from vlmrl.engine.rollout import nf4, nf4_triton

from . import nf4_launch

_tables: dict[tuple, torch.Tensor] = {}  # (device, the table's address) -> its pair table, made once


def pair_table(lut: torch.Tensor) -> torch.Tensor:
    """float32 [16 + 512]: the 16-value table, then for each byte b the pair (lut[b >> 4], lut[b & 15]), the weights
    of its high nibble (first in a row) and its low one. Made once per table (a CUDA graph replays its address)."""
    key = (str(lut.device), lut.data_ptr())
    if key not in _tables:
        b = torch.arange(256, device=lut.device)
        pairs = torch.stack([lut[b >> 4], lut[b & 15]], dim=1).float().reshape(-1)
        _tables[key] = torch.cat([lut.float(), pairs])
    return _tables[key]


def nf4_matmul_pairs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                     quant_state: Any = None, config: list[int] | None = None) -> torch.Tensor:
    """`nf4.nf4_matmul` with one table lookup a byte: the same arguments and values."""
    return nf4.call(_nf4_matmul_pairs, x, weight, bias, quant_state, config)


@torch.library.custom_op("vlmrl::nf4_matmul_pairs", mutates_args=())
def _nf4_matmul_pairs(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code2: torch.Tensor | None,
                      absmax2: torch.Tensor | None, offset: torch.Tensor | None, lut: torch.Tensor,
                      bias: torch.Tensor | None, blocksize: int, blocksize2: int, rounding: int,
                      config: list[int]) -> torch.Tensor:
    # the extended table's first 16 values are the table itself, so the reference (where Triton cannot run) reads it
    return nf4_launch.kernel_or_reference((x, packed, absmax, code2, absmax2, offset, pair_table(lut), bias,
                                           blocksize, blocksize2, rounding, config), design="pairs", tiles=_tiles)


_nf4_matmul_pairs.register_fake(nf4.output_like)


def _config(rows: int, n: int, k: int, blocksize: int, device: torch.device) -> list[int]:
    """The product's settings for the shape (its tile loop's shape is the product's)."""
    return nf4._config(rows, n, k, blocksize, device)


@functools.cache
def _tiles(interpret: bool) -> Any:
    """The product's tile kernel with one lookup a byte (built on first use beside the product's)."""
    import triton
    import triton.language as tl

    nf4_triton.kernels(interpret)  # builds rounded, dot_operand and store_tile for this `interpret`
    globals().update(dot_operand=nf4_triton.dot_operand, store_tile=nf4_triton.store_tile,
                     block_scales=nf4_triton.block_scales, times_x=nf4_triton.times_x, tl=tl)

    @triton.jit
    def nf4_tiles_pairs(X, Packed, Absmax, Code2, Absmax2, Offset, Lut, Bias, Out, M, N, K, stride_x, per_split,
                        BLOCKSIZE2: tl.constexpr, HALF: tl.constexpr, NB: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_M: tl.constexpr, NESTED: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                        WQ: tl.constexpr, XQ: tl.constexpr, EXACT: tl.constexpr, EVEN: tl.constexpr):
        # nf4_triton.nf4_tiles' loop (its comments say what each step does), but for the lookups: Lut is
        # `pair_table`'s, whose 8-byte entry 16 / 2 + b holds byte b's two table values
        KH: tl.constexpr = NB * HALF
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        n_ok, m_ok = n < N, m < M
        blocks = K // (2 * HALF)
        row = blocks * HALF
        j = tl.arange(0, KH)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        start = tl.program_id(1) * per_split
        end = tl.multiple_of(tl.minimum(start + per_split, row), HALF)
        offset = tl.load(Offset) if NESTED else 0.0
        pairs = (Lut + 16).to(tl.pointer_type(tl.int64))
        bytes_ = Packed + n[:, None] * row + j[None, :]
        if EVEN:
            following = tl.load(bytes_ + start, mask=n_ok[:, None], other=0)
        else:
            following = tl.load(bytes_ + start, mask=n_ok[:, None] & (start + j < end)[None, :], other=0)
        for kh in range(start, end, KH):
            q = following.to(tl.int32)
            if EVEN:
                following = tl.load(bytes_ + tl.minimum(kh + KH, end - KH), mask=n_ok[:, None], other=0)
            else:
                following = tl.load(bytes_ + kh + KH, mask=n_ok[:, None] & (kh + j + KH < end)[None, :], other=0)
            scale = block_scales(Absmax, Code2, Absmax2, offset, n, n_ok, blocks, kh, j, BLOCKSIZE2,  # noqa: F821
                                 HALF, NB, BLOCK_N, KH, NESTED)
            pair = tl.load(pairs + q)  # little-endian: the first value in the low word
            first = (pair & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
            second = (pair >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
            high = dot_operand(first * scale, WQ, XQ, X.dtype.element_ty, EXACT)  # noqa: F821 (set above)
            low = dot_operand(second * scale, WQ, XQ, X.dtype.element_ty, EXACT)  # noqa: F821
            acc = times_x(acc, high, low, X, m, m_ok, stride_x, kh, end, BLOCK_N, KH, EVEN, EXACT)  # noqa: F821
        store_tile(acc, Out, Bias, n, m, n_ok, m_ok, M, N, PARTIAL, HAS_BIAS, XQ, EXACT)  # noqa: F821

    return nf4_tiles_pairs
