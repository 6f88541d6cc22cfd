"""`vlmrl.engine.experimental.rollout.guards_once` (an experiment: the bench path `vlmrl-guards-once`): each
`generate` call's compiled token steps check dynamo's guards until one compiles nothing, skip them after, still give the eager path's tokens across
cache lengths, and run a skipped step again checked when it needs a new graph."""

from __future__ import annotations

import torch

from tests.conftest import load_sdpa
from vlmrl.data.synthetic import generate_items
from vlmrl.engine.experimental.rollout import guards_once
from vlmrl.engine.rollout.fast import bucket_static_cache, compile_settings, prefill_into_dynamic_cache
from vlmrl.engine.rollout.generation import encode_batch

SETTINGS = {"do_sample": False, "cache_implementation": "static", "return_dict_in_generate": True}


def test_steady_token_steps_skip_the_guards_across_cache_lengths(tiny_qwen3_vl, monkeypatch):
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
    # the token steps after the prompt pass: n - 1 per call. The first call's first step compiles, so its second is
    # checked too (and compiles nothing); the second call's first step compiles nothing: its second already skips
    assert counters["frames"]["total"] == 1
    assert stances == [{"skip_guard_eval_unsafe": True}] * ((lengths[0] - 3) + (lengths[1] - 2))


def test_the_experiment_wraps_each_rollout_and_is_recorded(tiny_qwen3_vl):
    from tests.test_fastgen import fake_trainer
    from vlmrl.engine.experimental.rollout import apply
    from vlmrl.engine.rollout.attention import base_model
    from vlmrl.engine.rollout.fast import enable_fast_generation

    model, _ = load_sdpa(tiny_qwen3_vl)
    seen = []
    trainer = fake_trainer(model, lambda: seen.append("get_compiled_call" in vars(base_model(model))))
    fast = apply(trainer, enable_fast_generation(trainer), guards_once=True)
    assert fast.as_dict()["guards"] == "first step"
    assert [name for name, _ in trainer.vlmrl_rollout_contexts][-2:] == ["guards_once", "compile_over_4bit"]
    trainer._generate_single_turn()
    assert seen == [True] and "get_compiled_call" not in vars(base_model(model))  # only inside the rollout
    plain = fake_trainer(model, lambda: seen.append("get_compiled_call" in vars(base_model(model))))
    assert enable_fast_generation(plain).guards is None  # the product checks them at every step
    plain._generate_single_turn()
    assert seen == [True, False]


class Phased(torch.nn.Module):
    """The final norm, with a Python int its forward reads: dynamo guards on its value (one graph per value)."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.phase = inner, 0

    def forward(self, x):
        return self.inner(x) * (1.0 + 0.0 * self.phase)


def test_a_skipped_step_that_needs_a_new_graph_runs_again_checked(tiny_qwen3_vl, caplog):
    from transformers import LogitsProcessor, LogitsProcessorList

    model, processor = load_sdpa(tiny_qwen3_vl)
    language = model.model.language_model
    language.norm = Phased(language.norm)
    items = list(generate_items(2, seed=6, size=128))
    batch = encode_batch(processor, [i.question for i in items], [i.image for i in items], torch.device("cpu"))
    bucket_static_cache(model, 64)
    prefill_into_dynamic_cache(model)
    eager = model.generate(**batch, max_new_tokens=8, min_new_tokens=8, **SETTINGS).sequences

    class SetPhase(LogitsProcessor):  # after the 3rd token, the phase changes: the later steps need a new graph
        def __init__(self):
            self.calls = 0

        def __call__(self, input_ids, scores):
            self.calls += 1
            language.norm.phase = 2 if self.calls >= 3 else 0
            return scores

    settings = compile_settings(all_devices=True)
    settings["compile_config"].backend, settings["compile_config"].mode = (lambda gm, _: gm.forward), None
    torch._dynamo.reset()
    with guards_once(model):
        for phase in (0, 1):  # two compiled graphs, told apart by the phase: a guard torch still checks when skipping
            language.norm.phase = phase
            model.generate(**batch, max_new_tokens=4, min_new_tokens=4, **{**SETTINGS, **settings})
        language.norm.phase = 0
        with caplog.at_level("INFO", logger="vlmrl.engine.experimental.rollout"):
            got = model.generate(**batch, max_new_tokens=8, min_new_tokens=8, logits_processor=LogitsProcessorList(
                [SetPhase()]), **{**SETTINGS, **settings}).sequences
    assert torch.equal(got, eager)
    assert "needed a graph not compiled yet" in caplog.text
