"""Rollout-time bf16 copies of the float32 LoRA weights (`vlmrl.engine.rollout.adapter_cast`) and the one-step-late stop check
(`vlmrl.engine.rollout.fast.deferred_stop_check`): each computes exactly what the path it replaces computes."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import adapted, fake_trainer
from vlmrl.engine.rollout.adapter_cast import LowPrecisionAdapters


def test_the_copies_compute_what_the_autocast_path_computes():
    model = adapted()
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    copies = LowPrecisionAdapters(model, torch.bfloat16)
    assert len(copies) == 4 and copies.nbytes == sum(p.numel() * 2 for n, p in model.named_parameters() if "lora_" in n)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    with torch.no_grad(), copies.active():
        assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.bfloat16}
        got = model(x)
    assert torch.equal(got, expected)
    with torch.no_grad():
        fp32_adapters = model(x)  # without autocast the adapter runs in float32: a different (valid) result
    assert not torch.equal(fp32_adapters, expected)


def test_the_trained_float32_weights_are_back_after_the_block_and_refreshed_at_the_next():
    model = adapted()
    before = {n: p for n, p in model.named_parameters()}
    copies = LowPrecisionAdapters(model, torch.bfloat16)
    with copies.active():
        held = [module.weight for module, _ in copies.entries]
    assert all(module.weight is weight for module, weight in copies.entries)
    after = {n: p for n, p in model.named_parameters()}
    assert all(after[n] is before[n] for n in before), "the optimizer's parameters must be the ones in the model"
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model(torch.randn(3, 32, dtype=torch.bfloat16)).float().square().sum().backward()
    optimizer.step()
    with copies.active():
        for (module, weight), earlier in zip(copies.entries, held, strict=True):
            assert module.weight is not earlier, "each rollout makes its copies afresh"
            assert not module.weight.requires_grad
            assert torch.equal(module.weight, weight.detach().to(torch.bfloat16))  # the updated weights, cast
    del held
    assert copies.nbytes == sum(w.numel() * 2 for _, w in copies.entries)
    with pytest.raises(RuntimeError, match="inside"), copies.active():
        raise RuntimeError("inside a rollout")
    assert all(dict(model.named_parameters())[n] is before[n] for n in before)


def test_adapters_already_in_low_precision_get_no_copies():
    model = adapted().to(torch.bfloat16)  # e.g. QLoRA, where TRL casts the adapters
    assert len(LowPrecisionAdapters(model, torch.bfloat16)) == 0


class _HostEvent:  # CPU work is synchronous: an event that is always complete
    def __init__(self, *args, **kwargs):
        pass

    def record(self):
        pass

    def synchronize(self):
        pass


@pytest.mark.parametrize("stop", ["length", "eos"])
def test_the_deferred_stop_check_generates_the_same_tokens(stop, tmp_path, monkeypatch):
    import transformers.generation.utils as generation
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlmrl.data.synthetic import generate_items
    from vlmrl.engine.rollout.fast import deferred_stop_check
    from vlmrl.engine.rollout.generation import encode_batch
    from vlmrl.models.tiny import build_tiny_model

    path = build_tiny_model("qwen3_vl", tmp_path / "m", hidden_size=64, num_layers=2)
    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(str(path))
    processor.tokenizer.padding_side = "left"
    items = list(generate_items(3, seed=3, size=128))
    batch = encode_batch(processor, [i.question for i in items], [i.image for i in items], torch.device("cpu"))
    settings = {"max_new_tokens": 16, "do_sample": False, "cache_implementation": "static", "pad_token_id": 0}
    if stop == "eos":  # every row stops early: the deferred check runs one step more and undoes it
        probe = model.generate(**batch, **settings, eos_token_id=None)
        settings["eos_token_id"] = probe[:, batch["input_ids"].shape[1] + 4].tolist()
    expected = model.generate(**batch, **settings)

    built = []
    real = generation.DeferredStopCheck.__init__
    monkeypatch.setattr(generation.DeferredStopCheck, "__init__", lambda s, *a, **k: built.append(1) or real(s, *a, **k))
    monkeypatch.setattr(torch, "Event", _HostEvent)
    original = generation.DeferredStopCheck.__dict__["is_supported"]
    with deferred_stop_check(("cpu",)):
        got = model.generate(**batch, **settings)
    assert built == [1], "the deferred check was not used"
    assert torch.equal(got, expected)
    assert (got.shape[1] < batch["input_ids"].shape[1] + 16) == (stop == "eos")
    assert generation.DeferredStopCheck.__dict__["is_supported"] is original  # only inside the block
    model.generate(**batch, **settings)
    assert built == [1]


def test_fast_generation_swaps_the_copies_in_for_rollouts_where_they_are_the_fallback(monkeypatch):
    from types import SimpleNamespace

    import transformers.generation.utils as generation

    from vlmrl.engine.rollout import stacked
    from vlmrl.engine.rollout.fast import enable_fast_generation

    original_check = generation.DeferredStopCheck.__dict__["is_supported"]
    # stacking refused (as for a LoRA with dropout): the copies are the fallback
    monkeypatch.setattr(stacked, "StackedProjections", lambda model, dtype=None, **_: SimpleNamespace(groups=[], reason="refused"))
    model = adapted()
    seen = []

    def rollout(*args):
        seen.append(({p.dtype for n, p in model.named_parameters() if "lora_" in n},
                     generation.DeferredStopCheck.__dict__["is_supported"] is not original_check))
        return args

    trainer = fake_trainer(model, rollout)
    fast = enable_fast_generation(trainer)
    assert trainer._generate_single_turn(1) == (1,)
    assert seen == [({torch.bfloat16}, True)], "adapter dtype in the rollout; stop check deferred there"
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    assert fast.stop_check == "deferred one step on CUDA"
    assert fast.adapters.startswith("not stacked (refused); bfloat16 copies made per rollout")
    assert "optimizer state waits on the host" in fast.adapters
    assert generation.DeferredStopCheck.__dict__["is_supported"] is original_check


def test_the_deferred_check_keeps_transformers_own_conditions_and_is_undone_on_errors():
    from types import SimpleNamespace

    import transformers.generation.utils as generation

    from vlmrl.engine.rollout.fast import deferred_stop_check

    check = generation.DeferredStopCheck
    original = check.__dict__["is_supported"]
    cpu, fixed = torch.device("cpu"), SimpleNamespace(is_croppable=False)
    with deferred_stop_check(("cpu",)):
        assert check.is_supported(cpu, None, False, is_assistant=False)
        assert not check.is_supported(cpu, None, False, is_assistant=True)  # assistant models: never
        assert not check.is_supported(cpu, fixed, True, is_assistant=False)  # a returned cache it cannot roll back
        assert check.is_supported(cpu, fixed, False, is_assistant=False)  # ... unless it is dropped anyway
    assert not check.is_supported(cpu, None, False, is_assistant=False)  # transformers' own choice again
    with pytest.raises(ValueError), deferred_stop_check(("cpu",)):
        raise ValueError("a rollout failed")
    assert check.__dict__["is_supported"] is original


def test_no_copies_for_sharded_parameters_and_stale_copies_are_refused():
    from vlmrl.engine.rollout.fast import enable_fast_generation

    model = adapted()
    fast = enable_fast_generation(fake_trainer(model, lambda: None, is_fsdp_enabled=True))
    assert fast.adapters.endswith("(no copies: parameters are sharded by FSDP / DeepSpeed)")

    copies = LowPrecisionAdapters(model, torch.bfloat16)
    module, weight = copies.entries[0]
    module.weight = torch.nn.Parameter(weight.detach().clone())  # e.g. a wrapper replaced the parameters
    with pytest.raises(RuntimeError, match="replaced after their rollout copies"), copies.active():
        pass
    assert module.weight is not weight and module.weight.dtype == torch.float32
