"""`vlmrl.rollout.fast.guards_once` (`train.rollout_guards_once`): each `generate` call's compiled token steps check
dynamo's guards at the first step only, and still give the tokens the eager path gives, across cache lengths."""

from __future__ import annotations

import torch

from tests.conftest import load_sdpa
from vlmrl.data.synthetic import generate_items
from vlmrl.rollout.fast import bucket_static_cache, compile_settings, guards_once, prefill_into_dynamic_cache
from vlmrl.rollout.generation import encode_batch

SETTINGS = {"do_sample": False, "cache_implementation": "static", "return_dict_in_generate": True}


def test_later_token_steps_skip_the_guards_and_a_new_cache_length_still_compiles(tiny_qwen3_vl, monkeypatch):
    from torch._dynamo.utils import counters

    model, processor = load_sdpa(tiny_qwen3_vl)
    items = list(generate_items(2, seed=5, size=128))
    batch = encode_batch(processor, [i.question for i in items], [i.image for i in items], torch.device("cpu"))
    bucket_static_cache(model, 64)
    prefill_into_dynamic_cache(model)
    lengths = (8, 80)  # 80 new tokens cross into the next 64-position bucket: a new cache length
    eager = [model.generate(**batch, max_new_tokens=n, min_new_tokens=n, **SETTINGS).sequences for n in lengths]

    stances = []
    real = torch.compiler.set_stance
    monkeypatch.setattr(torch.compiler, "set_stance", lambda *a, **k: stances.append(k) or real(*a, **k))

    def backend(gm, example_inputs):
        return gm.forward

    settings = compile_settings(all_devices=True)
    settings["compile_config"].backend, settings["compile_config"].mode = backend, None
    torch._dynamo.reset()
    counters.clear()
    with guards_once(model):
        got = [model.generate(**batch, max_new_tokens=n, min_new_tokens=n, **{**SETTINGS, **settings}).sequences
               for n in lengths]
    assert "get_compiled_call" not in vars(model)  # the model's own method again after the block
    for a, b in zip(got, eager, strict=True):
        assert torch.equal(a, b)
    assert counters["stats"]["calls_captured"] > 0  # the token steps did run compiled
    # the token steps after the prompt pass: n - 1 per call, all but the first of each under the unsafe stance
    assert stances == [{"skip_guard_eval_unsafe": True}] * sum(n - 2 for n in lengths)


def test_the_setting_wraps_each_rollout_and_is_recorded(tiny_qwen3_vl):
    from tests.test_fastgen import fake_trainer
    from vlmrl.rollout.attention import base_model
    from vlmrl.rollout.fast import enable_fast_generation

    model, _ = load_sdpa(tiny_qwen3_vl)
    seen = []
    trainer = fake_trainer(model, lambda: seen.append("get_compiled_call" in vars(base_model(model))))
    assert enable_fast_generation(trainer, guards="first step").as_dict()["guards"] == "first step"
    trainer._generate_single_turn()
    assert seen == [True] and "get_compiled_call" not in vars(base_model(model))  # only inside the rollout
    plain = fake_trainer(model, lambda: seen.append("get_compiled_call" in vars(base_model(model))))
    assert enable_fast_generation(plain).guards == "every step"
    plain._generate_single_turn()
    assert seen == [True, False]
