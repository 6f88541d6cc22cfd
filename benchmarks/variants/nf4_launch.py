"""The nf4 token-step kernel's launch as the variants need it, built on the product's public pieces
(`vlmrl.engine.rollout.nf4`, `nf4_triton`) from outside: the product's `launch` with the tile kernel and its settings
given (the first design, `nf4_v1`) and a LoRA branch added in the split sum (`nf4_lora`), which then runs this
module's own split-sum kernel instead of the product's.

Public: `call` (the product's `nf4.call` with the custom op's extra arguments before `blocksize`),
`kernel_or_reference(args, design=..., tiles=..., chooser=..., lora=...)` (a launch, or dequantize + matmul where it
cannot run, recorded once per device, dtype and design in `_failed`), `failure(x, design)`, `launch`, `splits`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from vlmrl.engine.rollout import nf4, nf4_settings, nf4_triton
from vlmrl.engine.rollout.decode_attention import interpreted, kernel_or_fallback

log = logging.getLogger(__name__)
_failed: dict[tuple, str] = {}  # (device, dtype, design) -> why a design's kernel could not run there
_ROUNDING = {torch.bfloat16: 1, torch.float16: 2}  # as the product's: the weight's dtype -> the kernel's code


def call(op: Callable[..., torch.Tensor], x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
         quant_state: Any, config: list[int] | None, extra: tuple = ()) -> torch.Tensor:
    """Unpack `weight`'s quant state and call `op`, a custom op over (x, packed, absmax, code2, absmax2, offset,
    lut, bias, *extra, blocksize, blocksize2, rounding, config)."""
    qs = quant_state if quant_state is not None else weight.quant_state
    n, k = qs.shape
    packed = weight.data.view(torch.uint8).reshape(n, k // 2)
    if qs.nested:
        offset = qs.offset if isinstance(qs.offset, torch.Tensor) else torch.tensor(float(qs.offset))
        code2, absmax2, offset, blocksize2 = (qs.state2.code, qs.state2.absmax,
                                              offset.to(packed.device, torch.float32), qs.state2.blocksize)
    else:
        code2, absmax2, offset, blocksize2 = None, None, None, 1
    if bias is not None:
        bias = bias.to(x.dtype)
    out = op(x.reshape(-1, k), packed, qs.absmax, code2, absmax2, offset, qs.code, bias, *extra, qs.blocksize,
             blocksize2, _ROUNDING.get(qs.dtype, 0), list(config or []))
    return out.view(*x.shape[:-1], n)


def failure(x: torch.Tensor, design: str) -> str | None:
    """Why `design`'s kernel ("v1", "lora", "summed") fell back to torch on x's device and dtype; None if it has not."""
    return _failed.get((str(x.device), x.dtype, design))


def _reference(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code2: torch.Tensor | None,
               absmax2: torch.Tensor | None, offset: torch.Tensor | None, lut: torch.Tensor, bias: torch.Tensor | None,
               blocksize: int, blocksize2: int, rounding: int, config: list[int]) -> torch.Tensor:
    weight = nf4.dequantize(packed, absmax, code2, absmax2, offset, lut, blocksize, blocksize2)
    if rounding:  # bitsandbytes dequantizes to the weight's dtype, then casts to the activations'
        weight = weight.to(torch.bfloat16 if rounding == 1 else torch.float16)
    return F.linear(x, weight.to(x.dtype), bias)


def _product_tiles(interpret: bool) -> Any:
    return nf4_triton.kernels(interpret)[0]


def _product_settings(rows: int, n: int, k: int, blocksize: int, device: torch.device) -> list[int]:
    """The settings the product's launch chooses (`TUNED_SM90`'s where measured, else `rule_config`'s)."""
    return nf4_settings.config(rows, n, k, blocksize, device)


def kernel_or_reference(args: tuple, *, design: str, tiles: Callable[[bool], Any] = _product_tiles,
                        chooser: Callable[..., list[int]] = _product_settings,
                        lora: tuple[torch.Tensor, torch.Tensor | None, float] | None = None) -> torch.Tensor:
    """`launch(*args, ...)`, or dequantize + matmul (and the branch in torch) where it cannot run (recorded once
    per device, dtype and `design`)."""
    def reference() -> torch.Tensor:
        out = _reference(*args)
        if lora is None:
            return out
        xa, second, scale = lora
        branch = xa if second is None else F.linear(xa, second)
        return out + branch * scale  # PEFT's eager sum, each step rounded to x's dtype

    return kernel_or_fallback(_failed, (str(args[0].device), args[0].dtype, design),
                              lambda: launch(*args, tiles=tiles, chooser=chooser, lora=lora), reference,
                              what=f"nf4 matmul kernel ({design})", instead="dequantize + matmul", logger=log)


@functools.cache
def splits(interpret: bool) -> Any:
    """The split sum with a LoRA branch: the product's `nf4_splits`, then PEFT's sum after it (built on first use)."""
    import triton
    import triton.language as tl

    nf4_triton.kernels(interpret)  # puts `rounded` among nf4_triton's globals
    globals().update(rounded=nf4_triton.rounded, tl=tl)

    @triton.jit
    def nf4_splits_lora(Partial, Bias, Out, size, N, splits, XA, Second, rank, scale, HAS_BIAS: tl.constexpr,
                        SUMMED: tl.constexpr, XQ: tl.constexpr, EXACT: tl.constexpr, BLOCK: tl.constexpr):
        # the splits' shares summed in order, the bias added, rounded once; then the rank-space rows XA [M, rank]
        # times the second factor Second [N, rank] (SUMMED: XA is that product already, [M, N] in x's dtype),
        # rounded, scaled, rounded, added to the rounded base output and rounded (each rounding one PEFT's eager
        # forward makes)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < size
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(splits):
            acc += tl.load(Partial + s * size + i, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(Bias + i % N, mask=ok, other=0.0).to(tl.float32)
        if SUMMED:
            lora = tl.load(XA + i, mask=ok, other=0.0).to(tl.float32)
        else:
            row, col = i // N, i % N
            lora = tl.zeros((BLOCK,), dtype=tl.float32)
            for r in range(rank):
                a = tl.load(XA + row * rank + r, mask=ok, other=0.0).to(tl.float32)
                lora += a * tl.load(Second + col * rank + r, mask=ok, other=0.0).to(tl.float32)
        lora = rounded(rounded(lora, XQ, EXACT) * scale, XQ, EXACT)  # noqa: F821 (set above)
        acc = rounded(acc, XQ, EXACT) + lora  # noqa: F821
        tl.store(Out + i, rounded(acc, XQ, EXACT).to(Out.dtype.element_ty), mask=ok)  # noqa: F821

    return nf4_splits_lora


def launch(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code2: torch.Tensor | None,
           absmax2: torch.Tensor | None, offset: torch.Tensor | None, lut: torch.Tensor, bias: torch.Tensor | None,
           blocksize: int, blocksize2: int, rounding: int, config: list[int], *, tiles: Callable[[bool], Any],
           chooser: Callable[..., list[int]], lora: tuple[torch.Tensor, torch.Tensor | None, float] | None = None,
           ) -> torch.Tensor:
    """The product's `nf4.launch` with `tiles(interpret)` for its tile kernel and `chooser` for its settings (where
    `config` is empty). `lora` = (xa [rows, rank], second [n, rank], scale), or (the branch's output [rows, n], None,
    scale): the split sum (`splits`) adds that LoRA branch too, so the tiles then always write fp32 shares."""
    rows, k = x.shape
    n = packed.shape[0]
    if rows == 0:
        return x.new_empty((0, n))
    if x.dtype not in nf4.DTYPES:
        raise TypeError(f"activations in {x.dtype}: the kernel takes bf16/fp16")
    if x.stride(-1) != 1:
        x = x.contiguous()
    block_n, tile, warps, stages, split = config or chooser(rows, n, k, blocksize, x.device)
    half = blocksize // 2
    if tile % half:
        raise ValueError(f"tile of {tile} packed bytes is not a whole number of {blocksize}-weight blocks")
    steps = -(-k // (2 * tile))
    per_split = -(-steps // max(1, min(split, steps))) * tile  # packed bytes per split, whole tiles
    split = -(-(k // 2) // per_split)
    block_m = nf4_settings.block_rows(rows)
    out = torch.empty(rows, n, device=x.device, dtype=x.dtype)
    interpret = interpreted()
    main = tiles(interpret)
    nested = code2 is not None
    partial = split > 1 or lora is not None
    target = torch.empty(split, rows, n, device=x.device, dtype=torch.float32) if partial else out
    xq = 1 if x.dtype == torch.bfloat16 else 2
    grid = (-(-n // block_n), split, -(-rows // block_m))
    main[grid](x, packed, absmax, code2 if nested else absmax, absmax2 if nested else absmax,
               offset if nested else absmax, lut, bias if bias is not None else out, target,
               rows, n, k, x.stride(0), per_split, BLOCKSIZE2=blocksize2, HALF=half, NB=tile // half,
               BLOCK_N=block_n, BLOCK_M=block_m, NESTED=nested, HAS_BIAS=bias is not None and not partial,
               PARTIAL=partial, WQ=rounding, XQ=xq, EXACT=interpret, EVEN=(k // 2) % tile == 0,
               num_warps=warps, num_stages=stages, enable_fp_fusion=False)  # round a*b and +c apart, as bnb does
    if not partial:
        return out
    if lora is None:
        nf4.sum_splits(target, bias, out, xq, interpret)
        return out
    size, block = rows * n, 1024
    grid = (-(-size // block),)
    bias_or_out = bias if bias is not None else out
    xa, second, scale = lora
    summed = second is None
    splits(interpret)[grid](target, bias_or_out, out, size, n, split, xa, xa if summed else second,
                            0 if summed else second.shape[-1], scale, HAS_BIAS=bias is not None, SUMMED=summed,
                            XQ=xq, EXACT=interpret, BLOCK=block, enable_fp_fusion=False)
    return out
