"""PEFT's LoRA layers as the engine finds them: `lora_layers(model)` lists them, `variant(layer, name)` says when an
adapter is not plain LoRA (DoRA, aLoRA, ...), `plain_reason(layer)` why a layer's branch is not one plain LoRA
adapter's `scale * B(A(x))`. The rollout's stacked projections, nf4 LoRA branch and adapter copies and the loss
pass's input handling use these to decide where they apply.
"""

from __future__ import annotations

from typing import Any

import torch


def lora_layers(model: Any) -> list[Any]:
    """PEFT LoRA layers of `model` (modules with `lora_A`, `lora_B` and `merged_adapters`)."""
    return [m for m in model.modules()
            if hasattr(m, "lora_A") and hasattr(m, "lora_B") and hasattr(m, "merged_adapters")]


def variant(layer: Any, name: str) -> str | None:
    """"DoRA" or "a LoRA variant" when adapter `name` of `layer` is not plain LoRA; None when it is."""
    if getattr(layer, "use_dora", {}).get(name):
        return "DoRA"
    return "a LoRA variant" if getattr(layer, "lora_variant", {}).get(name) is not None else None


def plain_reason(layer: Any) -> str | None:
    """Why `layer`'s branch is not one plain LoRA adapter's `scale * B(A(x))` (more than one adapter, a variant, a
    bias of its own, dropout); None when it is."""
    names = list(layer.lora_A.keys())
    if len(names) != 1:
        return "more than one adapter"
    name = names[0]
    kind = variant(layer, name)
    if kind:
        return f"{kind} adapters"
    if getattr(layer, "lora_bias", {}).get(name):
        return "LoRA with a bias"
    if not isinstance(layer.lora_dropout[name], torch.nn.Identity):
        return "LoRA dropout (each projection draws its own mask)"
    return None
