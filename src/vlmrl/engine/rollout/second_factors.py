"""The stacked projections' second step (`vlmrl.engine.rollout.stacked`) as one Triton kernel for a token step's few rows.

A stacked group's first matmul gives, per row, the base outputs and then the adapters' rank-space inputs side by
side. What follows is `base + scale * (first @ secondᵀ)`, `second` the group's block-diagonal second factors
(`stacked_second`; over a 4-bit base, whose members compute their base outputs apart, one member's at a time:
`added_second`; the stacked matmul and this step one after the other: `linear_and_second`). At a token step (a
few dozen rows) cuBLAS runs that small matmul (K = the group's summed ranks) bound by latency, not bandwidth, and
the scaled sum after it is another kernel, for every group of every layer (what that costs: benchmarks/NOTES.md).
Here one kernel reads the rank-space inputs, multiplies them by a tile of the second factors on the tensor cores,
scales, adds the base outputs and writes the outputs; one program per block of output columns (and of rows). On
with `train.rollout.kernels`.

Rounded as the unfused path rounds, in bf16 (fp16 stays on the unfused step): the product is rounded, then scaled
(a float, or one value per output column in bf16) and rounded, then added to the base outputs and rounded. Only the dot's
summation order differs from cuBLAS's. Like `decode_attention`, a `torch.library` custom op (one opaque node in a
compiled step and its CUDA graph) that falls back to the same arithmetic in torch, with one warning, where Triton
cannot build or launch it; on a CPU (tests) Triton's interpreter runs it.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F

from vlmrl.engine.rollout.decode_attention import HAS_TRITON, interpreted, kernel_or_fallback

log = logging.getLogger(__name__)
_failed: dict[tuple, str] = {}  # (device, dtype) -> why the kernel could not run there

MAX_ROWS = 64  # rows of a token step (the rollout batch); more rows (a prompt pass) stay on cuBLAS
BLOCK_M, BLOCK_N = 32, 64


def usable(outputs: torch.Tensor, second: torch.Tensor) -> bool:
    """True when the kernel computes this step: few rows, bf16, ranks up to 128, on CUDA (or the interpreter).
    `outputs`: the stacked output (or base outputs the kernel is given apart). Reads metadata only, so a compiled
    step traces it without a graph break."""
    rows = outputs.numel() // outputs.shape[-1] if outputs.shape[-1] else 0
    return (
        HAS_TRITON
        and 0 < rows <= MAX_ROWS
        and outputs.dtype == torch.bfloat16
        and second.dtype == outputs.dtype
        and second.shape[-1] <= 128
        and (outputs.is_cuda or interpreted())
        and not torch.is_grad_enabled()
    )


def added(base: torch.Tensor, first: torch.Tensor, second: torch.Tensor, scale: Any) -> torch.Tensor:
    """The unfused arithmetic the kernel computes: `base + F.linear(first, second) * scale` (PEFT's
    `result + lora_B(...) * scaling`)."""
    return base + F.linear(first, second) * scale


def reference(stacked: torch.Tensor, second: torch.Tensor, scale: Any) -> torch.Tensor:
    """The unfused arithmetic: what `vlmrl.engine.rollout.stacked` computes without the kernel."""
    width = second.shape[0]
    return added(stacked[..., :width], stacked[..., width:], second, scale)


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as [rows, last dim], copied only where its last dim is not contiguous (the kernel reads rows through
    their stride)."""
    flat = tensor.reshape(-1, tensor.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


# flexible_layout: the kernel reads `stacked` through its row stride, so a compiled step hands it the stacked matmul's
# output as inductor laid it out (on a GPU, rows padded to 128 bytes) instead of copying it to the eager strides.
@torch.library.custom_op("vlmrl::stacked_second", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def _stacked_second(stacked: torch.Tensor, second: torch.Tensor, scales: torch.Tensor | None,
                    scale: float) -> torch.Tensor:
    width = second.shape[0]
    flat = _rows(stacked)
    return step(flat[:, :width], flat[:, width:], second, scales, scale).view(*stacked.shape[:-1], width)


@_stacked_second.register_fake
def _(stacked: torch.Tensor, second: torch.Tensor, scales: torch.Tensor | None, scale: float) -> torch.Tensor:
    return stacked.new_empty((*stacked.shape[:-1], second.shape[0]))


def linear_and_second(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, second: torch.Tensor,
                      scale: Any, kernels: bool = True) -> torch.Tensor:
    """A stacked group's outputs the two-step way: cuBLAS's matmul over the stacked weight (base rows, then the first
    factors' rows), then the second step, this module's kernel where `kernels` and `usable`, else `reference`."""
    stacked = F.linear(x, weight, bias)
    step = stacked_second if kernels and usable(stacked, second) else reference
    return step(stacked, second, scale)


def stacked_second(stacked: torch.Tensor, second: torch.Tensor, scale: Any) -> torch.Tensor:
    """`base + scale * (first @ secondᵀ)` for `stacked` = [..., width + ranks] (base outputs, then rank-space
    inputs), `second` [width, ranks] and `scale` a float or a [width] tensor. Call `usable` first."""
    if isinstance(scale, torch.Tensor):
        return _stacked_second(stacked, second, scale, 1.0)
    return _stacked_second(stacked, second, None, float(scale))


@torch.library.custom_op("vlmrl::added_second", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def _added_second(base: torch.Tensor, first: torch.Tensor, second: torch.Tensor, scale: float) -> torch.Tensor:
    return step(_rows(base), _rows(first), second, None, scale).view(*base.shape)


@_added_second.register_fake
def _(base: torch.Tensor, first: torch.Tensor, second: torch.Tensor, scale: float) -> torch.Tensor:
    return base.new_empty(base.shape)


def added_second(base: torch.Tensor, first: torch.Tensor, second: torch.Tensor, scale: float) -> torch.Tensor:
    """`base + scale * (first @ secondᵀ)` for one projection whose base computed apart (over a 4-bit base):
    `base` [..., width] its base outputs, `first` [..., rank] its rank-space inputs (any row stride), `second`
    [width, rank], `scale` a float. Call `usable(base, second)` first."""
    return _added_second(base, first, second, float(scale))


def step(base: torch.Tensor, first: torch.Tensor, second: torch.Tensor, scales: torch.Tensor | None,
         scale: float) -> torch.Tensor:
    """The kernel on `base` [rows, width] and `first` [rows, ranks] (each read through its row stride), or the same
    arithmetic in torch, with one warning, where Triton cannot build or launch it. For a custom op's body."""
    return kernel_or_fallback(
        _failed, (str(base.device), base.dtype), lambda: _launch(base, first, second, scales, scale),
        lambda: added(base, first, second, scales if scales is not None else scale),
        what="stacked second-factor kernel", instead="cuBLAS", logger=log)


def _launch(base: torch.Tensor, first: torch.Tensor, second: torch.Tensor, scales: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    """The kernel on `base` [rows, width] and `first` [rows, ranks], each read through its row stride."""
    width, ranks = second.shape
    second = second.contiguous()
    rows = base.shape[0]
    out = torch.empty(rows, width, device=base.device, dtype=base.dtype)
    interpret = interpreted()
    block_r = max(16, 1 << (ranks - 1).bit_length())
    grid = (-(-rows // BLOCK_M), -(-width // BLOCK_N))
    kernel(interpret)[grid](base, first, second, scales if scales is not None else out, out, rows, width, ranks,
                            base.stride(0), first.stride(0), scale, PER_COLUMN=scales is not None, BLOCK_M=BLOCK_M,
                            BLOCK_N=BLOCK_N, BLOCK_R=block_r, DOT_F32=interpret)
    return out


@functools.cache
def kernel(interpret: bool) -> Any:
    """The Triton kernel, built on first use (importing vlmrl needs no Triton); building it also puts its device
    helpers `to_bf16` and `added_rounded` (the second step's arithmetic on a tile) in this module's globals, where the
    kernels that end in the same second step (`group_step`, the nf4 kernel's LoRA branch) take them from."""
    import triton
    import triton.language as tl

    globals()["tl"] = tl  # Triton's interpreter looks for the language among a device function's globals

    @triton.jit
    def to_bf16(x):
        # float32 -> the nearest bfloat16 value (ties to even), kept in float32; NaN stays NaN. Done on the bits
        # because Triton's interpreter truncates where compiled kernels round: the tests then check this code.
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x == x, bits.to(tl.float32, bitcast=True), x)  # noqa: PLR0124 (False for NaN only)

    globals()["to_bf16"] = to_bf16  # a kernel finds the functions it calls among its module's globals

    @triton.jit
    def added_rounded(base, lhs, rhs, scale, DOT_F32: tl.constexpr):
        # base + scale * (lhs @ rhs), rounded as `added` rounds in bf16: the product rounded, then scaled and rounded,
        # then added to `base` (bf16 values in float32) and rounded; lhs, rhs bf16 values (float32 copies where
        # DOT_F32: the interpreter's dot reads bf16 as integers); scale a float or a tensor broadcast to the tile
        if DOT_F32:
            product = tl.dot(lhs.to(tl.float32), rhs.to(tl.float32))
        else:
            product = tl.dot(lhs.to(tl.bfloat16), rhs.to(tl.bfloat16))
        return to_bf16(base + to_bf16(to_bf16(product) * scale))

    globals()["added_rounded"] = added_rounded

    @triton.jit
    def second_step(Base, First, Second, Scales, Out, rows, width, ranks, stride_base, stride_first, scale,
                    PER_COLUMN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                    DOT_F32: tl.constexpr):
        # DOT_F32: the interpreter's tl.dot reads bf16 as raw integers, so there the dot takes float32 copies
        # (exact: bf16 values and their products are float32 values); compiled kernels multiply in the inputs' dtype
        # (`added_rounded`).
        r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, BLOCK_R)
        in_rows, in_cols, in_ranks = r < rows, c < width, k < ranks
        first = tl.load(First + r[:, None] * stride_first + k[None, :],
                        mask=in_rows[:, None] & in_ranks[None, :], other=0.0)
        factors = tl.load(Second + c[None, :] * ranks + k[:, None], mask=in_ranks[:, None] & in_cols[None, :],
                          other=0.0)  # [BLOCK_R, BLOCK_N]: secondᵀ's tile
        if PER_COLUMN:
            scale = tl.load(Scales + c, mask=in_cols, other=0.0).to(tl.float32)[None, :]
        base = tl.load(Base + r[:, None] * stride_base + c[None, :], mask=in_rows[:, None] & in_cols[None, :],
                       other=0.0).to(tl.float32)
        tl.store(Out + r[:, None] * width + c[None, :],
                 added_rounded(base, first, factors, scale, DOT_F32).to(Out.dtype.element_ty),
                 mask=in_rows[:, None] & in_cols[None, :])

    return second_step
