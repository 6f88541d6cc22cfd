"""PEFT's LoRA layers as the engine finds them: `lora_layers(model)` lists them, `variant(layer, name)` says when an
adapter is not plain LoRA (DoRA, aLoRA, ...). The rollout's stacked projections and adapter copies and the loss
pass's input handling use these to decide where they apply.
"""

from __future__ import annotations

from typing import Any


def lora_layers(model: Any) -> list[Any]:
    """PEFT LoRA layers of `model` (modules with `lora_A`, `lora_B` and `merged_adapters`)."""
    return [m for m in model.modules()
            if hasattr(m, "lora_A") and hasattr(m, "lora_B") and hasattr(m, "merged_adapters")]


def variant(layer: Any, name: str) -> str | None:
    """"DoRA" or "a LoRA variant" when adapter `name` of `layer` is not plain LoRA; None when it is."""
    if getattr(layer, "use_dora", {}).get(name):
        return "DoRA"
    return "a LoRA variant" if getattr(layer, "lora_variant", {}).get(name) is not None else None
