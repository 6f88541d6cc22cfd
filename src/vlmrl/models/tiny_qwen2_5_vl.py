"""The tiny Qwen2.5-VL: a ViT with window attention and an M-RoPE decoder, random weights.

Kept from Qwen2.5-VL-3B/7B-Instruct: `Qwen2_5_VLForConditionalGeneration` and its processor, 14px patches
merged 2x2 into one language token, the CLIP normalisation, window attention in the vision tower (the hub's
112px windows, windowed layers first and a full-attention layer last), M-RoPE with the hub's section ratio,
untied embeddings and the Qwen tokenizer and chat layout (tiny_qwen.py, with the hub's default system turn).
Left out: every hub size, and video beyond what the processor class requires. The 14px patches round a
128px budget down to 112px: 8x8 patches, so the same 16 tokens per image as the other families.
"""

from __future__ import annotations

from typing import Any

from transformers import (
    GenerationConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLProcessor,
    Qwen2Tokenizer,
    Qwen2VLImageProcessor,
    Qwen2VLVideoProcessor,
)

from vlmrl.models.tiny_qwen import (
    patch_shape,
    pixel_budgets,
    qwen_generation_config,
    qwen_tokenizer,
    vision_token_ids,
)
from vlmrl.models.tiny_shared import HEAD_DIM, QWEN_MERGE, VISION_DEPTH, text_shape, vision_width

QWEN2_5_VL = "qwen2_5_vl"
PATCH_2_5 = 14  # Qwen2.5-VL's patch; Qwen3-VL and SigLIP use 16


def build_qwen2_5_vl_parts(
    hidden_size: int, num_layers: int, vocab_size: int, image_size: int
) -> tuple[Qwen2_5_VLConfig, Qwen2_5_VLProcessor, GenerationConfig]:
    """The config, processor and generation config of a tiny Qwen2.5-VL; the caller makes weights and saves."""
    tokenizer = qwen_tokenizer(vocab_size, default_system=True)
    return (
        _config(tokenizer, hidden_size, num_layers, vocab_size),
        _processor(tokenizer, image_size),
        qwen_generation_config(tokenizer),
    )


def _processor(tokenizer: Qwen2Tokenizer, image_size: int) -> Qwen2_5_VLProcessor:
    """Images are resized to at most image_size^2 pixels in 14px patches (128x128 -> 112x112 -> 16 tokens)."""
    pixels, video_pixels = pixel_budgets(image_size)
    shape = patch_shape(PATCH_2_5)
    # No image_mean/image_std: Qwen2.5-VL keeps the CLIP statistics, the image processor's default.
    image_processor = Qwen2VLImageProcessor(size=pixels, **shape)
    video_processor = Qwen2VLVideoProcessor(size=video_pixels, **shape)
    return Qwen2_5_VLProcessor(
        image_processor, tokenizer, video_processor, chat_template=tokenizer.chat_template
    )


def _config(tokenizer: Any, hidden_size: int, num_layers: int, vocab_size: int) -> Qwen2_5_VLConfig:
    ids = tokenizer.convert_tokens_to_ids
    width = vision_width(hidden_size)
    text = {
        **text_shape(hidden_size, num_layers, vocab_size),
        # The hub's [16, 24, 24] of 64 frequency pairs scaled to the 8 pairs of a 16-wide head.
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]},
        "bos_token_id": ids("<|endoftext|>"),
        "eos_token_id": ids("<|im_end|>"),
        "pad_token_id": ids("<|endoftext|>"),
    }
    vision = {
        "depth": VISION_DEPTH,
        "hidden_size": width,
        "intermediate_size": 2 * width,
        "num_heads": width // HEAD_DIM,
        "patch_size": PATCH_2_5,
        "spatial_merge_size": QWEN_MERGE,
        "out_hidden_size": hidden_size,
        "window_size": 112,  # hub value: 4x4 merged tokens per attention window
        "fullatt_block_indexes": [VISION_DEPTH - 1],  # windowed layers first, a full-attention layer last
    }
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, **vision_token_ids(ids), tie_word_embeddings=False
    )
