"""The fast rollout path: TRL's own `generate` call, with a static KV cache and a compiled decode step.

Generation dominates an RL step (DESIGN.md: plain TRL spends most of a 24-32 s step decoding at ~85 ms per
token for an 8B VLM). Hugging Face `generate` can decode with a static KV cache and a `torch.compile`d
forward (4.6x faster per token on an H200), but TRL builds its GenerationConfig with
`disable_compile=True`, so setting `cache_implementation="static"` in GRPOConfig alone changes nothing
(measured: no gain). We switch compilation back on, on the trainer's own GenerationConfig, after the
trainer is built; TRL's loop, masks, rewards and loss are untouched.

Compiled decoding recompiles for every new cache shape, so prompts are left-padded to a multiple of
`bucket` tokens (TRL's `pad_to_multiple_of`): with image prompts of similar length that leaves one or two
shapes for a whole run, each compiled once and reused across steps. The same settings serve `vlmrl eval`.

Under compilation transformers' SDPA path copies the keys and values once per query head group
(`repeat_kv`) at every token step; `vlmrl.attention` swaps in `vlmrl_sdpa`, which folds the query heads
instead (same attention, no copies). See docs/benchmarks.md for what each piece is worth on an H200.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FastGeneration:
    enabled: bool
    reason: str
    bucket: int | None = None
    mode: str | None = None
    attention: str | None = None

    def as_dict(self) -> dict:
        return {"enabled": self.enabled, "reason": self.reason, "bucket": self.bucket, "mode": self.mode,
                "attention": self.attention}


def wanted(setting: str) -> bool:
    """`auto` means on for CUDA (compilation costs more than it saves on the CPU for small models)."""
    return setting == "always" or (setting == "auto" and torch.cuda.is_available())


def enable_fast_generation(
    trainer: Any, *, bucket: int = 64, mode: str = "reduce-overhead", all_devices: bool = False
) -> FastGeneration:
    """Turn on static-cache + compiled decoding inside a built `GRPOTrainer`."""
    config = getattr(trainer, "generation_config", None)
    if config is None or getattr(trainer, "use_vllm", False):
        return FastGeneration(False, "the trainer generates with vLLM, which has its own fast path")
    if getattr(trainer, "use_transformers_continuous_batching", False):
        return FastGeneration(False, "continuous batching is configured; it manages its own cache")
    from vlmrl.attention import NAME, use_packed_gqa

    folded = use_packed_gqa(trainer.model)
    config.disable_compile = False
    config.cache_implementation = "static"
    config.compile_config = _compile_config(mode, all_devices)
    trainer.generation_kwargs["cache_implementation"] = "static"
    trainer.pad_to_multiple_of = bucket
    log.info("fast generation: static KV cache + torch.compile(mode=%s), prompts bucketed to %d, attention %s",
             mode, bucket, NAME if folded else "unchanged")
    return FastGeneration(True, "static KV cache + torch.compile", bucket, mode, NAME if folded else None)


def compile_settings(mode: str = "reduce-overhead", all_devices: bool = False) -> dict:
    """`generate` kwargs for the same path outside the trainer (evaluation)."""
    return {"cache_implementation": "static", "compile_config": _compile_config(mode, all_devices)}


def _compile_config(mode: str, all_devices: bool) -> Any:
    from transformers import CompileConfig

    # dynamic=False: shapes are bucketed, and a static graph is what CUDA graphs (reduce-overhead) replay.
    compile_config = CompileConfig(fullgraph=False, dynamic=False, mode=mode)
    compile_config._compile_all_devices = all_devices or None  # a class-level switch; set only for CPU tests
    return compile_config
