"""The nf4 token-step kernel's first design, which the one in `vlmrl.engine.rollout.nf4` replaced: each byte's two
nibbles joined into k order in 3-D tiles [block_n, blocks per step, half a block], then one dot per step. The same
values as the product kernel (bitsandbytes' dequantize-then-matmul up to summation order, tests/test_nf4.py). On an
H200, at its best one-stage settings, within about 10% of the product kernel's per projection and slower on the
large ones; only the product's design was measured in rollouts (benchmarks/NOTES.md, "The nf4 token-step kernel").
Kept for `benchmarks/nf4_matmul.py` and the `vlmrl-nf4-v1` bench path.

Public: `nf4_matmul_v1` (the arguments of `vlmrl.engine.rollout.nf4.nf4_matmul`; `config` = [block_n, tile_pairs,
warps, stages, split]); `nf4_decode_with(model, matmul)`, the product's `nf4_decode` routing through another matmul
(this one, or the product's with other settings), built from outside on `nf4`'s public pieces. Limits: those of
`vlmrl.engine.rollout.nf4`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from vlmrl.engine.rollout import nf4, nf4_settings, nf4_triton

from . import nf4_launch


def nf4_matmul_v1(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  quant_state: Any = None, config: list[int] | None = None) -> torch.Tensor:
    """`nf4.nf4_matmul` by the first design: the same arguments and values, up to summation order."""
    return nf4.call(_nf4_matmul_v1, x, weight, bias, quant_state, config)


@torch.library.custom_op("vlmrl::nf4_matmul_v1", mutates_args=())
def _nf4_matmul_v1(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code2: torch.Tensor | None,
                   absmax2: torch.Tensor | None, offset: torch.Tensor | None, lut: torch.Tensor,
                   bias: torch.Tensor | None, blocksize: int, blocksize2: int, rounding: int,
                   config: list[int]) -> torch.Tensor:
    return nf4_launch.kernel_or_reference((x, packed, absmax, code2, absmax2, offset, lut, bias, blocksize,
                                           blocksize2, rounding, config), design="v1", tiles=_tiles, chooser=_config)


_nf4_matmul_v1.register_fake(nf4.output_like)


def _config(rows: int, n: int, k: int, blocksize: int, device: torch.device) -> list[int]:
    """[block_n, tile_pairs, warps, stages, split]: 64 outputs over 4 warps, one pipeline stage (with more,
    Triton stages every table lookup through shared memory, several times slower), and enough K splits to keep
    every SM streaming; small tiles in the interpreter. Chosen from an H200 sweep (benchmarks/NOTES.md, "The nf4
    token-step kernel")."""
    if device.type != "cuda":
        return nf4_settings.interpreter_config(k, blocksize)
    block_n, tile = 64, max(blocksize // 2, nf4_settings.TILE_PAIRS)
    return [block_n, tile, 4, 1, nf4_settings.split_k(rows, n, k, block_n, tile, device)]


@functools.cache
def _tiles(interpret: bool) -> Any:
    """The first design's tile kernel, built on first use beside the product's (whose device helpers it calls)."""
    import triton
    import triton.language as tl

    nf4_triton.kernels(interpret)  # builds rounded, dot_operand and store_tile for this `interpret`
    globals().update(dot_operand=nf4_triton.dot_operand, store_tile=nf4_triton.store_tile, tl=tl)

    @triton.jit
    def nf4_tiles_v1(X, Packed, Absmax, Code2, Absmax2, Offset, Lut, Bias, Out, M, N, K, stride_x, per_split,
                     BLOCKSIZE2: tl.constexpr, HALF: tl.constexpr, NB: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_M: tl.constexpr, NESTED: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                     WQ: tl.constexpr, XQ: tl.constexpr, EXACT: tl.constexpr, EVEN: tl.constexpr):
        # (EVEN, whole steps only, is v2's and unused here)
        # out[m, n] (or split s's share, fp32) = sum over this split's k of x[m, k] * W[n, k]; W[n, k] is the
        # nibble k % 2 (high first) of byte n * K/2 + k // 2, times absmax[(n * K + k) // blocksize].
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        n_ok, m_ok = n < N, m < M
        blocks = K // (2 * HALF)  # per weight row
        b, p, e = tl.arange(0, NB), tl.arange(0, HALF), tl.arange(0, 2 * NB * HALF)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # out transposed: the weight is the dot's left side
        start = tl.program_id(1) * per_split
        for kh in range(start, tl.minimum(start + per_split, K // 2), NB * HALF):
            block = n[:, None] * blocks + (kh // HALF + b)[None, :]  # [BLOCK_N, NB] absmax index
            ok = n_ok[:, None] & ((kh // HALF + b) < blocks)[None, :]
            q = tl.load(Packed + block[:, :, None] * HALF + p[None, None, :], mask=ok[:, :, None], other=0)
            if NESTED:
                code = tl.load(Absmax + block, mask=ok, other=0).to(tl.int32)
                scale = tl.load(Code2 + code) * tl.load(Absmax2 + block // BLOCKSIZE2, mask=ok, other=0.0)
                scale = scale + tl.load(Offset)
            else:
                scale = tl.load(Absmax + block, mask=ok, other=0.0)
            q = q.to(tl.int32)
            high = tl.load(Lut + (q >> 4)) * scale[:, :, None]
            low = tl.load(Lut + (q & 15)) * scale[:, :, None]
            w = tl.reshape(tl.join(high, low), (BLOCK_N, 2 * NB * HALF))  # [BLOCK_N, tile's k] in k order
            k = 2 * kh + e
            xt = tl.load(X + m[None, :] * stride_x + k[:, None], mask=m_ok[None, :] & (k < K)[:, None], other=0.0)
            if EXACT:
                xt = xt.to(tl.float32)
            acc = tl.dot(dot_operand(w, WQ, XQ, X.dtype.element_ty, EXACT), xt, acc)  # noqa: F821 (set above)
        store_tile(acc, Out, Bias, n, m, n_ok, m_ok, M, N, PARTIAL, HAS_BIAS, XQ, EXACT)  # noqa: F821

    return nf4_tiles_v1


@contextlib.contextmanager
def nf4_decode_with(model: torch.nn.Module, matmul: Callable[..., torch.Tensor], max_rows: int = nf4.MAX_ROWS,
                    min_rows: int = nf4.MIN_ROWS) -> Iterator[str | None]:
    """`nf4.nf4_decode(model)` with `matmul` (the arguments of `nf4.nf4_matmul`) in place of the product's kernel:
    while active, forwards of the `Linear4bit` layers it takes with `min_rows` to `max_rows` rows and no gradient
    run `matmul`; the rest run bitsandbytes' own forward. Yields `nf4.unsupported_reason(model)`."""
    reason = nf4.unsupported_reason(model)
    routed = [m for m in model.modules() if nf4.is_linear4bit(m) and nf4.layer_reason(m) is None] if reason is None \
        else []
    with nf4.forwards_replaced(routed, lambda layer, forward: _routed(layer, forward, matmul, min_rows, max_rows)):
        yield reason


def _routed(layer: torch.nn.Module, fallback: Callable[..., torch.Tensor], matmul: Callable[..., torch.Tensor],
            min_rows: int, max_rows: int) -> Callable[..., Any]:
    """As the product routes a layer (`nf4._routed`), through `matmul`."""
    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        dtype = layer.compute_dtype if layer.compute_dtype is not None else x.dtype  # as bitsandbytes computes
        bias = layer.bias
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if (args or kwargs or not min_rows <= rows <= max_rows or dtype not in nf4.DTYPES
                or x.device != layer.weight.device
                or (torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)))):
            return fallback(x, *args, **kwargs)
        qs = getattr(layer.weight, "quant_state", None) or getattr(layer, "quant_state", None)
        return matmul(x.to(dtype), layer.weight, bias, quant_state=qs).to(x.dtype)

    return forward
