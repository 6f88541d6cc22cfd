"""Rollouts compute each group of adapted projections that read the same input with two matmuls: the base weights
and the adapters' first factors stacked in one, the second factors in the other.

A rollout token step with the adapter not merged runs, per adapted projection, the base matmul, the adapter's
first factor (input x A), the second (x B) and their sum. At a rollout's batch each of those is a launch-bound
kernel, and together they cost a token step a good share of what reading the base weights does.

Projections that read the same input (q/k/v of an attention block; gate/up of an MLP; o and down alone) are
stacked instead:
- `StackedProjections(model)` moves each group's frozen base weights, once, into one tensor with rank-many
  spare rows per member below them; each base layer's weight (and bias) becomes a view of its rows, so the loss
  pass and everything else compute exactly what they did, and no weight is copied.
- For each rollout, `active()` writes the adapters' current first factors into the spare rows (in the base
  dtype) and builds the group's second factors as one block-diagonal matrix (zeros off the blocks: exact).
  A group's first member then runs one matmul for the base outputs and the rank-space inputs together, one
  for the adapter outputs, and the scaled sum PEFT computes; its siblings take their slice of the result when
  they are called with the same input tensor (anything else runs PEFT's own forward).
Per layer that is 4 + 4 matmuls where PEFT's forward runs 7 + 14; at a token step in bf16, with vlmrl's kernels, one
kernel a group does both and the sum (`group_step`). The values are those of PEFT's forward under the rollout's
autocast (base and adapter matmuls in the base dtype, the same scale and sum) up to the order in which a matmul
kernel sums its products.

Over a bitsandbytes 4-bit base (`Linear4bit`), which cannot share a matmul with bf16 factors, a group stacks only
its members' first factors (in the rollouts' compute dtype, `dtype`): one matmul gives the group's rank-space
inputs, each member's base runs on its own (vlmrl's nf4 kernel at token steps), and each member's second factor,
scale and sum are one step over its base output (`second_factors.added_second`): per layer 7 base calls, 4 first
factor matmuls and 7 second steps where PEFT runs 7 + 14 matmuls and 7 sums; at a token step on vlmrl's nf4
kernel, with its kernels, each member's base and branch are one launch of it (`nf4_branch`). The values are those of
PEFT's forward (its adapters in bf16, as stored or copied, under the rollout's autocast), up to the order in which a
matmul sums its products. Only where the token steps are recorded as one graph (`first_factors`; measured faster
there only).

Applies to plain LoRA (no DoRA or other variant, no dropout, no bias of its own, one active adapter) over
float or bitsandbytes 4-bit base weights that are not sharded (FSDP / ZeRO-3); elsewhere the adapter copies apply
(`vlmrl.engine.rollout.adapter_cast`); `enable_fast_generation` picks one and records which. What it is
worth beside the copies: benchmarks/NOTES.md ("stacked projections", "The recorded step in bf16, and the 4-bit
first factors stacked again").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from vlmrl.engine.rollout import group_step, nf4_branch, second_factors
from vlmrl.engine.rollout.nf4 import is_linear4bit

# Projections that every supported family calls with the same input, in the order it calls them.
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _member_reason(layer: Any, first_factors: bool = False) -> str | None:
    """Why a PEFT LoRA layer cannot be stacked (`first_factors`: over a 4-bit base, its first factor may be); None
    when it can."""
    from vlmrl.engine.lora_layers import plain_reason

    reason = plain_reason(layer)
    if reason is not None:
        return reason
    base = layer.get_base_layer()
    if is_linear4bit(base):
        return None if first_factors else "a Linear4bit base layer (its first factors are stacked only where token steps are recorded)"
    if type(base) is not torch.nn.Linear:
        return f"a {type(base).__name__} base layer (quantized or not a plain Linear)"
    if not base.weight.is_floating_point() or base.weight.requires_grad:
        return "a base weight that is not a frozen float tensor"
    return None


@dataclass
class _Group:
    layers: list[Any]
    weight: torch.Tensor  # [sum(outs) + sum(ranks), in]: the base weights, then the first factors' rows
    bias: torch.Tensor | None
    outs: list[int]
    ranks: list[int]
    second: torch.Tensor | None = None  # [sum(outs), sum(ranks)], block-diagonal; only while a rollout runs
    scale: Any = None
    fused: bool = False  # token steps run the second step as one kernel (`vlmrl.engine.rollout.second_factors`)
    windows: Any = None  # each output tile's ranks, for the group-step kernel (`group_step.rank_windows`)
    # the outputs still owed to the siblings of the member that computed them, and the input they were for
    source: torch.Tensor | None = None
    owed: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def width(self) -> int:
        return sum(self.outs)

    def compute(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.fused and group_step.usable(x, self.weight, self.second, self.windows):  # one kernel, a token step
            return group_step.group_step(x, self.weight, self.bias, self.second, self.scale,
                                         self.windows).split(self.outs, dim=-1)
        return second_factors.linear_and_second(x, self.weight, self.bias, self.second, self.scale,
                                                self.fused).split(self.outs, dim=-1)

    def spare_nbytes(self) -> int:
        """What stacking adds to the weights and keeps between rollouts: the first factors' rows."""
        return self.weight[self.width:].nbytes + (self.bias[self.width:].nbytes if self.bias is not None else 0)

    def second_nbytes(self) -> int:
        """What the second factors take while a rollout runs (block-diagonal: zeros off the blocks)."""
        return self.width * sum(self.ranks) * self.weight.element_size()

    def load(self) -> None:
        """The adapters' current factors, in the base dtype: first factors into the spare rows, second factors into
        a fresh block-diagonal matrix; the scale PEFT applies (one number, or one per output column)."""
        dtype, device = self.weight.dtype, self.weight.device
        row, col, out_start = self.width, 0, 0
        second = torch.zeros(self.width, sum(self.ranks), dtype=dtype, device=device)
        scales = []
        for layer, out, rank in zip(self.layers, self.outs, self.ranks):
            name = next(iter(layer.lora_A))
            self.weight[row:row + rank].copy_(layer.lora_A[name].weight)
            second[out_start:out_start + out, col:col + rank].copy_(layer.lora_B[name].weight)
            scales.append(layer.scaling[name])
            row, col, out_start = row + rank, col + rank, out_start + out
        self.second = second
        if len(set(scales)) == 1:
            self.scale = scales[0]
        else:
            self.scale = torch.cat([torch.full((out,), float(s), dtype=dtype, device=device)
                                    for out, s in zip(self.outs, scales)])
        _static(self.second, self.scale)

    def release(self) -> None:
        """Drop what `load` made for one rollout and what is still owed."""
        self.second = self.scale = self.source = None
        self.owed, self.fused = {}, False

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member `index`'s output for input `x`: its share of a result computed for this very tensor by the
        group's first member, or the whole group computed afresh. The first member always computes, so nothing
        owed from an earlier forward is taken."""
        if index and self.source is x and index in self.owed:
            out = self.owed.pop(index)
            if not self.owed:
                self.source = None
            return out
        outs = self.compute(x)
        if len(outs) > 1:  # nothing is kept for a group of one: no tensor outlives its layer's call
            self.source, self.owed = x, {i: o for i, o in enumerate(outs) if i != index}
        return outs[index]


@dataclass
class _FirstFactors(_Group):
    """A group over 4-bit bases, which compute apart: `weight` [sum(ranks), in] holds only the first factors, and
    each member keeps its own second factor and scale while a rollout runs."""

    seconds: list[torch.Tensor] = field(default_factory=list)
    scales: list[Any] = field(default_factory=list)
    in_kernel: bool = False  # every member's base on the nf4 kernel: token steps run each member in one launch

    def compute(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.fused and self.in_kernel and all(nf4_branch.usable(x, second) for second in self.seconds):
            return self._in_the_kernel(x)
        first = F.linear(x.to(self.weight.dtype), self.weight)  # PEFT casts the input to its adapters' dtype too
        outs, col = [], 0
        for layer, rank, second, scale in zip(self.layers, self.ranks, self.seconds, self.scales):
            base = layer.get_base_layer()(x)
            part = first[..., col:col + rank]
            fused = self.fused and second_factors.usable(base, second)
            outs.append((second_factors.added_second if fused else second_factors.added)(base, part, second, scale))
            col += rank
        return tuple(outs)

    def _in_the_kernel(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each member's base and LoRA branch in one launch of the nf4 kernel (`nf4_branch`): no first-factor matmul
        for the group, no second-step kernel per member."""
        outs, row = [], 0
        for layer, rank, second, scale in zip(self.layers, self.ranks, self.seconds, self.scales):
            outs.append(nf4_branch.branch_step(x, layer.get_base_layer(), self.weight[row:row + rank], second,
                                               scale))
            row += rank
        return tuple(outs)

    def spare_nbytes(self) -> int:
        return self.weight.nbytes

    def second_nbytes(self) -> int:
        return sum(o * r for o, r in zip(self.outs, self.ranks)) * self.weight.element_size()

    def load(self) -> None:
        row, self.seconds, self.scales = 0, [], []
        for layer, rank in zip(self.layers, self.ranks):
            name = next(iter(layer.lora_A))
            self.weight[row:row + rank].copy_(layer.lora_A[name].weight)
            self.seconds.append(layer.lora_B[name].weight.detach().to(self.weight.dtype, copy=True))
            self.scales.append(layer.scaling[name])
            row += rank
        _static(*self.seconds)
        self.in_kernel = all(nf4_branch.takes(layer.get_base_layer(), self.weight.dtype) for layer in self.layers)

    def release(self) -> None:
        super().release()
        self.seconds, self.scales, self.in_kernel = [], [], False


class StackedProjections:
    """Stacks the frozen base weights of `model`'s LoRA projections by shared input (see the module's text), or over
    4-bit bases (with `first_factors`) their first factors, kept in `dtype` (the rollouts' autocast dtype; left out,
    the adapters' own); `active()` makes rollouts use them. `reason` says why nothing was stacked (then `active()`
    changes nothing)."""

    def __init__(self, model: Any, dtype: torch.dtype | None = None, *, first_factors: bool = False):
        from vlmrl.engine.lora_layers import lora_layers

        self.groups: list[_Group] = []
        layers = lora_layers(model)
        self.reason = "no LoRA layers" if not layers else next(
            filter(None, (_member_reason(layer, first_factors) for layer in layers)), None)
        if self.reason is not None:
            return
        adapted = {id(layer) for layer in layers}
        by_parent: dict[int, dict[str, Any]] = {}
        for module in model.modules():
            for child_name, child in module.named_children():
                if id(child) in adapted:
                    by_parent.setdefault(id(module), {})[child_name] = child
        for siblings in by_parent.values():
            left = dict(siblings)
            for names in SHARED_INPUT:
                if all(n in left for n in names) and _compatible([left[n] for n in names]):
                    self.groups.append(_group([left.pop(n) for n in names], dtype))
            self.groups.extend(_group([layer], dtype) for layer in left.values())

    @property
    def first_factors_only(self) -> bool:
        """Whether some group holds only first factors (over 4-bit bases)."""
        return any(isinstance(g, _FirstFactors) for g in self.groups)

    @property
    def nbytes(self) -> int:
        """What the first factors' rows add to the weights (kept between rollouts)."""
        return sum(g.spare_nbytes() for g in self.groups)

    def second_nbytes(self) -> int:
        """What the second factors take while a rollout runs."""
        return sum(g.second_nbytes() for g in self.groups)

    @contextlib.contextmanager
    def active(self, fused: bool = False, first_factors: Callable[[], bool] | None = None) -> Iterator[None]:
        """Within the block the stacked groups hold the adapters' current factors and their layers compute
        through them; after it, PEFT's own forwards again (and the second factors are freed). `fused`: token
        steps run each group's second step as one Triton kernel (`vlmrl.engine.rollout.second_factors`).
        `first_factors`, asked as the block starts: False leaves the groups over 4-bit bases to PEFT's own forwards
        for this block (where their token steps went back to CUDA graph trees)."""
        groups = self.groups
        if first_factors is not None and not first_factors():
            groups = [g for g in groups if not isinstance(g, _FirstFactors)]
        if not groups:
            yield
            return
        installed: list[Any] = []
        try:
            with torch.no_grad():
                for group in groups:
                    group.load()
                    group.fused = fused
            for group in groups:
                for index, layer in enumerate(group.layers):
                    layer.forward = _stacked_forward(group, index, layer)
                    installed.append(layer)
            yield
        finally:
            for layer in installed:
                del layer.forward
            for group in groups:
                group.release()


def _compatible(layers: list[Any]) -> bool:
    bases = [layer.get_base_layer() for layer in layers]
    first = bases[0]
    return all(b.in_features == first.in_features and b.weight.dtype == first.weight.dtype
               and b.weight.device == first.weight.device and (b.bias is None) == (first.bias is None)
               and is_linear4bit(b) == is_linear4bit(first) for b in bases)


def _group(layers: list[Any], dtype: torch.dtype | None) -> _Group:
    """The layers' group: their base weights stacked, or over 4-bit bases their first factors only."""
    if is_linear4bit(layers[0].get_base_layer()):
        return _first_factors(layers, dtype or next(iter(layers[0].lora_A.values())).weight.dtype)
    return _stack(layers)


def _first_factors(layers: list[Any], dtype: torch.dtype) -> _FirstFactors:
    """A tensor for the layers' first factors, filled at each rollout (`_FirstFactors.load`)."""
    ranks = [next(iter(layer.lora_A.values())).out_features for layer in layers]
    bases = [layer.get_base_layer() for layer in layers]
    weight = torch.zeros(sum(ranks), bases[0].in_features, dtype=dtype, device=bases[0].weight.device)
    _static(weight)
    return _FirstFactors(layers, weight, None, [b.out_features for b in bases], ranks)


def _stack(layers: list[Any]) -> _Group:
    """Move the layers' base weights (and biases) into one tensor with rank-many spare rows each below them."""
    bases = [layer.get_base_layer() for layer in layers]
    outs = [b.out_features for b in bases]
    ranks = [next(iter(layer.lora_A.values())).out_features for layer in layers]
    first = bases[0].weight
    weight = torch.zeros(sum(outs) + sum(ranks), first.shape[1], dtype=first.dtype, device=first.device)
    bias = None
    if bases[0].bias is not None:
        bias = torch.zeros(sum(outs) + sum(ranks), dtype=bases[0].bias.dtype, device=first.device)
    start = 0
    for base, out in zip(bases, outs):
        with torch.no_grad():
            weight[start:start + out].copy_(base.weight)
            if bias is not None:
                bias[start:start + out].copy_(base.bias)
        base.weight = torch.nn.Parameter(weight[start:start + out], requires_grad=False)
        if bias is not None:
            base.bias = torch.nn.Parameter(bias[start:start + out], requires_grad=False)
        start += out
    windows = group_step.rank_windows(outs, ranks, first.device)
    _static(weight, bias, windows[0] if windows else None)
    return _Group(layers, weight, bias, outs, ranks, windows=windows)


def _static(*tensors: Any) -> None:
    """Tell compiled CUDA graphs these tensors stay where they are: without it every replay would first copy them
    (they are not parameters or buffers). A new address (the second factors of the next rollout) re-records."""
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            torch._dynamo.mark_static_address(tensor, guard=False)


def _stacked_forward(group: _Group, index: int, layer: Any) -> Any:
    peft_forward = type(layer).forward.__get__(layer)

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs or layer.disable_adapters or layer.merged or layer.active_adapters != list(layer.lora_A):
            return peft_forward(x, *args, **kwargs)
        return group.output(index, x)

    return forward
