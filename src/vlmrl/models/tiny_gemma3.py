"""The tiny Gemma 3: a SigLIP tower pooled to soft tokens and a sliding/global-attention decoder, random weights.

Kept from Gemma 3 4B/12B/27B-it: `Gemma3ForConditionalGeneration` and its processor, the SigLIP vision tower
(no pooling head) whose patch grid is average-pooled into a fixed number of soft tokens per image, the
decoder's local (sliding-window) layers with a global one every sixth, tied embeddings, the tokenizer
pipeline (byte-fallback BPE over "▁"-joined text, special tokens at the hub's ids 0-4, 256 byte tokens) and
the chat layout (no system role; the assistant is called "model"; `<start_of_image>` expands to soft tokens).
Left out: every hub size, pan-and-scan cropping (an image is squashed to image_size x image_size), and the
hub's zero-initialised image projection, which would make a random model blind (see `unblind_projection`).
"""

from __future__ import annotations

from typing import Any

import torch
from tokenizers import Tokenizer, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer
from transformers import (
    Gemma3Config,
    Gemma3ImageProcessor,
    Gemma3Processor,
    GemmaTokenizer,
    GenerationConfig,
    PreTrainedModel,
)

from vlmrl.models.tiny_shared import (
    HEAD_DIM,
    PATCH,
    PIXELS_PER_TOKEN,
    VISION_DEPTH,
    text_shape,
    train_bpe,
    vision_width,
)

GEMMA3 = "gemma3"
# Gemma puts pad/eos/bos/unk/mask at ids 0-4; the 256 byte-fallback tokens follow these.
GEMMA_SPECIAL_TOKENS = (
    "<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>",
    "<start_of_image>", "<end_of_image>", "<image_soft_token>",
)  # fmt: skip
GEMMA_BYTE_TOKENS = tuple(f"<0x{b:02X}>" for b in range(256))  # the format tokenizers' ByteFallback decodes

# Gemma has no system role: the system text opens the first user turn, and the assistant is called "model".
# (Jinja, rendered by transformers with trim_blocks/lstrip_blocks; "\n" is a Jinja escape.)
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


def build_gemma3_parts(
    hidden_size: int, num_layers: int, vocab_size: int, image_size: int
) -> tuple[Gemma3Config, Gemma3Processor, GenerationConfig]:
    """The config, processor and generation config of a tiny Gemma 3; the caller makes weights and saves.

    The caller must pass its random model through `unblind_projection` before saving.
    """
    tokenizer = _tokenizer(vocab_size)
    return (
        _config(tokenizer, hidden_size, num_layers, vocab_size, image_size),
        _processor(tokenizer, image_size),
        _generation(tokenizer),
    )


def unblind_projection(model: PreTrainedModel) -> None:
    """Draw the image projection from the initializer's normal distribution, in place.

    Gemma initialises the image projection to zeros, which would make a random model blind: every image
    would embed as the same vector and no reward could ever depend on what the picture shows.
    """
    torch.nn.init.normal_(
        model.model.multi_modal_projector.mm_input_projection_weight, std=model.config.initializer_range
    )


def _tokenizer(vocab_size: int) -> GemmaTokenizer:
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


def _processor(tokenizer: GemmaTokenizer, image_size: int) -> Gemma3Processor:
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


def _config(
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


def _generation(tokenizer: Any) -> GenerationConfig:
    """Greedy; a reply ends at `<end_of_turn>` (listed first, as on the hub). The soft image token is
    suppressed, as the Qwen placeholders are (tiny_qwen.py says why)."""
    ids = tokenizer.convert_tokens_to_ids
    return GenerationConfig(
        bos_token_id=ids("<bos>"),
        eos_token_id=[ids("<end_of_turn>"), ids("<eos>")],
        pad_token_id=ids("<pad>"),
        suppress_tokens=[ids("<image_soft_token>")],
    )
