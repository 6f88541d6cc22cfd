"""An nf4 token-step kernel whose table lookups are warp shuffles, not loads: an experiment beside the product's
kernel (`vlmrl.engine.rollout.nf4`), for `benchmarks/nf4_matmul.py --kernels v2,shuffle`.

Why: the product's tile loop is bound by its own instructions (benchmarks/NOTES.md, "What the nf4 kernel waits
on"), and a third of them are its table lookups: each nibble's lookup is a global load with its own 64-bit
address (LEA, LEA.HI.X, LDG). Here every thread holds, once, the table value of its lane (lane l holds entry
l mod 16), and each lookup is one `shfl.sync.idx` that reads the value held by the lane whose number is the code:
no address, no memory. The values are the table's own float32 values, so the outputs are the product kernel's bit
for bit. The shuffles are inline PTX, so Triton's CPU interpreter cannot run them (it runs the product's loads);
only a GPU checks the values (`nf4_matmul.py`'s numerics table) and the time. Built offline for sm_90,
`python benchmarks/nf4_sass.py --kernel shuffle` counts the loop.

Public: `nf4_matmul_shuffle` (the arguments and values of `nf4.nf4_matmul`). The tile kernel is the product's
`nf4_tiles` with its two lookups replaced (the same settings, launch and split sum).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from vlmrl.engine.rollout import nf4, nf4_triton

from . import nf4_launch


def nf4_matmul_shuffle(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                       quant_state: Any = None, config: list[int] | None = None) -> torch.Tensor:
    """`nf4.nf4_matmul` with the table looked up by warp shuffles: the same arguments and values."""
    return nf4.call(_nf4_matmul_shuffle, x, weight, bias, quant_state, config)


@torch.library.custom_op("vlmrl::nf4_matmul_shuffle", mutates_args=())
def _nf4_matmul_shuffle(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code2: torch.Tensor | None,
                        absmax2: torch.Tensor | None, offset: torch.Tensor | None, lut: torch.Tensor,
                        bias: torch.Tensor | None, blocksize: int, blocksize2: int, rounding: int,
                        config: list[int]) -> torch.Tensor:
    return nf4_launch.kernel_or_reference((x, packed, absmax, code2, absmax2, offset, lut, bias, blocksize,
                                           blocksize2, rounding, config), design="shuffle", tiles=_tiles)


_nf4_matmul_shuffle.register_fake(nf4.output_like)


def _config(rows: int, n: int, k: int, blocksize: int, device: torch.device) -> list[int]:
    """The product's settings for the shape (its tile loop's shape is the product's)."""
    return nf4._config(rows, n, k, blocksize, device)


@functools.cache
def _tiles(interpret: bool) -> Any:
    """The product's tile kernel with shuffled lookups (the product's own where `interpret`: no PTX there)."""
    if interpret:
        return nf4_triton.kernels(True)[0]
    import triton
    import triton.language as tl

    nf4_triton.kernels(interpret)
    globals().update(dot_operand=nf4_triton.dot_operand, store_tile=nf4_triton.store_tile,
                     block_scales=nf4_triton.block_scales, times_x=nf4_triton.times_x, tl=tl)

    @triton.jit
    def lane_of(like):
        # each element: the number of the lane holding it (the input only gives the shape and layout)
        return tl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r", [like], dtype=tl.int32, is_pure=True,
                                         pack=1)

    globals()["lane_of"] = lane_of

    @triton.jit
    def looked_up(held, code):
        # the float32 `held` by lane `code` (0-15) of this warp: every lane holds entry (its lane mod 16)
        bits = tl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;", "=r,r,r",
                                         [held, code], dtype=tl.int32, is_pure=True, pack=1)
        return bits.to(tl.float32, bitcast=True)

    globals()["looked_up"] = looked_up

    @triton.jit
    def nf4_tiles_shuffle(X, Packed, Absmax, Code2, Absmax2, Offset, Lut, Bias, Out, M, N, K, stride_x, per_split,
                          BLOCKSIZE2: tl.constexpr, HALF: tl.constexpr, NB: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_M: tl.constexpr, NESTED: tl.constexpr, HAS_BIAS: tl.constexpr,
                          PARTIAL: tl.constexpr, WQ: tl.constexpr, XQ: tl.constexpr, EXACT: tl.constexpr,
                          EVEN: tl.constexpr):
        # nf4_triton.nf4_tiles' loop (its comments say what each step does), but for the lookups
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
        bytes_ = Packed + n[:, None] * row + j[None, :]
        if EVEN:
            following = tl.load(bytes_ + start, mask=n_ok[:, None], other=0)
        else:
            following = tl.load(bytes_ + start, mask=n_ok[:, None] & (start + j < end)[None, :], other=0)
        # the table value of each element's lane, in the codes' own layout (made from their first tile), once
        held = tl.load(Lut + (lane_of(following.to(tl.int32)) & 15)).to(tl.int32, bitcast=True)
        for kh in range(start, end, KH):
            q = following.to(tl.int32)
            if EVEN:
                following = tl.load(bytes_ + tl.minimum(kh + KH, end - KH), mask=n_ok[:, None], other=0)
            else:
                following = tl.load(bytes_ + kh + KH, mask=n_ok[:, None] & (kh + j + KH < end)[None, :], other=0)
            scale = block_scales(Absmax, Code2, Absmax2, offset, n, n_ok, blocks, kh, j, BLOCKSIZE2,  # noqa: F821
                                 HALF, NB, BLOCK_N, KH, NESTED)
            high = dot_operand(looked_up(held, q >> 4) * scale, WQ, XQ, X.dtype.element_ty, EXACT)  # noqa: F821
            low = dot_operand(looked_up(held, q & 15) * scale, WQ, XQ, X.dtype.element_ty, EXACT)  # noqa: F821
            acc = times_x(acc, high, low, X, m, m_ok, stride_x, kh, end, BLOCK_N, KH, EVEN, EXACT)  # noqa: F821
        store_tile(acc, Out, Bias, n, m, n_ok, m_ok, M, N, PARTIAL, HAS_BIAS, XQ, EXACT)  # noqa: F821

    return nf4_tiles_shuffle
