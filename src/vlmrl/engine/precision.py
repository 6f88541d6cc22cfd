"""Adapter dtypes under fp16 mixed precision.

TRL's GRPOTrainer casts the LoRA weights of a quantized (QLoRA) model to bfloat16 when it is built, following
the QLoRA paper. Under fp16 mixed precision (a card without bfloat16, such as a T4) accelerate's loss scaler
then meets bfloat16 gradients and stops at the first step ("_amp_foreach_non_finite_check_and_unscale_cuda not
implemented for 'BFloat16'", seen on an H200 with the seed recipe in fp16). `float32_adapters_for_fp16` puts the
trainable weights back in float32, the master weights fp16 mixed precision expects, before the optimizer exists.

Public: `float32_adapters_for_fp16(trainer) -> int`. Left out: bf16 runs, which keep TRL's choice.
"""

from __future__ import annotations

from typing import Any

import torch


def float32_adapters_for_fp16(trainer: Any) -> int:
    """Under `args.fp16`, every trainable floating-point parameter in bf16/fp16 becomes float32; returns how many
    changed (0 outside fp16, or when TRL cast nothing)."""
    if not getattr(trainer.args, "fp16", False):
        return 0
    changed = 0
    for param in trainer.model.parameters():
        if param.requires_grad and param.dtype in (torch.bfloat16, torch.float16):
            param.data = param.data.float()
            changed += 1
    return changed
