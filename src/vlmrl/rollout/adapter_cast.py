"""Rollouts read bf16 copies of the float32 LoRA weights, refreshed at the start of each rollout.

PEFT keeps LoRA weights in float32 next to a bf16 base. In a rollout every adapted projection then casts its
input to float32 (PEFT's `_cast_input_dtype`), and, under the rollout's bf16 autocast, the input back and both
adapter weights to bf16, at every token step: two weight casts and the input round trip per projection, 7
projections x 36 layers for Qwen3-VL-8B. Inside the compiled decode step each cast is its own small kernel.

`LowPrecisionAdapters` keeps one bf16 copy of each adapter weight, allocated once, and swaps the copies into
the LoRA modules for the duration of a rollout: the casts are then done once per rollout (one copy per weight)
instead of once per token step, and the decode graph reads bf16 adapters directly. The copies keep their
addresses across rollouts, which is what the CUDA graphs of the compiled decode step need (a graph whose
parameter addresses changed is re-recorded, and after a limit no longer replayed).

Numerics: the rollout computes exactly what the autocast path computes (bf16 weights, bf16 inputs, float32
accumulation in the matmul), without the float32 round trip of the input, which is exact for bf16 values.
Cost: the copies stay allocated (2 bytes per adapter parameter: 0.08 GiB for Qwen3-VL-8B at r=16).

The loss pass never sees the copies: the float32 parameters the optimizer updates are back in place when a
rollout ends, including when it raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class LowPrecisionAdapters:
    def __init__(self, model: Any, dtype: torch.dtype):
        from vlmrl.rollout.merge import lora_layers

        self.dtype = dtype
        self.entries: list[tuple[torch.nn.Module, torch.nn.Parameter, torch.nn.Parameter]] = []
        for layer in lora_layers(model):
            for adapters in (layer.lora_A, layer.lora_B):
                for module in adapters.values():
                    weight = getattr(module, "weight", None)
                    if isinstance(weight, torch.nn.Parameter) and weight.dtype == torch.float32:
                        copy = torch.nn.Parameter(torch.empty_like(weight, dtype=dtype), requires_grad=False)
                        self.entries.append((module, weight, copy))

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes(self) -> int:
        return sum(copy.nbytes for _, _, copy in self.entries)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within the block the LoRA modules hold the refreshed low-precision copies; after it, their own weights."""
        stale = [m for m, w, c in self.entries if m._parameters.get("weight") is not w or w.shape != c.shape]
        if stale:  # something (a wrapper sharding the model, a reload) replaced the weights since the copies were made
            raise RuntimeError(f"{len(stale)} LoRA weights were replaced after their rollout copies were made; "
                               "the copies would be stale (set train.rollout_adapter_copies=false)")
        with torch.no_grad():
            for _, weight, copy in self.entries:
                copy.copy_(weight)
        try:
            for module, _, copy in self.entries:
                module._parameters["weight"] = copy
            yield
        finally:
            for module, weight, _ in self.entries:
                module._parameters["weight"] = weight
