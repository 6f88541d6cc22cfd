"""The product's nf4 tile loop with its table lookups done another way, for A/B runs beside the product (whose
compiled loop looks the table up by warp shuffle, `nf4_triton`): "loads", the product's kernel with the table loads
it had before (`SHUFFLE` off); "shuffle", the product's kernel with its shuffles forced on, unchecked; both with a
split K summed by a second kernel, as before the product summed it in the tile kernel; "pairs", one
lookup a byte in a table of weight pairs (`nf4_pairs`), a loop of this module's own. What each was worth:
benchmarks/NOTES.md ("What the nf4 kernel waits on").

- `tiles(design)`: `(interpret) -> kernel` for `nf4_launch.launch`; its `kernel[grid](...)` takes the product's
  arguments.
- `lookup_matmul(design, table)`: the arguments and values of `nf4.nf4_matmul` through that loop, as a custom op
  (`vlmrl::nf4_matmul_<design>`); `table(lut)` is the table the kernel is given (the reference where Triton cannot
  run reads its first 16 values).
- `LOOKUPS`: the settings each design adds to the kernel's arguments (what `benchmarks/nf4_sass.py` builds it with).
Triton's CPU interpreter cannot run PTX, so there "shuffle" runs the loads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from vlmrl.engine.rollout import nf4, nf4_triton

from . import nf4_launch

LOOKUPS: dict[str, dict[str, Any]] = {"loads": {"SHUFFLE": False}, "shuffle": {"SHUFFLE": True}, "pairs": {},
                                      "words": {"SHUFFLE": True}}


class _Bound:
    """A tile kernel launched with settings added: `bound[grid](...)` as `kernel[grid](..., **settings)`."""

    def __init__(self, kernel: Any, settings: dict[str, Any]):
        self.kernel, self.settings = kernel, settings

    def __getitem__(self, grid: tuple) -> Callable[..., Any]:
        return functools.partial(self.kernel[grid], **self.settings)


def tiles(design: str) -> Callable[[bool], Any]:
    """`(interpret) -> kernel` with `design`'s lookups, for `nf4_launch.launch`."""
    def built(interpret: bool) -> _Bound:
        if design == "pairs":
            return _Bound(kernel(interpret), {})
        if design == "words":
            return _Bound(words_kernel(interpret), {"SHUFFLE": not interpret})
        return _Bound(nf4_triton.kernels(interpret)[0], {"SHUFFLE": LOOKUPS[design]["SHUFFLE"] and not interpret,
                                                          "Final": None, "Counters": None, "SPLITS": 0})
    return built


def lookup_matmul(design: str, table: Callable[[torch.Tensor], torch.Tensor] = lambda lut: lut) -> Callable:
    """`nf4.nf4_matmul`'s arguments and values through the loop with `design`'s lookups (see the module's text)."""
    @torch.library.custom_op(f"vlmrl::nf4_matmul_{design}", mutates_args=())
    def op(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code2: torch.Tensor | None,
           absmax2: torch.Tensor | None, offset: torch.Tensor | None, lut: torch.Tensor, bias: torch.Tensor | None,
           blocksize: int, blocksize2: int, rounding: int, config: list[int]) -> torch.Tensor:
        return nf4_launch.kernel_or_reference((x, packed, absmax, code2, absmax2, offset, table(lut), bias, blocksize,
                                               blocksize2, rounding, config), design=design, tiles=tiles(design))

    op.register_fake(nf4.output_like)

    def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               quant_state: Any = None, config: list[int] | None = None) -> torch.Tensor:
        return nf4.call(op, x, weight, bias, quant_state, config)

    matmul.__name__ = f"nf4_matmul_{design}"
    return matmul


@functools.cache
def kernel(interpret: bool) -> Any:
    """The tile kernel whose lookups read the pair table (built on first use beside the product's)."""
    import triton
    import triton.language as tl

    nf4_triton.kernels(interpret)  # builds rounded, dot_operand and store_tile for this `interpret`
    globals().update(dot_operand=nf4_triton.dot_operand, store_tile=nf4_triton.store_tile,
                     block_scales=nf4_triton.block_scales, times_x=nf4_triton.times_x, tl=tl)

    @triton.jit
    def nf4_tiles_pairs(X, Packed, Absmax, Code2, Absmax2, Offset, Lut, Bias, Out, M, N, K, stride_x, per_split,
                        BLOCKSIZE2: tl.constexpr, HALF: tl.constexpr, NB: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_M: tl.constexpr, NESTED: tl.constexpr, HAS_BIAS: tl.constexpr,
                        PARTIAL: tl.constexpr, WQ: tl.constexpr, XQ: tl.constexpr, EXACT: tl.constexpr,
                        EVEN: tl.constexpr):
        # nf4_triton.nf4_tiles' loop (its comments say what each step does), but for the lookups: Lut is
        # nf4_pairs.pair_table's, whose 8-byte entry 16 / 2 + b holds byte b's two table values.
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
        pairs = (Lut + 16).to(tl.pointer_type(tl.int64))
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


@functools.cache
def words_kernel(interpret: bool) -> Any:
    """The tile kernel that decodes the packed bytes a 32-bit word at a time (`nf4_words`; built on first use)."""
    import triton
    import triton.language as tl

    nf4_triton.kernels(interpret)  # builds the product's device helpers for this `interpret`
    globals().update(dot_operand=nf4_triton.dot_operand, store_tile=nf4_triton.store_tile,
                     block_scales=nf4_triton.block_scales, lane_table=nf4_triton.lane_table,
                     held_by=nf4_triton.held_by, tl=tl)

    @triton.jit
    def nibble(held, Lut, w, SHIFT: tl.constexpr, SHUFFLE: tl.constexpr):
        # the table value of the nibble at bits SHIFT..SHIFT+3 of the words w. A shuffle reads its lane from the
        # index's low 5 bits alone, and lane l holds entry l mod 16 (`lane_table`), so the shifted word itself is
        # the index: the bit above the nibble only picks the lane's twin. The loads mask it.
        if SHUFFLE:
            return held_by(held, w >> SHIFT)  # noqa: F821 (set above)
        return tl.load(Lut + ((w >> SHIFT) & 15))

    globals()["nibble"] = nibble  # a kernel finds the functions it calls among its module's globals

    @triton.jit
    def nf4_tiles_words(X, Packed, Absmax, Code2, Absmax2, Offset, Lut, Bias, Out, M, N, K, stride_x, per_split,
                        BLOCKSIZE2: tl.constexpr, HALF: tl.constexpr, NB: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_M: tl.constexpr, NESTED: tl.constexpr, HAS_BIAS: tl.constexpr,
                        PARTIAL: tl.constexpr, WQ: tl.constexpr, XQ: tl.constexpr, EXACT: tl.constexpr,
                        EVEN: tl.constexpr, SHUFFLE: tl.constexpr):
        # nf4_triton.nf4_tiles' loop (its comments say what each step does), but the packed bytes are read as
        # int32 words, [BLOCK_N, KH / 4] a step, and each word's 8 nibbles are looked up straight from the word
        # shifted (one shift and one lookup a weight: no byte unpacking, no mask), then joined back into the row's
        # order: weight 2b is byte b's high nibble (bits 8b + 4), 2b + 1 its low one (bits 8b). A word's 4 bytes lie
        # in one block (HALF >= 16 bytes), so its scale is one value.
        KH: tl.constexpr = NB * HALF
        KW: tl.constexpr = KH // 4  # words per row per step
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        n_ok, m_ok = n < N, m < M
        blocks = K // (2 * HALF)
        row = blocks * HALF
        j = tl.arange(0, KW)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        start = tl.program_id(1) * per_split
        end = tl.multiple_of(tl.minimum(start + per_split, row), HALF)
        offset = tl.load(Offset) if NESTED else 0.0
        words = Packed.to(tl.pointer_type(tl.int32)) + n[:, None] * (row // 4) + j[None, :]
        if EVEN:
            following = tl.load(words + start // 4, mask=n_ok[:, None], other=0)
        else:
            following = tl.load(words + start // 4, mask=n_ok[:, None] & (start // 4 + j < end // 4)[None, :],
                                other=0)
        held = lane_table(Lut, following) if SHUFFLE else following  # noqa: F821 (set above)
        ty = X.dtype.element_ty
        for kh in range(start, end, KH):
            w = following
            if EVEN:
                following = tl.load(words + tl.minimum(kh + KH, end - KH) // 4, mask=n_ok[:, None], other=0)
            else:
                following = tl.load(words + (kh + KH) // 4,
                                    mask=n_ok[:, None] & ((kh + KH) // 4 + j < end // 4)[None, :], other=0)
            scale = block_scales(Absmax, Code2, Absmax2, offset, n, n_ok, blocks, kh, 4 * j,  # noqa: F821
                                 BLOCKSIZE2, HALF, NB, BLOCK_N, KW, NESTED)
            v0 = dot_operand(nibble(held, Lut, w, 4, SHUFFLE) * scale, WQ, XQ, ty, EXACT)  # noqa: F821
            v1 = dot_operand(nibble(held, Lut, w, 0, SHUFFLE) * scale, WQ, XQ, ty, EXACT)  # noqa: F821
            v2 = dot_operand(nibble(held, Lut, w, 12, SHUFFLE) * scale, WQ, XQ, ty, EXACT)  # noqa: F821
            v3 = dot_operand(nibble(held, Lut, w, 8, SHUFFLE) * scale, WQ, XQ, ty, EXACT)  # noqa: F821
            v4 = dot_operand(nibble(held, Lut, w, 20, SHUFFLE) * scale, WQ, XQ, ty, EXACT)  # noqa: F821
            v5 = dot_operand(nibble(held, Lut, w, 16, SHUFFLE) * scale, WQ, XQ, ty, EXACT)  # noqa: F821
            v6 = dot_operand(nibble(held, Lut, w, 28, SHUFFLE) * scale, WQ, XQ, ty, EXACT)  # noqa: F821
            v7 = dot_operand(nibble(held, Lut, w, 24, SHUFFLE) * scale, WQ, XQ, ty, EXACT)  # noqa: F821
            # [BLOCK_N, KW, 2, 2, 2]: index (a, b, c) is the word's weight 4a + 2b + c, so the reshape is row order
            weights = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
            weights = tl.reshape(weights, (BLOCK_N, 2 * KH))
            t = 2 * kh + tl.arange(0, 2 * KH)
            xk = X + m[None, :] * stride_x + t[:, None]
            if EVEN:
                xs = tl.load(xk, mask=m_ok[None, :], other=0.0)
            else:
                xs = tl.load(xk, mask=m_ok[None, :] & (t < 2 * end)[:, None], other=0.0)
            if EXACT:
                xs = xs.to(tl.float32)
            acc = tl.dot(weights, xs, acc)
        store_tile(acc, Out, Bias, n, m, n_ok, m_ok, M, N, PARTIAL, HAS_BIAS, XQ, EXACT)  # noqa: F821

    return nf4_tiles_words
