"""fp16 mixed precision meets TRL's bf16 QLoRA adapters: vlmrl puts them back in float32 (vlmrl.engine.precision)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vlmrl.engine.precision import float32_adapters_for_fp16


def _trainer(fp16: bool) -> SimpleNamespace:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)
    model[0].to(torch.float16)  # the frozen base stays as loaded
    model[1].to(torch.bfloat16)  # what TRL 1.16 makes of a quantized model's adapters
    return SimpleNamespace(model=model, args=SimpleNamespace(fp16=fp16))


def test_fp16_gets_float32_adapters_and_leaves_the_base() -> None:
    trainer = _trainer(fp16=True)
    assert float32_adapters_for_fp16(trainer) == 2  # the adapter's weight and bias
    assert {p.dtype for p in trainer.model[1].parameters()} == {torch.float32}
    assert {p.dtype for p in trainer.model[0].parameters()} == {torch.float16}
    scaler_grads = [torch.ones_like(p) for p in trainer.model[1].parameters()]  # what the scaler unscales
    assert all(g.dtype == torch.float32 for g in scaler_grads)


def test_bf16_keeps_trl_choice() -> None:
    trainer = _trainer(fp16=False)
    assert float32_adapters_for_fp16(trainer) == 0
    assert {p.dtype for p in trainer.model[1].parameters()} == {torch.bfloat16}
