"""The product's nf4 tile loop with its table lookups done another way, for A/B runs beside the product (whose
compiled loop reads the packed bytes as words and looks the table up by warp shuffle, `nf4_triton`): "loads", the
product's kernel with table loads (`SHUFFLE` off); "shuffle", the product's kernel with its shuffles forced on,
unchecked; both with a split K summed by a second kernel, as before the product summed it in the tile kernel;
"bytes", the product's loop as it was before it read words (a byte at a time, `nf4_bytes`), its split K so summed
("byte-loads": the same with table loads, the loop before the shuffles);
"pairs", one lookup a byte in a table of weight pairs (`nf4_pairs`). The last two are loops of this module's own.
What each was worth: benchmarks/NOTES.md ("What the nf4 kernel waits on").

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

LOOKUPS: dict[str, dict[str, Any]] = {"loads": {"SHUFFLE": False}, "shuffle": {"SHUFFLE": True},
                                      "pairs": {"SHUFFLE": False, "PAIRS": True},
                                      "bytes": {"SHUFFLE": True, "PAIRS": False},
                                      "byte-loads": {"SHUFFLE": False, "PAIRS": False}}


class _Bound:
    """A tile kernel launched with settings added: `bound[grid](...)` as `kernel[grid](..., **settings)`."""

    def __init__(self, kernel: Any, settings: dict[str, Any]):
        self.kernel, self.settings = kernel, settings

    def __getitem__(self, grid: tuple) -> Callable[..., Any]:
        return functools.partial(self.kernel[grid], **self.settings)


def runs_byte_loop(design: str) -> bool:
    """Whether `design`'s loop is `byte_loop` (its settings name `PAIRS`), not the product's word loop."""
    return "PAIRS" in LOOKUPS.get(design, {})


def tiles(design: str) -> Callable[[bool], Any]:
    """`(interpret) -> kernel` with `design`'s lookups, for `nf4_launch.launch`."""
    def built(interpret: bool) -> _Bound:
        settings = LOOKUPS[design] | {"SHUFFLE": LOOKUPS[design]["SHUFFLE"] and not interpret}
        if runs_byte_loop(design):
            return _Bound(byte_loop(interpret), settings)
        return _Bound(nf4_triton.kernels(interpret)[0], settings | {"Final": None, "Counters": None, "SPLITS": 0})
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
def byte_loop(interpret: bool) -> Any:
    """The tile kernel that decodes a byte at a time, the product's loop before it read words: "bytes" (each nibble
    looked up apart, by warp shuffle or load) and, with `PAIRS`, "pairs" (built on first use beside the product's)."""
    import triton
    import triton.language as tl

    nf4_triton.kernels(interpret)  # builds the product's device helpers for this `interpret`
    globals().update(dot_operand=nf4_triton.dot_operand, store_tile=nf4_triton.store_tile,
                     block_scales=nf4_triton.block_scales, times_x=nf4_triton.times_x,
                     lane_table=nf4_triton.lane_table, held_by=nf4_triton.held_by, tl=tl)

    @triton.jit
    def nf4_tiles_bytes(X, Packed, Absmax, Code2, Absmax2, Offset, Lut, Bias, Out, M, N, K, stride_x, per_split,
                        BLOCKSIZE2: tl.constexpr, HALF: tl.constexpr, NB: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_M: tl.constexpr, NESTED: tl.constexpr, HAS_BIAS: tl.constexpr,
                        PARTIAL: tl.constexpr, WQ: tl.constexpr, XQ: tl.constexpr, EXACT: tl.constexpr,
                        EVEN: tl.constexpr, SHUFFLE: tl.constexpr, PAIRS: tl.constexpr):
        # nf4_triton.nf4_tiles' loop (its comments say what each step does) as it was before it read words: packed
        # bytes [BLOCK_N, KH] a step, each byte's high nibble (q >> 4) and low one (q & 15) looked up apart (by
        # shuffle or load), or (PAIRS) the byte itself looked up once: Lut is then nf4_pairs.pair_table's, whose
        # 8-byte entry 16 / 2 + b holds byte b's two table values; decoded into two [BLOCK_N, KH] tiles (weights 2c
        # and 2c + 1) and joined back into [BLOCK_N, 2 KH] in the row's order
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
        held = lane_table(Lut, following.to(tl.int32)) if SHUFFLE else following  # noqa: F821 (set above)
        pairs = (Lut + 16).to(tl.pointer_type(tl.int64))
        ty = X.dtype.element_ty
        for kh in range(start, end, KH):
            q = following.to(tl.int32)
            if EVEN:
                following = tl.load(bytes_ + tl.minimum(kh + KH, end - KH), mask=n_ok[:, None], other=0)
            else:
                following = tl.load(bytes_ + kh + KH, mask=n_ok[:, None] & (kh + j + KH < end)[None, :], other=0)
            scale = block_scales(Absmax, Code2, Absmax2, offset, n, n_ok, blocks, kh, j, BLOCKSIZE2,  # noqa: F821
                                 HALF, NB, BLOCK_N, KH, NESTED)
            if PAIRS:
                pair = tl.load(pairs + q)  # little-endian: the first value in the low word
                first = (pair & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
                second = (pair >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
            elif SHUFFLE:
                first, second = held_by(held, q >> 4), held_by(held, q & 15)  # noqa: F821
            else:
                first, second = tl.load(Lut + (q >> 4)), tl.load(Lut + (q & 15))
            high = dot_operand(first * scale, WQ, XQ, ty, EXACT)  # noqa: F821
            low = dot_operand(second * scale, WQ, XQ, ty, EXACT)  # noqa: F821
            acc = times_x(acc, tl.reshape(tl.join(high, low), (BLOCK_N, 2 * KH)), X, m, m_ok,  # noqa: F821
                          stride_x, kh, end, KH, EVEN, EXACT)
        store_tile(acc, Out, Bias, n, m, n_ok, m_ok, M, N, PARTIAL, HAS_BIAS, XQ, EXACT)  # noqa: F821

    return nf4_tiles_bytes
