"""A 4-bit projection's token step with its LoRA branch inside the nf4 kernel: one launch for base and branch.

Over a 4-bit base whose first factors are stacked (`vlmrl.engine.rollout.stacked`), a member's token step was three
kernels or more: the group's first-factor matmul (cuBLAS, often split-K with a reduction kernel), the member's nf4
kernel, and the second step (`second_factors.added_second`). Here the nf4 kernel's loop also multiplies x's tile
by the member's first-factor rows on the tensor cores (the x tile is already loaded), and where a tile's output is
written (its last split to finish, or its only one) the rank-space sums are rounded and the second step is done
on the tile: `base + scale * (first @ secondᵀ)`, rounded where `second_factors.added` rounds. Only the sums'
order differs from the unfused path (the first factors' products are summed in the kernel's split order, not
cuBLAS's).

Public: `usable(x, second)`, `takes(layer, dtype)` and `branch_step(x, layer, first, second, scale)`, which
`vlmrl.engine.rollout.stacked` calls at a 4-bit group's token steps. Limits: bf16, ranks up
to 64, the nf4 kernel's own (`nf4`); where the kernel splits K and no split counters can be had, or where Triton
cannot build or launch it (warned once), the same arithmetic unfused.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from vlmrl.engine.rollout import nf4, second_factors
from vlmrl.engine.rollout.decode_attention import kernel_or_fallback

log = logging.getLogger(__name__)
_failed: dict[tuple, str] = {}  # (device, dtype) -> why the kernel could not run there

MAX_RANK = 64


def usable(x: torch.Tensor, second: torch.Tensor) -> bool:
    """True when the kernel computes this member's step: bf16, the nf4 kernel's row counts, ranks up to `MAX_RANK`,
    no gradient. Reads metadata only, so a compiled step traces it without a graph break."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (x.dtype == torch.bfloat16 and second.dtype == x.dtype and nf4.MIN_ROWS <= rows <= nf4.MAX_ROWS
            and 0 < second.shape[-1] <= MAX_RANK and not torch.is_grad_enabled()
            and (x.is_cuda or nf4.interpreted()))


def takes(layer: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Whether the nf4 kernel can compute `Linear4bit` layer `layer`'s token steps on inputs of `dtype` (its weights,
    its compute dtype). Asked once per rollout, not traced."""
    return nf4.layer_reason(layer) is None and getattr(layer, "compute_dtype", None) in (None, dtype)


def branch_step(x: torch.Tensor, layer: torch.nn.Module, first: torch.Tensor, second: torch.Tensor,
                scale: float) -> torch.Tensor:
    """`layer(x) + scale * ((x @ firstᵀ) @ secondᵀ)` for `Linear4bit` layer `layer` (its nf4 weight and bias),
    `first` [rank, in] the member's first-factor rows (bf16), `second` [out, rank]. Call `usable` and `takes`
    first."""
    def op(x, packed, absmax, code2, absmax2, offset, lut, bias, blocksize, blocksize2, rounding, config):
        return _branch(x, packed, absmax, code2, absmax2, offset, lut, bias, first, second, float(scale), blocksize,
                       blocksize2, rounding, config)

    return nf4.call(op, x, layer.weight, layer.bias, nf4.quant_state(layer), None)


@torch.library.custom_op("vlmrl::nf4_branch", mutates_args=())
def _branch(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code2: torch.Tensor | None,
            absmax2: torch.Tensor | None, offset: torch.Tensor | None, lut: torch.Tensor, bias: torch.Tensor | None,
            first: torch.Tensor, second: torch.Tensor, scale: float, blocksize: int, blocksize2: int, rounding: int,
            config: list[int]) -> torch.Tensor:
    args = (x, packed, absmax, code2, absmax2, offset, lut, bias, blocksize, blocksize2, rounding, config)

    def fused() -> torch.Tensor:
        out = nf4.launch(*args, lora=(first, second, scale))
        return out if out is not None else _apart(args, first, second, scale, kernel=True)

    if packed.data_ptr() % nf4.WORD:
        return _apart(args, first, second, scale, kernel=False)
    return kernel_or_fallback(_failed, (str(x.device), x.dtype), fused,
                              lambda: _apart(args, first, second, scale, kernel=False),
                              what="nf4 kernel with the LoRA branch", instead="dequantize + matmul and the branch apart",
                              logger=log)


@_branch.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, *args: Any) -> torch.Tensor:
    return x.new_empty((x.shape[0], packed.shape[0]))


def _apart(args: tuple, first: torch.Tensor, second: torch.Tensor, scale: float, *, kernel: bool) -> torch.Tensor:
    """The same arithmetic unfused: the base by the nf4 kernel (or dequantize + matmul), then the branch."""
    base = nf4.launch(*args) if kernel else nf4.reference(*args)
    return second_factors.added(base, F.linear(args[0], first), second, scale)
