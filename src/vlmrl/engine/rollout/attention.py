"""Grouped-query attention without copying the KV cache: `vlmrl_sdpa`, a drop-in for transformers' `sdpa`.

With fewer key/value heads than query heads (Qwen3-VL-8B: 8 for 32), transformers' SDPA path copies the keys and
values once per query head of a group (`repeat_kv`) whenever dynamo traces or a mask is given: at every token step
of a compiled static-cache decode, the whole cache several times over. `vlmrl_sdpa` folds instead, for any query
length, whenever a mask shared by all heads is given: the G = heads / kv_heads query heads of one group become
G x Q query rows against their own KV head, the mask is tiled G times along the query axis, and the result is
unfolded. The same attention, term for term. Without a mask, or with per-head masks, it defers to transformers'
`sdpa`. `packed_gqa(model)` switches a model to it for the duration of a block.

Inside `decode_kernel()` (rollouts and compiled evaluation, with `train.rollout.kernels`), a token step (one query
token) with a boolean mask runs `vlmrl.engine.rollout.decode_attention` instead of SDPA: a Triton kernel that reads
only the cache blocks holding an attended position, with the static cache's shapes unchanged. What the pieces are
worth: benchmarks/NOTES.md.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

log = logging.getLogger(__name__)

NAME = "vlmrl_sdpa"
_registered = False
_decode_kernel = False  # read while dynamo traces: a compiled step is guarded on these two
_decode_kernel_on_cpu = False  # tests: the CPU, through the Triton interpreter


def packed_gqa_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    foldable = (
        groups > 1
        and attention_mask is not None
        and attention_mask.dim() == 4
        and attention_mask.shape[1] == 1
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and query.shape[1] == key.shape[1] * groups
    )
    if not foldable:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    # Head h = k * groups + g (repeat_kv's order); row g * q_len + t of group k is query token t of head h.
    folded = query.reshape(batch, kv_heads, groups * q_len, dim)
    mask = attention_mask if q_len == 1 else attention_mask.repeat(1, 1, groups, 1)
    if q_len == 1 and _decode_kernel and _decode_kernel_usable(folded, key, value, mask, dropout):
        from vlmrl.engine.rollout.decode_attention import decode_attention

        out = decode_attention(folded, key, value, mask, scaling)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            folded, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=False
        )
    out = out.reshape(out.shape[0], heads, q_len, value.shape[-1])
    return out.transpose(1, 2).contiguous(), None


def _decode_kernel_usable(*args: Any) -> bool:
    from vlmrl.engine.rollout.decode_attention import usable

    return usable(*args, on_cpu=_decode_kernel_on_cpu)


@contextlib.contextmanager
def decode_kernel(enabled: bool = True, *, on_cpu: bool = False) -> Iterator[None]:
    """Inside the block, `vlmrl_sdpa` runs token steps through `vlmrl.engine.rollout.decode_attention` where it can: on
    CUDA with Triton, and with `on_cpu` (tests) on the CPU when Triton runs its interpreter (`TRITON_INTERPRET=1`)."""
    global _decode_kernel, _decode_kernel_on_cpu
    from vlmrl.engine.rollout.decode_attention import HAS_TRITON, interpreted

    previous = _decode_kernel, _decode_kernel_on_cpu
    _decode_kernel, _decode_kernel_on_cpu = enabled and HAS_TRITON, on_cpu and interpreted()
    try:
        yield
    finally:
        _decode_kernel, _decode_kernel_on_cpu = previous


def register() -> None:
    """Make `vlmrl_sdpa` a known attention implementation (with SDPA's own mask builder)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, packed_gqa_sdpa)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    _registered = True


def base_model(model: Any) -> Any:
    """The transformers model under DDP and PEFT wrappers."""
    base = getattr(model, "module", model)  # DDP
    while hasattr(base, "get_base_model") and base is not base.get_base_model():
        base = base.get_base_model()
    return base


def _text_config(model: Any) -> Any:
    config = getattr(base_model(model), "config", None)
    if config is None:
        return None
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def packed_gqa_applies(model: Any) -> bool:
    """True when the language model of `model` runs `sdpa` (or already `vlmrl_sdpa`). Models on eager or flash
    attention are left alone (eager has no KV copies to save; flash handles grouped heads itself)."""
    text = _text_config(model)
    return getattr(text, "_attn_implementation", None) in ("sdpa", NAME)


def use_packed_gqa(model: Any) -> bool:
    """Switch the language model of `model` from `sdpa` to `vlmrl_sdpa` for good; True when switched (or already
    on). Only the text config changes: the vision tower keeps its own implementation."""
    if not packed_gqa_applies(model):
        log.info("attention stays %s (vlmrl_sdpa replaces sdpa only)",
                 getattr(_text_config(model), "_attn_implementation", None))
        return False
    register()
    _text_config(model)._attn_implementation = NAME
    return True


@contextlib.contextmanager
def packed_gqa(model: Any) -> Iterator[None]:
    """`vlmrl_sdpa` for the body only (rollouts); the model's own implementation before and after."""
    text = _text_config(model)
    previous = getattr(text, "_attn_implementation", None)
    switched = use_packed_gqa(model)
    try:
        yield
    finally:
        if switched:
            text._attn_implementation = previous
