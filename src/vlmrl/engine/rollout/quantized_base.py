"""A bitsandbytes 4-bit base in rollouts: compiled decoding over it, and its token steps on vlmrl's nf4 kernel.

- `compile_over_4bit(model)`: within the block, transformers compiles `generate` over the 4-bit base, which it
  refuses by itself, where bitsandbytes' inference matmul is a traceable torch op (`bnb_ops_traceable`).
- `nf4_token_steps(trainer)`: the base's token steps through `vlmrl.engine.rollout.nf4` for the trainer's life,
  where that applies; returns what the record says (`BITSANDBYTES` names bitsandbytes' own layer there).
`vlmrl.engine.rollout.fast` calls both; compiled evaluation (`vlmrl.engine.rollout.generation`) the first.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def compile_over_4bit(model: Any) -> Iterator[None]:
    """Let transformers compile decoding over a bitsandbytes 4-bit base, for the duration of the block.

    transformers refuses to compile `generate` for any quantizer whose `is_compileable` is False, which the
    bitsandbytes 4-bit quantizer inherits; it then decodes eagerly over the static cache, one kernel launch per
    projection and the host waiting on each (several times slower: benchmarks/NOTES.md). bitsandbytes >= 0.50
    runs inference matmuls through registered torch ops (`bitsandbytes::gemm_4bit`, with fake implementations),
    which dynamo traces, so the refusal is lifted when that op exists. Without gradients bitsandbytes takes the same
    op eagerly, so the rollout's numerics are those of bitsandbytes' own inference path either way
    (benchmarks/decode_4bit.py compares the rollout's log-probs with the loss pass's).
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None or quantizer.is_compileable or not bnb_ops_traceable():
        yield
        return
    original = type(quantizer)
    quantizer.__class__ = _compileable(original)
    try:
        yield
    finally:
        quantizer.__class__ = original


@functools.cache
def _compileable(quantizer_class: type) -> type:
    """The quantizer's class with `is_compileable` True: made once, not at every rollout."""
    return type(f"Compileable{quantizer_class.__name__}", (quantizer_class,), {"is_compileable": True})


@functools.cache
def bnb_ops_traceable() -> bool:
    """Whether bitsandbytes registers its 4-bit inference matmul as a torch op (0.50 and later)."""
    try:
        import bitsandbytes  # noqa: F401  registers torch.ops.bitsandbytes
    except Exception:  # noqa: BLE001  missing or broken install: nothing to lift
        return False
    return hasattr(torch.ops.bitsandbytes, "gemm_4bit")


BITSANDBYTES = "bitsandbytes Linear4bit"


def nf4_token_steps(trainer: Any, *, wanted: bool = True) -> str | None:
    """Route a 4-bit base's token steps through vlmrl's nf4 kernel (`vlmrl.engine.rollout.nf4`) for the trainer's
    life, where it applies: vlmrl's kernels `wanted`, a GPU where the kernel was measured faster than bitsandbytes,
    and a launch that works there. For the trainer's life, so that a compiled token step sees the same forwards at
    every rollout; the loss pass and prompt passes stay on bitsandbytes. Returns what the record says: None
    without a bitsandbytes 4-bit layer, else which kernel reads the weights and why."""
    model = trainer.model
    weight = next((m.weight for m in model.modules() if type(m).__name__ == "Linear4bit"), None)
    if weight is None:
        return None
    if not wanted:
        return f"{BITSANDBYTES} (vlmrl's kernels are off: train.rollout.kernels=false)"
    from vlmrl.engine.rollout import nf4

    reason = nf4.unsupported_reason(model) or nf4.gpu_reason(weight.device) or nf4.probe(model)
    if reason is not None:
        return f"{BITSANDBYTES} (vlmrl's nf4 kernel not used: {reason})"
    stack = contextlib.ExitStack()
    stack.enter_context(nf4.nf4_decode(model))
    trainer.vlmrl_nf4_decode = stack  # held (and closed) with the trainer
    return (f"vlmrl nf4 kernel (vlmrl.engine.rollout.nf4) for token steps of {nf4.MIN_ROWS}-{nf4.MAX_ROWS} rows "
            f"({nf4.measured_settings(model)}; {nf4.lookups()}), {BITSANDBYTES} otherwise")
