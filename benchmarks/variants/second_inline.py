"""The LoRA branches' second step written as plain pointwise work that inductor can fold into the kernels around
it: an experiment (benchmarks/NOTES.md, "Fewer small kernels in the token step").

The product runs each stacked group's second step, `base + scale * (first @ secondᵀ)`, as one Triton kernel per
group at token steps (`vlmrl.engine.rollout.second_factors`): four kernels a layer (q/k/v, o, gate/up, down),
each a few microseconds of mostly fixed cost. With ranks of 16 the product is 16 multiply-adds per output, so here
it is spelled out as a sum of `rank` broadcast products, per member, in float32 and rounded as the unfused path
rounds (the product to the dtype, then the scale, then the sum). Inductor may then compute it inside the kernels
that read the outputs next (q/k norm and rotary, the residual add and RMSNorm, the SiLU gate) instead of in a kernel
of its own. Whether it does, and whether that wins, is for a GPU to say.

- `inline_added(base, first, second, scale)`: `base + scale * (first @ secondᵀ)` as pointwise products.
- `second_inline()`: inside the block, the product's stacked groups (over a 4-bit base, its first-factor groups)
  compute their second step that way at token steps.
Values: within the rounding of the fp32 sum's order, and of inductor's handling of the intermediate roundings
(it may keep them in float32 inside one kernel); tests/test_variants.py checks eager values on the CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from vlmrl.engine.patch import replaced
from vlmrl.engine.rollout import second_factors, stacked

MAX_RANK = 64  # beyond this the spelled-out sum is no longer small pointwise work
_FIRST_FACTORS_COMPUTE = stacked._FirstFactors.compute  # the product's own, kept for other row counts


def inline_added(base: torch.Tensor, first: torch.Tensor, second: torch.Tensor, scale: Any) -> torch.Tensor:
    """`base` [..., out], `first` [..., rank], `second` [out, rank]; `scale` a float or an [out] tensor."""
    first32, second32 = first.float(), second.float()
    product = first32[..., 0:1] * second32[:, 0]
    for k in range(1, second.shape[-1]):
        product = product + first32[..., k:k + 1] * second32[:, k]
    return base + product.to(base.dtype) * scale


def usable(x: torch.Tensor, ranks: list[int]) -> bool:
    """A token step's few rows (as the product's second-step kernel takes), small ranks, no gradients."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return 0 < rows <= second_factors.MAX_ROWS and max(ranks) <= MAX_RANK and not torch.is_grad_enabled()


def _members(group: Any) -> Iterator[tuple[int, int, int, int, Any]]:
    """(out start, out, rank column, rank, scale) per member of a stacked group."""
    out_start = col = 0
    scales = group.scale
    for out, rank in zip(group.outs, group.ranks):
        scale = scales[out_start:out_start + out] if isinstance(scales, torch.Tensor) else scales
        yield out_start, out, col, rank, scale
        out_start, col = out_start + out, col + rank


def _stacked_compute(self: stacked._Group, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    out = torch.nn.functional.linear(x, self.weight, self.bias)
    if not (self.fused and usable(x, self.ranks)):
        return second_factors.reference(out, self.second, self.scale).split(self.outs, dim=-1)
    width = self.width
    return tuple(inline_added(out[..., start:start + n], out[..., width + col:width + col + rank],
                              self.second[start:start + n, col:col + rank], scale)
                 for start, n, col, rank, scale in _members(self))


def _first_factors_compute(self: stacked._FirstFactors, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if not (self.fused and usable(x, self.ranks)):
        return _FIRST_FACTORS_COMPUTE(self, x)
    first = torch.nn.functional.linear(x, self.weight)
    outs, col = [], 0
    for layer, rank, second, scale in zip(self.layers, self.ranks, self.seconds, self.scales):
        outs.append(inline_added(layer.get_base_layer()(x), first[..., col:col + rank], second, scale))
        col += rank
    return tuple(outs)


@contextlib.contextmanager
def second_inline() -> Iterator[None]:
    """Inside the block, stacked groups compute their second step at token steps as pointwise products."""
    with replaced(stacked._Group, "compute", _stacked_compute), \
            replaced(stacked._FirstFactors, "compute", _first_factors_compute):
        yield
