"""Rollouts on merged LoRA weights (`vlmrl.engine.experimental.merge`, an experiment): the merged model computes what
the adapter computes, and the bf16 base weights come back bit for bit, where peft's merge/unmerge round trip drifts."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from vlmrl.engine.experimental.merge import RolloutMerge, host_bytes, rollout_merge, unsupported_reason
from vlmrl.engine.lora_layers import lora_layers


class _Net(torch.nn.Module):
    def __init__(self, width: int = 64):
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _lora(dtype: torch.dtype, **lora_kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    model = get_peft_model(_Net().to(dtype), LoraConfig(r=8, lora_alpha=16, target_modules=["up", "down"],
                                                        **lora_kwargs))
    for layer in lora_layers(model):  # a trained adapter: B is zero at initialisation
        for b in layer.lora_B.values():
            torch.nn.init.normal_(b.weight, std=0.05)
    return model


def _base_weights(model) -> list[torch.Tensor]:
    return [layer.get_base_layer().weight.detach().clone() for layer in lora_layers(model)]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 0.05)])
def test_merged_weights_compute_the_adapters_output(dtype, tolerance):
    model = _lora(dtype)
    x = torch.randn(5, 64, dtype=dtype)
    with torch.no_grad():
        expected = model(x)
        merge = RolloutMerge(model)
        with merge.merged():
            assert all(layer.merged for layer in lora_layers(model))  # peft's forward skips the LoRA branch
            got = model(x)
        assert not any(layer.merged for layer in lora_layers(model))
        again = model(x)
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(again, expected, rtol=0, atol=0)


def test_bf16_base_weights_come_back_exactly_where_peft_unmerge_drifts():
    model = _lora(torch.bfloat16)
    before = _base_weights(model)
    merge = RolloutMerge(model)
    for _ in range(3):
        with merge.merged():
            assert not all(torch.equal(w, b) for w, b in zip(merge.weights, before))  # really merged
    assert all(torch.equal(w, b) for w, b in zip(merge.weights, before))
    # control: what a merge/unmerge round trip (peft, TRL's vLLM sync) does to the same bf16 weights
    for _ in range(3):
        model.merge_adapter()
        model.unmerge_adapter()
    assert not all(torch.equal(w, b) for w, b in zip(merge.weights, before))


def test_an_error_inside_the_rollout_still_restores_the_weights():
    model = _lora(torch.bfloat16)
    before = _base_weights(model)
    merge = RolloutMerge(model)
    with pytest.raises(RuntimeError, match="boom"), merge.merged():
        raise RuntimeError("boom")
    assert all(torch.equal(w, b) for w, b in zip(merge.weights, before))
    assert not any(layer.merged for layer in lora_layers(model))


def test_a_peft_unmerge_inside_the_rollout_does_not_break_the_restore():
    model = _lora(torch.bfloat16)
    before = _base_weights(model)
    merge = RolloutMerge(model)
    with merge.merged():
        model.unmerge_adapter()  # e.g. peft's disable_adapter path: subtracts the delta, clears merged_adapters
    assert all(torch.equal(w, b) for w, b in zip(merge.weights, before))
    assert not any(layer.merged for layer in lora_layers(model))


def test_merged_bf16_weights_keep_large_deltas_and_lose_small_ones():
    """Why merging is opt-in: bf16 rounding of W + D drops the elements of D below half a bf16 step of W."""
    torch.manual_seed(0)
    weight = (torch.randn(256, 256) * 0.02).to(torch.bfloat16)
    x = torch.randn(64, 256)

    def lost_share(scale: float) -> float:
        delta = torch.randn(256, 256) * scale
        merged = (weight.float() + delta).to(torch.bfloat16).float() - weight.float()
        return float((x @ (merged - delta).T).norm() / (x @ delta.T).norm())

    assert lost_share(1e-5) > 0.5  # most of an early-training adapter's effect is gone from the rollout policy
    assert lost_share(1e-2) < 0.05  # a large delta survives the rounding


def test_host_copy_size_and_what_is_not_merged():
    model = _lora(torch.bfloat16)
    assert host_bytes(model) == 2 * (64 * 256 + 256 * 64)
    assert unsupported_reason(model) is None
    assert unsupported_reason(_Net()) == "no LoRA layers"
    assert "DoRA" in unsupported_reason(_lora(torch.float32, use_dora=True))
    assert "lora_bias" in unsupported_reason(_lora(torch.float32, lora_bias=True))
    trainable = _lora(torch.float32)
    lora_layers(trainable)[0].get_base_layer().weight.requires_grad_(True)
    assert unsupported_reason(trainable) == "a LoRA base weight is trainable"
    with pytest.raises(ValueError, match="cannot merge the adapter for rollouts: no LoRA layers"):
        RolloutMerge(_Net())


def test_the_experiment_says_why_it_does_not_merge(monkeypatch):
    from types import SimpleNamespace

    from vlmrl.engine.experimental import merge

    model = _lora(torch.bfloat16)
    need = host_bytes(model)
    merger, note = rollout_merge(SimpleNamespace(model=model))
    assert isinstance(merger, RolloutMerge) and note.startswith("merged for rollouts")
    assert merger._originals is not None  # the host copy is made up front, before any rollout
    _, note = rollout_merge(SimpleNamespace(model=model, is_fsdp_enabled=True))
    assert note == "not merged: parameters are sharded (FSDP / DeepSpeed)"
    _, note = rollout_merge(SimpleNamespace(model=_Net()))
    assert note == "not merged: no LoRA layers"
    monkeypatch.setattr(merge, "available_host_bytes", lambda: 4 * need)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # four processes on this host, each pinning a copy
    merger, note = rollout_merge(SimpleNamespace(model=model))
    assert merger is None and note.startswith("not merged: 4 pinned copies of")
