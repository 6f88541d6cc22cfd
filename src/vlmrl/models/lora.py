"""Stage 3, LoRA wrap: adapters on the language model's attention and MLP projections only, vision frozen.

The layout is checked after wrapping, not assumed: a trainable parameter anywhere in the vision tower or
projector, or a LoRA module outside the language layers, is an error. Unsloth's `get_peft_model` and
PEFT's produce the same layout, and the same check runs on both.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from vlmrl.config.schema import LoraConfig

log = logging.getLogger(__name__)

ATTENTION_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJ = ("gate_proj", "up_proj", "down_proj")
# Module-path fragments of the vision side (tower and projector) in Qwen2.5-VL / Qwen3-VL (`visual`), Gemma 3
# (`vision_tower`, `multi_modal_projector`) and SmolVLM/Idefics3 (`vision_model`, `connector`).
VISION_MARKERS = ("visual", "vision_tower", "multi_modal_projector", "vision_model", "connector")
# The decoder: `language_model` in Qwen-VL and Gemma 3, `text_model` in Idefics3.
LANGUAGE_MARKERS = ("language_model", "text_model")


class LoraLayoutError(RuntimeError):
    """The adapter layout is not what the config asked for."""


@dataclass(frozen=True)
class LoraReport:
    trainable_params: int
    total_params: int
    lora_modules: int
    vision_trainable_params: int

    def as_dict(self) -> dict:
        return {
            "trainable_params": self.trainable_params,
            "total_params": self.total_params,
            "trainable_percent": round(100 * self.trainable_params / max(self.total_params, 1), 4),
            "lora_modules": self.lora_modules,
            "vision_trainable_params": self.vision_trainable_params,
        }


def target_modules_regex(config: LoraConfig) -> str:
    """A PEFT `target_modules` regex (full match) selecting language-model projections only."""
    names = (ATTENTION_PROJ if config.attention else ()) + (MLP_PROJ if config.mlp else ())
    language = rf".*({'|'.join(LANGUAGE_MARKERS)})\..*\.({'|'.join(names)})" if names else None
    if config.vision:
        vision = rf".*({'|'.join(VISION_MARKERS)}).*\.(qkv|proj|q_proj|k_proj|v_proj|out_proj|fc1|fc2|linear_fc1|linear_fc2)"
        return f"({language})|({vision})" if language else vision
    if language is None:
        raise LoraLayoutError("lora.attention and lora.mlp are both false: no language module to adapt.")
    return language


def seed_all(seed: int) -> None:
    """Seed every generator a model build or a training draws from: Python's, NumPy's and torch's on every
    device (transformers' `set_seed`). PEFT draws LoRA's A matrices from torch's global generator."""
    from transformers import set_seed

    set_seed(seed)


def apply_lora(model: Any, config: LoraConfig, *, backend: str = "transformers", seed: int = 0) -> tuple[Any, LoraReport]:
    """Wrap `model` with LoRA as configured and verify the layout. Returns the PEFT model and its report. The
    initialisation is drawn from `seed` (run.seed) on either backend: the same seed gives the same adapter, bit
    for bit."""
    seed_all(seed)  # PEFT's path has no seed argument; Unsloth's gets random_state too
    if backend == "unsloth":
        from unsloth import FastVisionModel

        model = FastVisionModel.get_peft_model(
            model,
            finetune_vision_layers=config.vision,
            finetune_language_layers=True,
            finetune_attention_modules=config.attention,
            finetune_mlp_modules=config.mlp,
            r=config.r,
            lora_alpha=config.alpha,
            lora_dropout=config.dropout,
            bias="none",
            random_state=seed,
        )
    else:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        peft_config = PeftLoraConfig(
            r=config.r,
            lora_alpha=config.alpha,
            lora_dropout=config.dropout,
            target_modules=target_modules_regex(config),
            bias="none",
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, peft_config)
    report = verify_lora_layout(model, allow_vision=config.vision)
    log.info("LoRA: %s", report.as_dict())
    return model, report


def is_vision_param(name: str) -> bool:
    return any(re.search(rf"(^|\.){marker}(\.|$)", name) for marker in VISION_MARKERS)


def is_language_param(name: str) -> bool:
    """
    >>> is_language_param("model.text_model.layers.0.mlp.up_proj.lora_A.default.weight")
    True
    >>> is_language_param("model.connector.modality_projection.proj.weight")
    False
    """
    return not is_vision_param(name) and any(re.search(rf"(^|\.){m}(\.|$)", name) for m in LANGUAGE_MARKERS)


def verify_lora_layout(model: Any, *, allow_vision: bool = False) -> LoraReport:
    """Check that only LoRA weights train and that they sit in the language layers (and vision if allowed)."""
    trainable = total = vision_trainable = 0
    lora_modules: set[str] = set()
    problems: list[str] = []
    for name, param in model.named_parameters():
        total += param.numel()
        if "lora_" in name:
            lora_modules.add(name.split(".lora_")[0])
        if not param.requires_grad:
            continue
        trainable += param.numel()
        if "lora_" not in name:
            problems.append(f"non-LoRA parameter trains: {name}")
        if is_vision_param(name):
            vision_trainable += param.numel()
            if not allow_vision:
                problems.append(f"vision parameter trains: {name}")
        elif not is_language_param(name):
            problems.append(f"LoRA outside the language layers: {name}")
    if not lora_modules:
        problems.append("no LoRA module was inserted (target_modules matched nothing)")
    if problems:
        shown = "; ".join(problems[:5]) + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else "")
        raise LoraLayoutError(f"LoRA layout check failed: {shown}")
    return LoraReport(trainable, total, len(lora_modules), vision_trainable)
