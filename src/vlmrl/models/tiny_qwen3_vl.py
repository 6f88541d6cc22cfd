"""The tiny Qwen3-VL: a ViT with a learned position grid and DeepStack, and an M-RoPE decoder, random weights.

Kept from Qwen3-VL-2B/4B/8B-Instruct: `Qwen3VLForConditionalGeneration` and its processor, 16px patches
merged 2x2 into one language token, images normalised to [-1, 1], interleaved M-RoPE (time, height and width
frequencies alternating across the head), DeepStack (an intermediate vision layer fed into the first text
layer), untied embeddings and the Qwen tokenizer and chat layout (tiny_qwen.py; no default system turn).
Left out: every hub size, and video beyond what the processor class requires.
"""

from __future__ import annotations

from typing import Any

from transformers import (
    GenerationConfig,
    Qwen2Tokenizer,
    Qwen2VLImageProcessor,
    Qwen3VLConfig,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

from vlmrl.models.tiny_qwen import (
    patch_shape,
    pixel_budgets,
    qwen_generation_config,
    qwen_tokenizer,
    vision_token_ids,
)
from vlmrl.models.tiny_shared import HEAD_DIM, PATCH, QWEN_MERGE, VISION_DEPTH, text_shape, vision_width

QWEN3_VL = "qwen3_vl"


def build_qwen3_vl_parts(
    hidden_size: int, num_layers: int, vocab_size: int, image_size: int, vision_depth: int = VISION_DEPTH
) -> tuple[Qwen3VLConfig, Qwen3VLProcessor, GenerationConfig]:
    """The config, processor and generation config of a tiny Qwen3-VL; the caller makes weights and saves.
    `vision_depth` can grow beyond the tiny default: the GPU demo's policy must learn to read its figures."""
    tokenizer = qwen_tokenizer(vocab_size, default_system=False)
    return (
        _config(tokenizer, hidden_size, num_layers, vocab_size, image_size, vision_depth),
        _processor(tokenizer, image_size),
        qwen_generation_config(tokenizer),
    )


def _processor(tokenizer: Qwen2Tokenizer, image_size: int) -> Qwen3VLProcessor:
    """Images are resized to at most image_size^2 pixels (128x128 -> 8x8 patches -> 16 merged tokens)."""
    stats = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3}  # Qwen3-VL normalises to [-1, 1]
    pixels, video_pixels = pixel_budgets(image_size)
    shape = patch_shape(PATCH)
    image_processor = Qwen2VLImageProcessor(size=pixels, **shape, **stats)
    video_processor = Qwen3VLVideoProcessor(size=video_pixels, **shape, **stats)
    return Qwen3VLProcessor(
        image_processor, tokenizer, video_processor, chat_template=tokenizer.chat_template
    )


def _config(
    tokenizer: Any, hidden_size: int, num_layers: int, vocab_size: int, image_size: int, vision_depth: int
) -> Qwen3VLConfig:
    ids = tokenizer.convert_tokens_to_ids
    width = vision_width(hidden_size)
    text = {
        **text_shape(hidden_size, num_layers, vocab_size),
        "head_dim": HEAD_DIM,
        # The hub's [24, 20, 20] (T, H, W frequency pairs of a 128-wide head) scaled to 8 pairs; interleaved
        # layout needs 3 * section[1] <= head_dim / 2.
        "rope_parameters": {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [4, 2, 2],
                            "mrope_interleaved": True},
        "pad_token_id": ids("<|endoftext|>"),
    }  # fmt: skip
    vision = {
        "depth": vision_depth,
        "hidden_size": width,
        "intermediate_size": 2 * width,
        "num_heads": width // HEAD_DIM,
        "patch_size": PATCH,
        "spatial_merge_size": QWEN_MERGE,
        "out_hidden_size": hidden_size,
        "num_position_embeddings": (image_size // PATCH) ** 2,  # a learned grid, interpolated to each image
        # An intermediate vision layer feeds the first text layer, as layers 8/16/24 do on the 8B model.
        "deepstack_visual_indexes": [0],
    }
    return Qwen3VLConfig(
        text_config=text, vision_config=vision, **vision_token_ids(ids), tie_word_embeddings=False
    )
