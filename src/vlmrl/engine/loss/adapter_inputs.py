"""LoRA layers keep their bf16 inputs under autocast, instead of casting them to float32 and back.

PEFT keeps LoRA weights in float32 next to a bf16 base, and before each adapter matmul casts the layer's input
to the adapter weight's dtype (`_cast_input_dtype`). Under the bf16 autocast that TRL's loss pass runs in, the
matmul then casts that float32 copy straight back to bf16. For a bf16 input the round trip is exact, so it
changes no number, in the forward or in the backward (whose gradient goes through the same two casts in
reverse). It is not free: the input is a whole micro-batch of activations, cast once for each adapted projection
of each layer, in the forward, again in the checkpoint's recomputation, and twice more in the backward; skipping
the casts saves loss-pass time and peak memory (benchmarks/NOTES.md, "LoRA inputs kept in bf16").

PEFT reads the switch for the cast, `cast_input_dtype_enabled`, as a truth value at every forward.
`keep_inputs_under_autocast` sets it, on every plain LoRA layer, to an object that is false while autocast is on
for the device (the cast is skipped: autocast decides the matmul's dtype, as it did after the cast) and true
otherwise (PEFT casts as before, e.g. in a pass outside autocast, where a bf16 input would not meet a float32
weight). Layers with dropout, DoRA or another LoRA variant keep PEFT's cast. Gradient checkpointing recomputes
with the forward's autocast state, so the recomputation takes the same branch as the forward. Applies where the
trainer's autocast exists: a bf16 or fp16 run with float32 adapters over a low-precision frozen base
(`vlmrl.engine.rollout.fast.rollout_autocast_dtype`).
"""

from __future__ import annotations

from typing import Any

import torch


class CastOutsideAutocast:
    """PEFT's `cast_input_dtype_enabled`: true (cast) unless autocast is on for `device_type`."""

    __slots__ = ("device_type",)

    def __init__(self, device_type: str):
        self.device_type = device_type

    def __bool__(self) -> bool:
        return not torch.is_autocast_enabled(self.device_type)

    def __repr__(self) -> str:
        return f"CastOutsideAutocast({self.device_type!r})"


def keep_inputs_under_autocast(model: Any, device_type: str) -> int:
    """Install `CastOutsideAutocast` on every plain LoRA layer of `model` (`plain_lora`); how many layers."""
    from vlmrl.engine.lora_layers import lora_layers

    flag = CastOutsideAutocast(device_type)
    layers = [layer for layer in lora_layers(model) if plain_lora(layer)]
    for layer in layers:
        layer.cast_input_dtype_enabled = flag
    return len(layers)


def plain_lora(layer: Any) -> bool:
    """A LoRA layer whose input meets nothing but the adapter matmul: no dropout (its random mask could be drawn
    differently for a bf16 input), no DoRA and no other LoRA variant (their elementwise terms would see the bf16
    input instead of the float32 one)."""
    from vlmrl.engine.lora_layers import variant

    names = list(getattr(layer, "lora_A", {}))
    return bool(names) and all(
        isinstance(layer.lora_dropout[name], torch.nn.Identity) and variant(layer, name) is None for name in names)


def enable(trainer: Any) -> str:
    """Skip the LoRA input casts under `trainer`'s autocast when it has one; what was done, for the record."""
    from vlmrl.engine.rollout.fast import rollout_autocast_dtype

    if rollout_autocast_dtype(trainer.model, trainer.args) is None:
        return "as PEFT does (no float32 adapters under a low-precision autocast)"
    device_type = getattr(getattr(getattr(trainer, "accelerator", None), "device", None), "type", None) or (
        "cuda" if torch.cuda.is_available() else "cpu")
    layers = keep_inputs_under_autocast(trainer.model, device_type)
    return f"kept in the autocast dtype under autocast ({layers} LoRA layers)"
