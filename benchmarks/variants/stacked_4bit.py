"""Over a bitsandbytes 4-bit base, the LoRA first factors stacked by shared input: an experiment that lost
(benchmarks/NOTES.md, "Stacking the first factors over a 4-bit base").

A 4-bit base cannot share a matmul with the bf16 first factors, so the product leaves its LoRA branches to PEFT
(over the bf16 adapter copies): per projection the nf4 base, the first factor, the second, and the scaled sum. Here
the projections that read the same input (q/k/v; gate/up) share one matmul for their rank-space inputs, and each
member's second factor, scale and sum run as one kernel over its base output (the product's second-step kernel,
`second_factors.step`, given the base output and the rank-space inputs apart): per layer 7 nf4 calls, 4
first-factor matmuls and 7 second steps where PEFT runs 7 + 14 matmuls and 7 sums.

- `FirstFactorsStacked(model, dtype)`: a `StackedProjections` whose groups over `Linear4bit` bases hold only the
  first factors (in `dtype`, the rollouts' compute dtype), filled when a rollout starts; `active()` as the product's.
- `first_factors_stacked(apart)`: inside the block, `enable_fast_generation` builds that instead of the product's
  (`apart`: one projection a group).
- `added_second(base, first, second, scale)`: the second step with the two parts apart (a custom op,
  `vlmrl_bench::added_second`).
Values: those of PEFT's forward over the adapter copies under the rollout's autocast, up to the order in which a
matmul sums its products (tests/test_variants.py: bit for bit on the CPU, compiled in one graph).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from vlmrl.engine.patch import replaced
from vlmrl.engine.rollout import second_factors, stacked
from vlmrl.engine.rollout.nf4 import is_linear4bit


def reference_added(base: torch.Tensor, first: torch.Tensor, second: torch.Tensor, scale: Any) -> torch.Tensor:
    """PEFT's `base + lora_B(first) * scaling`, unfused."""
    return base + F.linear(first, second) * scale


@torch.library.custom_op("vlmrl_bench::added_second", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def _added_second(base: torch.Tensor, first: torch.Tensor, second: torch.Tensor, scale: float) -> torch.Tensor:
    flat_base, flat_first = base.reshape(-1, base.shape[-1]), first.reshape(-1, first.shape[-1])
    if flat_base.stride(-1) != 1:
        flat_base = flat_base.contiguous()
    if flat_first.stride(-1) != 1:
        flat_first = flat_first.contiguous()
    return second_factors.step(flat_base, flat_first, second, None, scale).view(*base.shape)


@_added_second.register_fake
def _(base: torch.Tensor, first: torch.Tensor, second: torch.Tensor, scale: float) -> torch.Tensor:
    return base.new_empty(base.shape)


def added_second(base: torch.Tensor, first: torch.Tensor, second: torch.Tensor, scale: float) -> torch.Tensor:
    """`base + scale * (first @ secondᵀ)` for `base` [..., width] (a projection's base outputs), `first` [...,
    rank] (its rank-space inputs, any row stride) and `second` [width, rank]. Call `usable(base, second)` first."""
    return _added_second(base, first, second, float(scale))


@dataclass
class _FirstFactors(stacked._Group):
    """A group whose base layers compute apart: `weight` [sum(ranks), in] holds only the first factors."""

    seconds: list[torch.Tensor] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)

    def compute(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        first = F.linear(x, self.weight)
        outs, col = [], 0
        for layer, rank, second, scale in zip(self.layers, self.ranks, self.seconds, self.scales):
            base = layer.get_base_layer()(x)
            part = first[..., col:col + rank]
            fused = self.fused and second_factors.usable(base, second)
            outs.append((added_second if fused else reference_added)(base, part, second, scale))
            col += rank
        return tuple(outs)


def _first_factors(layers: list[Any], dtype: torch.dtype) -> _FirstFactors:
    ranks = [next(iter(layer.lora_A.values())).out_features for layer in layers]
    bases = [layer.get_base_layer() for layer in layers]
    weight = torch.zeros(sum(ranks), bases[0].in_features, dtype=dtype, device=bases[0].weight.device)
    stacked._static(weight)
    return _FirstFactors(layers, weight, None, [b.out_features for b in bases], ranks)


def _load(group: _FirstFactors) -> None:
    row, seconds = 0, []
    for layer, rank in zip(group.layers, group.ranks):
        name = next(iter(layer.lora_A))
        group.weight[row:row + rank].copy_(layer.lora_A[name].weight)
        seconds.append(layer.lora_B[name].weight.detach().to(group.weight.dtype, copy=True))
        row += rank
    group.seconds = seconds
    group.scales = [layer.scaling[next(iter(layer.lora_A))] for layer in group.layers]
    stacked._static(*seconds)


class FirstFactorsStacked(stacked.StackedProjections):
    """The product's stacking, with groups over `Linear4bit` bases that stack only their first factors."""

    def __init__(self, model: Any, dtype: torch.dtype = torch.bfloat16):
        from vlmrl.engine.lora_layers import lora_layers, plain_reason

        self.groups = []
        layers = lora_layers(model)
        quantized = [layer for layer in layers if is_linear4bit(layer.get_base_layer())]
        self.reason = ("no LoRA layer over a 4-bit base" if not quantized
                       else next(filter(None, map(plain_reason, quantized)), None))
        if self.reason is not None:
            return
        adapted = {id(layer) for layer in quantized}
        for module in model.modules():
            siblings = {name: child for name, child in module.named_children() if id(child) in adapted}
            for names in stacked.SHARED_INPUT:
                if all(n in siblings for n in names) and stacked._compatible([siblings[n] for n in names]):
                    self.groups.append(_first_factors([siblings.pop(n) for n in names], dtype))
            self.groups.extend(_first_factors([layer], dtype) for layer in siblings.values())

    @property
    def nbytes(self) -> int:
        return sum(g.weight.nbytes for g in self.groups)

    def second_nbytes(self) -> int:
        return sum(sum(o * r for o, r in zip(g.outs, g.ranks)) * g.weight.element_size() for g in self.groups)

    @contextlib.contextmanager
    def active(self, fused: bool = False) -> Iterator[None]:
        """The product's `active`, loading these groups' factors (`_load`) and freeing their second factors after."""
        try:
            with replaced(stacked, "_load_factors", _load), super().active(fused=fused):
                yield
        finally:
            for group in self.groups:
                group.seconds, group.scales = [], []


@contextlib.contextmanager
def first_factors_stacked(apart: bool = False) -> Iterator[None]:
    """Inside the block, `enable_fast_generation` stacks the first factors over a 4-bit base (`apart`: each
    projection a group of its own, PEFT's first factors as they are, only the second step this module's)."""
    with replaced(stacked, "StackedProjections", FirstFactorsStacked), \
            replaced(stacked, "SHARED_INPUT", () if apart else stacked.SHARED_INPUT):
        yield
