"""Rollouts read bf16 copies of the float32 LoRA weights, made at the start of each rollout and freed at its end.

PEFT keeps LoRA weights in float32 next to a bf16 base. In a rollout every adapted projection then casts its
input to float32 (PEFT's `_cast_input_dtype`), and, under the rollout's bf16 autocast, the input back and both
adapter weights to bf16, at every token step: two weight casts and the input round trip per projection, 7
projections x 36 layers for Qwen3-VL-8B. Inside the compiled decode step each cast is its own small kernel.

`LowPrecisionAdapters` makes one bf16 copy of each adapter weight when a rollout starts and swaps the copies into
the LoRA modules for its duration: the casts are then done once per rollout (one copy per weight) instead of once
per token step, and the decode graph reads bf16 adapters directly. The copies are freed when the rollout ends, so
the loss pass's memory is the same as without them; during the rollout they are paid for by the optimizer state,
which waits on the host meanwhile (`vlmrl.engine.rollout.offload`). The copies' addresses can change from one rollout to
the next, like those of the static KV cache transformers builds for each `generate` call: the CUDA graphs that
read them are recorded again in the same recording the new cache causes.

Numerics: the rollout computes exactly what the autocast path computes (bf16 weights, bf16 inputs, float32
accumulation in the matmul), without the float32 round trip of the input, which is exact for bf16 values.

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
        from vlmrl.engine.lora_layers import lora_layers

        self.dtype = dtype
        self.entries: list[tuple[torch.nn.Module, torch.nn.Parameter]] = []
        for layer in lora_layers(model):
            for adapters in (layer.lora_A, layer.lora_B):
                for module in adapters.values():
                    weight = getattr(module, "weight", None)
                    if isinstance(weight, torch.nn.Parameter) and weight.dtype == torch.float32:
                        self.entries.append((module, weight))

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes(self) -> int:
        """What the copies take while a rollout runs."""
        return sum(weight.numel() * self.dtype.itemsize for _, weight in self.entries)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within the block the LoRA modules hold fresh low-precision copies; after it, their own weights again
        (and the copies are gone)."""
        stale = [m for m, w in self.entries if m._parameters.get("weight") is not w]
        if stale:  # something (a wrapper sharding the model, a reload) replaced the weights after the entries were taken
            raise RuntimeError(f"{len(stale)} LoRA weights were replaced after their rollout copies were planned; "
                               "the copies would be stale")
        try:
            with torch.no_grad():
                for module, weight in self.entries:
                    module._parameters["weight"] = torch.nn.Parameter(weight.detach().to(self.dtype),
                                                                      requires_grad=False)
            yield
        finally:
            for module, weight in self.entries:
                module._parameters["weight"] = weight
