"""Rollouts with the LoRA adapter merged into the base weights; the base weights restored exactly afterwards.

A decode step at the seed recipe's batch (32 sequences, one token each) is bound by reading the weights. The
LoRA branches add little to read but many small kernels: 7 adapted projections x 36 layers, each an A and a B
matmul, a scale and an add. On an H200 they cost about 6 ms of a 20 ms compiled decode step
(`benchmarks/decode_profile.py`). Merged weights (W + scale * B A) compute the same map in one matmul.

Merging in place and unmerging by subtraction (what `peft`'s `merge_adapter`/`unmerge_adapter` do, and what
TRL does before it syncs weights to vLLM) does not give the bf16 base weights back: W + D - D rounds twice, and
the error accumulates over thousands of steps. A merged copy would keep them but costs a second set of weights
on the GPU (16 GiB for an 8B model). `RolloutMerge` keeps the original base weights in pinned host memory
instead: merge on the GPU (one rounding of W + D, computed in float32), generate, then copy the originals
back, bit for bit. GPU memory does not grow; host memory holds one copy of the adapted weights (12.9 GiB for
Qwen3-VL-8B), and each rollout adds the merge and one host-to-device copy of them (0.34 s together on an
H200, against about 5.6 ms saved on each of 1,024 token steps: `benchmarks/results/h200_decode_profile.md`).

The catch, and why it is off by default (`train.rollout_merge=false`): W + D is rounded to W's bf16 grid, so
every element of D smaller than half a bf16 step of its W is lost. Early in LoRA training, at RL learning
rates, most of D is that small: with W ~ N(0, 0.02) and D ~ 1e-5, about 90% of the adapter's effect on the
outputs disappears (`tests/test_merge.py` shows it), and the rollouts sample from close to the base model
while the loss treats them as samples of the trained policy (TRL's transformers path takes the sampling
log-probabilities to be the current ones). TRL's vLLM path has the same rounding, and corrects for it with
importance sampling against vLLM's own log-probabilities; TRL offers that correction to vLLM only. So the
merge is an opt-in speed setting for runs whose adapter deltas are large against the bf16 step, not a
default.

Only plain LoRA (no bias, no variant such as DoRA or aLoRA) on unquantized float weights is merged; quantized
bases (bitsandbytes) and sharded parameters (FSDP, ZeRO-3) are reported unsupported.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

log = logging.getLogger(__name__)


def lora_layers(model: Any) -> list[Any]:
    """PEFT LoRA layers of `model` (modules with `lora_A`, `lora_B` and `merged_adapters`)."""
    return [m for m in model.modules()
            if hasattr(m, "lora_A") and hasattr(m, "lora_B") and hasattr(m, "merged_adapters")]


def variant(layer: Any, name: str) -> str | None:
    """"DoRA" or "a LoRA variant" when adapter `name` of `layer` is not plain LoRA; None when it is."""
    if getattr(layer, "use_dora", {}).get(name):
        return "DoRA"
    return "a LoRA variant" if getattr(layer, "lora_variant", {}).get(name) is not None else None


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
