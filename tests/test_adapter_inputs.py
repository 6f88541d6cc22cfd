"""LoRA layers skip PEFT's float32 input cast under autocast (`vlmrl.engine.loss.adapter_inputs`): the same outputs and the same
gradients as PEFT's cast, with gradient checkpointing too; outside autocast PEFT still casts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils.checkpoint import checkpoint

from tests.helpers import Net, adapted
from vlmrl.engine.loss.adapter_inputs import CastOutsideAutocast, enable, keep_inputs_under_autocast


def _casts(model, x, *, checkpointed: bool):
    """Output, gradients of the adapter weights and of the input, and how many float32 copies of activations
    (tensors of the input's row count) were made in the forward and the backward."""
    made = []
    x = x.detach().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16), _CountCasts(made, x.shape[0]):
        out = checkpoint(model, x, use_reentrant=False) if checkpointed else model(x)
        out.float().square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.detach(), grads, x.grad.clone(), len(made)


class _CountCasts(torch.overrides.TorchFunctionMode):
    """Counts `Tensor.to(torch.float32)` calls on activations (rows = the batch), the casts PEFT makes."""

    def __init__(self, made: list, rows: int):
        super().__init__()
        self.made, self.rows = made, rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and args and isinstance(args[0], torch.Tensor) and args[0].shape[:1] == (self.rows,) \
                and torch.float32 in (*args[1:], kwargs.get("dtype")):
            self.made.append(1)
        return func(*args, **kwargs)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_same_outputs_and_gradients_without_the_casts(checkpointed):
    x = torch.randn(6, 32, dtype=torch.bfloat16)
    out, grads, x_grad, casts = _casts(adapted(), x, checkpointed=checkpointed)
    model = adapted()
    assert keep_inputs_under_autocast(model, "cpu") == 2
    out2, grads2, x_grad2, casts2 = _casts(model, x, checkpointed=checkpointed)
    assert casts >= 2 and casts2 == 0, (casts, casts2)
    assert torch.equal(out, out2) and torch.equal(x_grad, x_grad2)
    assert grads.keys() == grads2.keys() and len(grads) == 4
    assert all(torch.equal(grads[n], grads2[n]) for n in grads)


def test_outside_autocast_peft_still_casts():
    model = adapted()
    keep_inputs_under_autocast(model, "cpu")
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = adapted()(x)
        got = model(x)  # a bf16 input meets the float32 adapter: only PEFT's cast makes this run
    assert torch.equal(got, expected)
    flag = CastOutsideAutocast("cpu")
    assert bool(flag)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not bool(flag)


def test_enable_applies_only_where_the_trainer_has_an_autocast():
    bf16 = SimpleNamespace(bf16=True, fp16=False)
    model = adapted()
    assert enable(SimpleNamespace(model=model, args=bf16)).startswith("kept in the autocast dtype")
    assert all(isinstance(m.cast_input_dtype_enabled, CastOutsideAutocast) for m in model.modules()
               if hasattr(m, "lora_A"))
    untouched = adapted()
    assert enable(SimpleNamespace(model=untouched, args=SimpleNamespace(bf16=False, fp16=False))).startswith("as PEFT")
    assert all(getattr(m, "cast_input_dtype_enabled", True) is True for m in untouched.modules())


@pytest.mark.parametrize("kwargs", [{"lora_dropout": 0.1}, {"use_dora": True}])
def test_layers_with_dropout_or_dora_keep_peft_cast(kwargs):
    torch.manual_seed(0)
    model = get_peft_model(Net(32).to(torch.bfloat16), LoraConfig(r=4, target_modules=["up", "down"], **kwargs))
    assert keep_inputs_under_autocast(model, "cpu") == 0
    assert all(getattr(m, "cast_input_dtype_enabled", True) is True for m in model.modules())
