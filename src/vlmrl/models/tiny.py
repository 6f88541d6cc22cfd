"""Offline tiny vision-language models: real transformers architectures, random weights, a small tokenizer.

Tests and the demo run need a model without the network. A tiny model is an ordinary Hugging Face folder
(config.json, model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json,
processor_config.json, chat_template.jinja) written by the family's own config, model, tokenizer and
processor classes, so it loads through exactly the path a hub checkpoint takes:
`AutoModelForImageTextToText.from_pretrained(path)` and `AutoProcessor.from_pretrained(path)`.

Kept from each family: the architecture and its code paths (interleaved M-RoPE and DeepStack for Qwen3-VL,
window attention for Qwen2.5-VL, a SigLIP tower pooled to soft tokens and sliding/global layers for Gemma 3),
the special tokens and their roles, the tokenizer pipeline (byte-level BPE with Qwen's pre-tokenizer;
byte-fallback BPE over "▁"-joined text for Gemma) and the chat layout. Deliberately not kept: sizes. The text
vocabulary is ~1k tokens (with a 151k vocabulary the CPU log-prob pass of one GRPO step takes ~70 s), an
image costs 16 tokens at the default 128x128 budget, and nothing is trained.

This module builds Qwen3-VL, Qwen2.5-VL and Gemma 3 and dispatches on `arch`; SmolVLM (Idefics3) is built in
tiny_idefics3.py, and what all families share (corpus, BPE training, shapes, writing the folder) is in
tiny_shared.py. A later split can move each remaining family into its own module the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer
from transformers import (
    AutoModelForImageTextToText,
    AutoProcessor,
    Gemma3Config,
    Gemma3ImageProcessor,
    Gemma3Processor,
    GemmaTokenizer,
    GenerationConfig,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2_5_VLConfig,
    Qwen2_5_VLProcessor,
    Qwen2Tokenizer,
    Qwen2VLImageProcessor,
    Qwen2VLVideoProcessor,
    Qwen3VLConfig,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN_PRETOKENIZE_REGEX

from vlmrl.models import TINY_ARCHS
from vlmrl.models.tiny_idefics3 import IDEFICS3, build_idefics3_parts
from vlmrl.models.tiny_shared import (
    HEAD_DIM,
    PATCH,
    PIXELS_PER_TOKEN,
    QWEN_MERGE,
    VISION_DEPTH,
    check_sizes,
    count_params,
    save_folder,
    text_shape,
    tokenizer_corpus,  # noqa: F401 (re-exported: tests and callers read it from here)
    train_bpe,
    vision_width,
)

# In the hub order, so ids keep the hub's relative layout (text vocabulary first, then these).
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip
# Gemma puts pad/eos/bos/unk/mask at ids 0-4; the 256 byte-fallback tokens follow these.
GEMMA_SPECIAL_TOKENS = (
    "<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>",
    "<start_of_image>", "<end_of_image>", "<image_soft_token>",
)  # fmt: skip
GEMMA_BYTE_TOKENS = tuple(f"<0x{b:02X}>" for b in range(256))  # the format tokenizers' ByteFallback decodes


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
    if vision_depth != VISION_DEPTH and arch != "qwen3_vl":
        raise ValueError(f"vision_depth={vision_depth}: only the qwen3_vl tiny build takes another vision depth.")
    if vision_depth < 1:
        raise ValueError(f"vision_depth={vision_depth}: use at least 1.")
    if arch == IDEFICS3:
        config, processor, generation_config = build_idefics3_parts(
            hidden_size, num_layers, vocab_size, image_size
        )
        model = _random_model(config, seed)
        model.generation_config = generation_config
        return save_folder(model, processor, Path(out_dir))
    if arch == "gemma3":
        tokenizer = _gemma_tokenizer(vocab_size)
        processor = _gemma_processor(tokenizer, image_size)
        config = _gemma3_config(tokenizer, hidden_size, num_layers, vocab_size, image_size)
    else:
        tokenizer = _qwen_tokenizer(vocab_size, arch)
        processor = _qwen_processor(arch, tokenizer, image_size)
        if arch == "qwen3_vl":
            config = _qwen3_vl_config(tokenizer, hidden_size, num_layers, vocab_size, image_size, vision_depth)
        else:
            config = _qwen2_5_vl_config(tokenizer, hidden_size, num_layers, vocab_size, image_size)
    model = _random_model(config, seed)
    model.generation_config = _generation_config(arch, tokenizer)
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


# ---------------------------------------------------------------------------------------------------------------
# tokenizers


def _qwen_tokenizer(vocab_size: int, arch: str) -> Qwen2Tokenizer:
    """Byte-level BPE trained through the same normalizer and pre-tokenizer `Qwen2Tokenizer` rebuilds on load."""
    backend = Tokenizer(BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated"),  # also splits digits one by one
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    trainer = BpeTrainer(
        vocab_size=vocab_size - len(QWEN_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is a token: no input can fail
        show_progress=False,
    )
    learned, merges = train_bpe(backend, trainer)
    vocab = {token: i for i, token in enumerate([*learned, *QWEN_SPECIAL_TOKENS])}
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,  # byte-level: nothing is unknown
        bos_token=None,
        eos_token="<|im_end|>",  # as on the hub: chat replies end with it
        pad_token="<|endoftext|>",
        extra_special_tokens=[t for t in QWEN_SPECIAL_TOKENS if t not in ("<|im_end|>", "<|endoftext|>")],
        chat_template=_qwen_chat_template(default_system=arch == "qwen2_5_vl"),
    )


def _gemma_tokenizer(vocab_size: int) -> GemmaTokenizer:
    """BPE with byte fallback over "▁"-joined text, like Gemma's SentencePiece model converted by transformers.

    Training splits at word starts and between digits so that no merge crosses a word or joins two digits
    (Gemma's vocabulary has no multi-digit tokens); `GemmaTokenizer` then applies the merges to whole lines.
    """
    backend = Tokenizer(BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("▁", behavior="merged_with_next"),
        pre_tokenizers.Digits(individual_digits=True),
    ])  # fmt: skip
    trainer = BpeTrainer(vocab_size=vocab_size - len(GEMMA_SPECIAL_TOKENS) - 256, show_progress=False)
    learned, merges = train_bpe(backend, trainer)
    vocab = {token: i for i, token in enumerate([*GEMMA_SPECIAL_TOKENS, *GEMMA_BYTE_TOKENS, *learned])}
    return GemmaTokenizer(
        vocab=vocab,
        merges=merges,
        # As on the hub. The chat template writes <bos> itself, so prompts are tokenized without special
        # tokens (TRL does so; the processor's apply_chat_template(tokenize=True) detects it).
        add_bos_token=True,
        boi_token="<start_of_image>",  # these three are what Gemma3Processor reads from the tokenizer
        eoi_token="<end_of_image>",
        image_token="<image_soft_token>",
        extra_special_tokens=["<start_of_turn>", "<end_of_turn>"],  # special, so decoding can skip them
        chat_template=GEMMA_CHAT_TEMPLATE,
    )


# ---------------------------------------------------------------------------------------------------------------
# chat templates (Jinja, rendered by transformers with trim_blocks/lstrip_blocks; "\n" is a Jinja escape)

_QWEN_CONTENT = r"""
{%- macro render_content(content) -%}
{%- if content is string -%}{{- content -}}
{%- else -%}{%- for part in content -%}
{%- if part.type == 'image' or 'image' in part or 'image_url' in part -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
{%- elif part.type == 'video' or 'video' in part -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
{%- elif 'text' in part -%}{{- part.text -}}
{%- endif -%}
{%- endfor -%}{%- endif -%}
{%- endmacro -%}
"""

_QWEN_TURNS = r"""
{%- for message in messages -%}
{{- '<|im_start|>' ~ message.role ~ '\n' ~ render_content(message.content) ~ '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""

# Qwen2.5-VL's hub template adds this system turn when the conversation has none; Qwen3-VL's does not.
_QWEN_DEFAULT_SYSTEM = r"""
{%- if not messages or messages[0].role != 'system' -%}
{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' -}}
{%- endif -%}
"""


def _qwen_chat_template(default_system: bool) -> str:
    """`<|im_start|>user\\n<|vision_start|><|image_pad|><|vision_end|>question<|im_end|>\\n` per turn."""
    return (_QWEN_CONTENT + (_QWEN_DEFAULT_SYSTEM if default_system else "") + _QWEN_TURNS).strip()


# Gemma has no system role: the system text opens the first user turn, and the assistant is called "model".
GEMMA_CHAT_TEMPLATE = r"""
{%- macro render_content(content) -%}
{%- if content is string -%}{{- content | trim -}}
{%- else -%}{%- for part in content -%}
{%- if part.type == 'image' or 'image' in part -%}{{- '<start_of_image>' -}}
{%- elif 'text' in part -%}{{- part.text | trim -}}
{%- endif -%}
{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{{- '<bos>' -}}
{%- if messages and messages[0].role == 'system' -%}
{%- set system_prefix = render_content(messages[0].content) ~ '\n\n' -%}
{%- set turns = messages[1:] -%}
{%- else -%}
{%- set system_prefix = '' -%}
{%- set turns = messages -%}
{%- endif -%}
{%- for message in turns -%}
{{- '<start_of_turn>' ~ ('model' if message.role == 'assistant' else message.role) ~ '\n' -}}
{%- if loop.first -%}{{- system_prefix -}}{%- endif -%}
{{- render_content(message.content) ~ '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}
""".strip()


# ---------------------------------------------------------------------------------------------------------------
# processors


def _qwen_processor(
    arch: str, tokenizer: Qwen2Tokenizer, image_size: int
) -> Qwen3VLProcessor | Qwen2_5_VLProcessor:
    """Images are resized to at most image_size^2 pixels (128x128 -> 8x8 patches -> 16 merged tokens)."""
    patch = PATCH if arch == "qwen3_vl" else 14
    # Qwen3-VL normalises to [-1, 1]; Qwen2.5-VL keeps the CLIP statistics (the image processor's default).
    stats = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3} if arch == "qwen3_vl" else {}
    pixels = {"shortest_edge": (image_size // 2) ** 2, "longest_edge": image_size**2}
    shape = {"patch_size": patch, "merge_size": QWEN_MERGE, "temporal_patch_size": 2}
    image_processor = Qwen2VLImageProcessor(size=pixels, **shape, **stats)
    # The processor classes require a video processor; videos get the budget of 8 images.
    video_pixels = {"shortest_edge": pixels["shortest_edge"], "longest_edge": 8 * pixels["longest_edge"]}
    if arch == "qwen3_vl":
        video_processor = Qwen3VLVideoProcessor(size=video_pixels, **shape, **stats)
        return Qwen3VLProcessor(
            image_processor, tokenizer, video_processor, chat_template=tokenizer.chat_template
        )
    video_processor = Qwen2VLVideoProcessor(size=video_pixels, **shape)
    return Qwen2_5_VLProcessor(
        image_processor, tokenizer, video_processor, chat_template=tokenizer.chat_template
    )


def _gemma_processor(tokenizer: GemmaTokenizer, image_size: int) -> Gemma3Processor:
    """Images are squashed to image_size x image_size; the processor writes (image_size/32)^2 soft tokens."""
    image_processor = Gemma3ImageProcessor(
        size={"height": image_size, "width": image_size}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    return Gemma3Processor(
        image_processor,
        tokenizer,
        chat_template=GEMMA_CHAT_TEMPLATE,
        image_seq_length=(image_size // PIXELS_PER_TOKEN) ** 2,
    )


# ---------------------------------------------------------------------------------------------------------------
# model configs


def _qwen3_vl_config(
    tokenizer: Any, hidden_size: int, num_layers: int, vocab_size: int, image_size: int,
    vision_depth: int = VISION_DEPTH,
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
        text_config=text, vision_config=vision, **_qwen_vision_ids(ids), tie_word_embeddings=False
    )


def _qwen2_5_vl_config(
    tokenizer: Any, hidden_size: int, num_layers: int, vocab_size: int, image_size: int
) -> Qwen2_5_VLConfig:
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
        "patch_size": 14,
        "spatial_merge_size": QWEN_MERGE,
        "out_hidden_size": hidden_size,
        "window_size": 112,  # hub value: 4x4 merged tokens per attention window
        "fullatt_block_indexes": [VISION_DEPTH - 1],  # windowed layers first, a full-attention layer last
    }
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, **_qwen_vision_ids(ids), tie_word_embeddings=False
    )


def _qwen_vision_ids(ids: Any) -> dict[str, int]:
    return {
        "image_token_id": ids("<|image_pad|>"),
        "video_token_id": ids("<|video_pad|>"),
        "vision_start_token_id": ids("<|vision_start|>"),
        "vision_end_token_id": ids("<|vision_end|>"),
    }


def _gemma3_config(
    tokenizer: Any, hidden_size: int, num_layers: int, vocab_size: int, image_size: int
) -> Gemma3Config:
    ids = tokenizer.convert_tokens_to_ids
    width = vision_width(hidden_size)
    text = {
        **text_shape(hidden_size, num_layers, vocab_size),
        "head_dim": HEAD_DIM,
        "query_pre_attn_scalar": HEAD_DIM,
        "sliding_window": 512,
        # The hub's five local layers per global one, with the last layer always global so both kinds run.
        "layer_types": [
            "full_attention" if (i + 1) % 6 == 0 or i == num_layers - 1 else "sliding_attention"
            for i in range(num_layers)
        ],
        "pad_token_id": ids("<pad>"),
        "eos_token_id": ids("<eos>"),
        "bos_token_id": ids("<bos>"),
    }
    vision = {
        "model_type": "siglip_vision_model",
        "hidden_size": width,
        "intermediate_size": 2 * width,
        "num_hidden_layers": VISION_DEPTH,
        "num_attention_heads": width // HEAD_DIM,
        "image_size": image_size,
        "patch_size": PATCH,
        "vision_use_head": False,
    }
    return Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=(image_size // PIXELS_PER_TOKEN) ** 2,
        boi_token_index=ids("<start_of_image>"),
        eoi_token_index=ids("<end_of_image>"),
        image_token_index=ids("<image_soft_token>"),
        tie_word_embeddings=True,
    )


def _generation_config(arch: str, tokenizer: Any) -> GenerationConfig:
    """Greedy by default; a chat reply ends at the end-of-turn token (listed first, as on the hub).

    Unlike the hub's, it also suppresses the image placeholders: a random model samples them now and then, and a
    completion holding one breaks every later forward pass with the image (placeholders no longer match the
    image features). TRL suppresses the image token itself; plain `generate` calls need this.
    """
    ids = tokenizer.convert_tokens_to_ids
    if arch == "gemma3":
        return GenerationConfig(
            bos_token_id=ids("<bos>"),
            eos_token_id=[ids("<end_of_turn>"), ids("<eos>")],
            pad_token_id=ids("<pad>"),
            suppress_tokens=[ids("<image_soft_token>")],
        )
    end = ids("<|endoftext|>")
    return GenerationConfig(
        bos_token_id=end,
        eos_token_id=[ids("<|im_end|>"), end],
        pad_token_id=end,
        suppress_tokens=[ids("<|image_pad|>"), ids("<|video_pad|>")],
    )


# ---------------------------------------------------------------------------------------------------------------
# weights and files


def _random_model(config: PreTrainedConfig, seed: int) -> PreTrainedModel:
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    if isinstance(config, Gemma3Config):
        # Gemma initialises the image projection to zeros, which would make a random model blind: every image
        # would embed as the same vector and no reward could ever depend on what the picture shows.
        torch.nn.init.normal_(
            model.model.multi_modal_projector.mm_input_projection_weight, std=config.initializer_range
        )
    return model.eval()
