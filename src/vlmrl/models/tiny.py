"""Offline tiny vision-language models: real transformers architectures, random weights, a small tokenizer.

Tests and the demo run need a model without the network. A tiny model is an ordinary Hugging Face folder
(config.json, model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json,
processor_config.json, chat_template.jinja) written by the family's own config, model, tokenizer and
processor classes, so it loads through exactly the path a hub checkpoint takes:
`AutoModelForImageTextToText.from_pretrained(path)` and `AutoProcessor.from_pretrained(path)`.

Kept from each family: the architecture and its code paths (interleaved M-RoPE and DeepStack for Qwen3-VL,
window attention for Qwen2.5-VL, a SigLIP tower pooled to soft tokens and sliding/global layers for Gemma 3,
pixel shuffle for SmolVLM), the special tokens and their roles, the tokenizer pipeline and the chat layout.
Deliberately not kept: sizes. The text vocabulary is ~1k tokens (with a 151k vocabulary the CPU log-prob pass
of one GRPO step takes ~70 s), an image costs 16 tokens at the default 128x128 budget, and nothing is trained.

This module is the front: it checks the sizes, asks the family's module for its config, processor and
generation config, makes the random weights and writes the folder. One module per family holds the rest:
tiny_qwen3_vl.py, tiny_qwen2_5_vl.py (both on tiny_qwen.py's tokenizer and chat template), tiny_gemma3.py and
tiny_idefics3.py (SmolVLM); tiny_shared.py has what all of them use (corpus, BPE training, shapes, saving).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import (
    AutoModelForImageTextToText,
    AutoProcessor,
    Gemma3Config,
    PreTrainedConfig,
    PreTrainedModel,
)

from vlmrl.models import TINY_ARCHS
from vlmrl.models.tiny_gemma3 import GEMMA3, build_gemma3_parts, unblind_projection
from vlmrl.models.tiny_idefics3 import IDEFICS3, build_idefics3_parts
from vlmrl.models.tiny_qwen2_5_vl import QWEN2_5_VL, build_qwen2_5_vl_parts
from vlmrl.models.tiny_qwen3_vl import QWEN3_VL, build_qwen3_vl_parts
from vlmrl.models.tiny_shared import (
    VISION_DEPTH,
    check_sizes,
    count_params,
    save_folder,
    tokenizer_corpus,  # noqa: F401 (re-exported: callers may read it from here)
)

# Each family's parts: (hidden_size, num_layers, vocab_size, image_size) -> (config, processor, generation).
_BUILD_PARTS = {
    QWEN3_VL: build_qwen3_vl_parts,
    QWEN2_5_VL: build_qwen2_5_vl_parts,
    GEMMA3: build_gemma3_parts,
    IDEFICS3: build_idefics3_parts,
}
# The CLI lists TINY_ARCHS without importing this module; a family added on one side only fails here, at import.
if tuple(_BUILD_PARTS) != TINY_ARCHS:
    raise RuntimeError(f"vlmrl.models.TINY_ARCHS {TINY_ARCHS} != tiny builders {tuple(_BUILD_PARTS)}")


def build_tiny_model(
    arch: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_size: int = 1024,
    image_size: int = 128,
    vision_depth: int = VISION_DEPTH,
) -> Path:
    """Write a random-weight `arch` model with its tokenizer, processor and chat template to `out_dir`.

    `vocab_size` is the number of embedding rows; the tokenizer is trained to fill at most that many ids.
    `image_size` is the pixel budget per side: any input image becomes about (image_size/32)^2 image tokens,
    16 at 128 (exactly so for a square input; Qwen2.5-VL's 14px patches round 128 down to 112).
    `vision_depth` (vision transformer blocks) can grow for Qwen3-VL only: the GPU demo's policy must learn to
    read its figures; the other families keep the tiny default. The same arguments and seed give the same files.
    """
    check_sizes(arch, TINY_ARCHS, hidden_size, num_layers, vocab_size, image_size)
    if vision_depth != VISION_DEPTH and arch != QWEN3_VL:
        raise ValueError(f"vision_depth={vision_depth}: only the qwen3_vl tiny build takes another vision depth.")
    if vision_depth < 1:
        raise ValueError(f"vision_depth={vision_depth}: use at least 1.")
    if arch == QWEN3_VL:
        config, processor, generation_config = build_qwen3_vl_parts(hidden_size, num_layers, vocab_size, image_size,
                                                                     vision_depth)
    else:
        config, processor, generation_config = _BUILD_PARTS[arch](hidden_size, num_layers, vocab_size, image_size)
    model = _random_model(config, seed)
    model.generation_config = generation_config
    return save_folder(model, processor, Path(out_dir))


def tiny_model_summary(path: str | Path) -> dict[str, Any]:
    """What a folder holds: arch, parameter count, vocabulary, and image tokens for a 512x512 input."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    processor = AutoProcessor.from_pretrained(path)
    return {
        "arch": config["model_type"],
        "params": count_params(path),
        "vocab_size": len(processor.tokenizer),
        "embedding_rows": config["text_config"]["vocab_size"],
        "image_tokens_per_image": count_image_tokens(processor),
    }


def count_image_tokens(processor: Any, size: int = 512) -> int:
    """How many image-token positions one size x size image takes in `processor`'s input_ids."""
    image = Image.new("RGB", (size, size), "white")
    batch = processor(text=[processor.image_token], images=[image], return_tensors="pt")
    # Gemma's prompts carry <start_of_image>, which its processor expands into the tokenizer's soft tokens.
    expanded = getattr(processor.tokenizer, "image_token", None) or processor.image_token
    return int((batch["input_ids"] == processor.tokenizer.convert_tokens_to_ids(expanded)).sum())


def _random_model(config: PreTrainedConfig, seed: int) -> PreTrainedModel:
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    if isinstance(config, Gemma3Config):
        unblind_projection(model)  # drawn right after the weights, from the same seeded generator
    return model.eval()
