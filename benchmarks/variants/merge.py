"""Experimental: rollouts with the LoRA adapter merged into the base weights, restored exactly afterwards.

Merged weights (W + scale * B A) compute a rollout's adapted projections in one matmul each, where PEFT runs the
base matmul and two small adapter matmuls. Merging in place and unmerging by subtraction (PEFT's
`merge_adapter`/`unmerge_adapter`, TRL's vLLM sync) rounds twice and drifts; `RolloutMerge` instead keeps the
original base weights in pinned host memory, merges on the GPU (one rounding of W + D, in float32) and copies the
originals back bit for bit. GPU memory does not grow; host memory holds one copy of the adapted weights.
`rollout_merge(trainer)` sets it up for a trainer, or says why not.

Why it is not supported: W + D is rounded to W's bf16 grid, so every element of D below half a bf16 step of its W
is lost, which early in LoRA training at RL learning rates is most of the adapter's effect (`tests/test_variants.py`
shows it): the rollouts sample from close to the base model while the loss treats them as the trained policy's.
Only plain LoRA (no bias, no DoRA or other variant) on unquantized, unsharded float weights is merged. What it was
worth: benchmarks/NOTES.md ("Adapter merged for rollouts").
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from vlmrl.engine.lora_layers import lora_layers, variant

log = logging.getLogger(__name__)


def unsupported_reason(model: Any) -> str | None:
    """Why the adapter of `model` cannot be merged exactly for rollouts; None when it can."""
    layers = lora_layers(model)
    if not layers:
        return "no LoRA layers"
    for layer in layers:
        weight = getattr(layer.get_base_layer(), "weight", None)
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or type(weight).__name__ != "Parameter":
            return f"{type(layer).__name__} has a quantized or non-float base weight"
        if weight.requires_grad:
            return "a LoRA base weight is trainable"
        if weight.numel() == 0 or weight.is_meta:
            return "a LoRA base weight is sharded or not materialized (FSDP / ZeRO-3)"
        if not len(layer.lora_A):
            return f"{type(layer).__name__} keeps its adapter outside lora_A/lora_B (e.g. an embedding)"
        kinds = {variant(layer, name) for name in layer.lora_A} - {None}
        if "DoRA" in kinds:
            return "DoRA adapters are not merged for rollouts"
        if kinds:
            return "LoRA variants (aLoRA, ...) are not merged for rollouts"
        if any(getattr(layer, "lora_bias", {}).get(name) for name in layer.lora_A):
            return "LoRA with a bias (lora_bias=True) is not merged for rollouts"
    return None


def host_bytes(model: Any) -> int:
    """Host memory the pinned copy of the adapted base weights takes."""
    return sum(layer.get_base_layer().weight.nbytes for layer in lora_layers(model))


def available_host_bytes() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


class RolloutMerge:
    """`with merge.merged(): ...` runs its body on merged weights and restores the originals on the way out."""

    def __init__(self, model: Any):
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"cannot merge the adapter for rollouts: {reason}")
        self.layers = lora_layers(model)
        self._originals: list[torch.Tensor] | None = None

    @property
    def weights(self) -> list[torch.Tensor]:
        return [layer.get_base_layer().weight for layer in self.layers]

    def keep_originals(self) -> None:
        """Copy the base weights to (pinned) host memory; done once, since frozen base weights never change
        during LoRA training. Call it up front to meet a pinning failure before training starts."""
        if self._originals is None:
            self._originals = [w.detach().to("cpu", copy=True).pin_memory() if w.is_cuda else w.detach().clone()
                               for w in self.weights]

    @contextlib.contextmanager
    def merged(self) -> Iterator[None]:
        self.keep_originals()
        saved = [list(layer.merged_adapters) for layer in self.layers]
        merged: list[int] = []
        try:
            with torch.no_grad():
                for index, (layer, weight) in enumerate(zip(self.layers, self.weights)):
                    names = [n for n in layer.active_adapters if n in layer.lora_A and n not in layer.merged_adapters]
                    if not names:
                        continue
                    merged.append(index)
                    total = weight.float()
                    for name in names:
                        total += layer.get_delta_weight(name).float()
                    weight.copy_(total)
                    del total
                    layer.merged_adapters.extend(names)  # peft's forward then skips the LoRA branch
            yield
        finally:
            with torch.no_grad():
                for index in merged:
                    self.layers[index].get_base_layer().weight.copy_(self._originals[index], non_blocking=True)
            for layer, names in zip(self.layers, saved):
                layer.merged_adapters[:] = names


def rollout_merge(trainer: Any) -> tuple[RolloutMerge | None, str]:
    """A `RolloutMerge` for `trainer`'s model with its host copy made up front, or None; and what was done."""
    from vlmrl.engine.rollout.fast import sharded

    if sharded(trainer):
        return None, "not merged: parameters are sharded (FSDP / DeepSpeed)"
    reason = unsupported_reason(trainer.model)
    if reason:
        return None, f"not merged: {reason}"
    need, free = host_bytes(trainer.model), available_host_bytes()
    copies = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # every process on this host pins its own copy
    if free is not None and need * copies > free // 2:
        return None, (f"not merged: {copies} pinned copies of {need / 2**30:.1f} GiB exceed half the free host "
                      "memory")
    merger = RolloutMerge(trainer.model)
    try:
        merger.keep_originals()
    except (RuntimeError, MemoryError) as exc:  # pinning can fail where locked memory is limited
        return None, f"not merged: the host copy could not be made ({type(exc).__name__}: {exc})"[:300]
    log.warning("rollouts sample from merged bf16 weights: adapter deltas below half a bf16 step of their weight "
                "are lost in rollouts (benchmarks/variants/merge.py)")
    return merger, f"merged for rollouts (host copy {need / 2**30:.1f} GiB)"
