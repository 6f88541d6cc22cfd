"""The tiny SmolVLM (Idefics3): a SigLIP tower, a pixel-shuffle connector and a Llama decoder, random weights.

Kept from SmolVLM-256M/500M-Instruct: `Idefics3ForConditionalGeneration` and its processor, the image layout
(`<fake_token_around_image><global-img>` then the `<image>` tokens), pixel shuffle (scale factor 2 here, 4 on
the hub) into a linear connector, a byte-level GPT-2 tokenizer with the hub's special tokens in the hub's order
(`<|endoftext|>`, `<|im_start|>`, `<|im_end|>` first; image tokens, `<end_of_utterance>` and the 36
`<row_i_col_j>` tags after the text vocabulary), the `User:`/`Assistant:` chat layout and tied embeddings.
Left out: image splitting (the hub cuts large images into tiles plus a global view; here every image is one
global view of image_size x image_size, (image_size/32)^2 tokens) and every hub size.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer
from transformers import (
    GenerationConfig,
    GPT2Tokenizer,
    Idefics3Config,
    Idefics3ImageProcessor,
    Idefics3Processor,
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

IDEFICS3 = "idefics3"
SCALE_FACTOR = PIXELS_PER_TOKEN // PATCH  # pixel shuffle folds 2x2 patches into one token
ROW_COL_TOKENS = tuple(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))
# Hub order: these three open the vocabulary, the image tokens follow the text vocabulary.
LEADING_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TRAILING_SPECIAL_TOKENS = (
    "<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", *ROW_COL_TOKENS,
)  # fmt: skip

# SmolVLM-Instruct's layout: `<|im_start|>User:<image>question<end_of_utterance>\nAssistant:`. The hub template
# indexes content[0] and so fails on string contents; this one takes both, as the other families' do.
CHAT_TEMPLATE = r"""
{%- macro render_content(content) -%}
{%- if content is string -%}{{- ' ' ~ content -}}
{%- else -%}
{%- if content and (content[0].type == 'image' or 'image' in content[0]) -%}{{- ':' -}}{%- else -%}{{- ': ' -}}{%- endif -%}
{%- for part in content -%}
{%- if part.type == 'image' or 'image' in part -%}{{- '<image>' -}}
{%- elif 'text' in part -%}{{- part.text -}}
{%- endif -%}
{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{{- '<|im_start|>' -}}
{%- for message in messages -%}
{%- if message.content is string -%}{{- message.role | capitalize ~ ':' -}}{%- else -%}{{- message.role | capitalize -}}{%- endif -%}
{{- render_content(message.content) ~ '<end_of_utterance>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- 'Assistant:' -}}{%- endif -%}
""".strip()


def build_idefics3_parts(
    hidden_size: int, num_layers: int, vocab_size: int, image_size: int
) -> tuple[Idefics3Config, Idefics3Processor, GenerationConfig]:
    """The config, processor and generation config of a tiny SmolVLM; the caller makes weights and saves."""
    tokenizer = _tokenizer(vocab_size)
    processor = _processor(tokenizer, image_size)
    return (
        _config(tokenizer, hidden_size, num_layers, vocab_size, image_size),
        processor,
        _generation(tokenizer),
    )


def _tokenizer(vocab_size: int) -> GPT2Tokenizer:
    """Byte-level BPE through the same pre-tokenizer `GPT2Tokenizer` rebuilds on load (SmolLM2's tokenizer)."""
    backend = Tokenizer(BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = len(LEADING_SPECIAL_TOKENS) + len(TRAILING_SPECIAL_TOKENS)
    trainer = BpeTrainer(
        vocab_size=vocab_size - specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is a token: no input can fail
        show_progress=False,
    )
    learned, merges = train_bpe(backend, trainer)
    tokens = [*LEADING_SPECIAL_TOKENS, *learned, *TRAILING_SPECIAL_TOKENS]
    return GPT2Tokenizer(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=merges,
        unk_token="<|endoftext|>",
        bos_token="<|im_start|>",  # as on the hub; the chat template writes it, so prompts add none
        eos_token="<end_of_utterance>",  # chat replies end with it
        pad_token="<|im_end|>",
        extra_special_tokens=[t for t in TRAILING_SPECIAL_TOKENS if t != "<end_of_utterance>"],
        chat_template=CHAT_TEMPLATE,
    )


def _processor(tokenizer: GPT2Tokenizer, image_size: int) -> Idefics3Processor:
    """Every image is squared to image_size (no tiling): (image_size/16)^2 patches shuffle into /4 tokens."""
    image_processor = Idefics3ImageProcessor(
        size={"longest_edge": image_size},
        max_image_size={"longest_edge": image_size},
        do_image_splitting=False,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    )
    return Idefics3Processor(
        image_processor,
        tokenizer,
        image_seq_len=(image_size // PIXELS_PER_TOKEN) ** 2,
        chat_template=CHAT_TEMPLATE,
    )


def _config(
    tokenizer: Any, hidden_size: int, num_layers: int, vocab_size: int, image_size: int
) -> Idefics3Config:
    ids = tokenizer.convert_tokens_to_ids
    width = vision_width(hidden_size)
    text = {
        "model_type": "llama",
        **text_shape(hidden_size, num_layers, vocab_size),
        "head_dim": HEAD_DIM,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100_000.0},
        "bos_token_id": ids("<|im_start|>"),
        "eos_token_id": ids("<end_of_utterance>"),
        "pad_token_id": ids("<|im_end|>"),
        "tie_word_embeddings": True,
    }
    vision = {
        "hidden_size": width,
        "intermediate_size": 2 * width,
        "num_hidden_layers": VISION_DEPTH,
        "num_attention_heads": width // HEAD_DIM,
        "image_size": image_size,
        "patch_size": PATCH,
    }
    return Idefics3Config(
        text_config=text,
        vision_config=vision,
        scale_factor=SCALE_FACTOR,
        image_token_id=ids("<image>"),
        pad_token_id=ids("<|im_end|>"),
        tie_word_embeddings=True,
    )


def _generation(tokenizer: Any) -> GenerationConfig:
    """Greedy; a reply ends at `<end_of_utterance>`. The image tags are suppressed as in the other families."""
    ids = tokenizer.convert_tokens_to_ids
    return GenerationConfig(
        bos_token_id=ids("<|im_start|>"),
        eos_token_id=[ids("<end_of_utterance>"), ids("<|endoftext|>")],
        pad_token_id=ids("<|im_end|>"),
        suppress_tokens=[ids(t) for t in ("<image>", "<fake_token_around_image>", "<global-img>")],
    )
