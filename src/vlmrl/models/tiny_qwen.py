"""What the two tiny Qwen-VL generations share: the tokenizer, the chat template, pixel budgets, token ids.

Qwen3-VL (tiny_qwen3_vl.py) and Qwen2.5-VL (tiny_qwen2_5_vl.py) use the same byte-level BPE with Qwen's
pre-tokenizer and special tokens, the same `<|im_start|>role` chat layout (Qwen2.5-VL adds a default system
turn), the same vision placeholder tokens and the same end-of-reply rule, so these live once, here. Left out:
what differs between the generations (patch size, normalisation, the video processor class, the model
config), which each family's module keeps.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer
from transformers import GenerationConfig, Qwen2Tokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN_PRETOKENIZE_REGEX

from vlmrl.models.tiny_shared import QWEN_MERGE, train_bpe

# In the hub order, so ids keep the hub's relative layout (text vocabulary first, then these).
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip


def qwen_tokenizer(vocab_size: int, default_system: bool) -> Qwen2Tokenizer:
    """Byte-level BPE trained through the same normalizer and pre-tokenizer `Qwen2Tokenizer` rebuilds on load.

    `default_system` picks the chat template that adds "You are a helpful assistant." (Qwen2.5-VL's hub
    template) when a conversation has no system turn.
    """
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
        chat_template=qwen_chat_template(default_system),
    )


# ---------------------------------------------------------------------------------------------------------------
# chat template (Jinja, rendered by transformers with trim_blocks/lstrip_blocks; "\n" is a Jinja escape)

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


def qwen_chat_template(default_system: bool) -> str:
    """`<|im_start|>user\\n<|vision_start|><|image_pad|><|vision_end|>question<|im_end|>\\n` per turn."""
    return (_QWEN_CONTENT + (_QWEN_DEFAULT_SYSTEM if default_system else "") + _QWEN_TURNS).strip()


# ---------------------------------------------------------------------------------------------------------------
# processor budgets, token ids, generation


def pixel_budgets(image_size: int) -> tuple[dict[str, int], dict[str, int]]:
    """The image and video `size` budgets: an image gets at most image_size^2 pixels, a video that of 8 images.

    The processor classes require a video processor even though this project sends none.

    >>> pixel_budgets(128)
    ({'shortest_edge': 4096, 'longest_edge': 16384}, {'shortest_edge': 4096, 'longest_edge': 131072})
    """
    pixels = {"shortest_edge": (image_size // 2) ** 2, "longest_edge": image_size**2}
    video_pixels = {"shortest_edge": pixels["shortest_edge"], "longest_edge": 8 * pixels["longest_edge"]}
    return pixels, video_pixels


def patch_shape(patch: int) -> dict[str, int]:
    """The patch grid both generations' image and video processors take (2x2 merge, 2-frame temporal patch)."""
    return {"patch_size": patch, "merge_size": QWEN_MERGE, "temporal_patch_size": 2}


def vision_token_ids(ids: Any) -> dict[str, int]:
    """The placeholder ids a Qwen-VL config names, from the tokenizer's `convert_tokens_to_ids`."""
    return {
        "image_token_id": ids("<|image_pad|>"),
        "video_token_id": ids("<|video_pad|>"),
        "vision_start_token_id": ids("<|vision_start|>"),
        "vision_end_token_id": ids("<|vision_end|>"),
    }


def qwen_generation_config(tokenizer: Any) -> GenerationConfig:
    """Greedy by default; a chat reply ends at `<|im_end|>` (listed first, as on the hub).

    Unlike the hub's, it also suppresses the image and video placeholders: a random model samples them now and
    then, and a completion holding one breaks every later forward pass with the image (placeholders no longer
    match the image features). TRL suppresses the image token itself; plain `generate` calls need this.
    """
    ids = tokenizer.convert_tokens_to_ids
    end = ids("<|endoftext|>")
    return GenerationConfig(
        bos_token_id=end,
        eos_token_id=[ids("<|im_end|>"), end],
        pad_token_id=end,
        suppress_tokens=[ids("<|image_pad|>"), ids("<|video_pad|>")],
    )
