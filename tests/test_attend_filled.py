"""Decode attention over the filled static-cache positions only (an experiment: the bench path `vlmrl-filled`,
`vlmrl.engine.experimental.rollout.attend_filled` + `vlmrl.engine.rollout.attention.attend_filled_only`): the same
attention, the same tokens, fewer positions read, and one compiled graph for all windows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText

from tests.conftest import load_sdpa
from tests.test_fastgen import _Module
from vlmrl.data.synthetic import generate_items
from vlmrl.engine.experimental.rollout import attend_filled
from vlmrl.engine.rollout import attention
from vlmrl.engine.rollout.fast import bucket_static_cache, compile_settings, prefill_into_dynamic_cache
from vlmrl.engine.rollout.generation import encode_batch


def test_reading_the_filled_positions_only_is_the_same_attention():
    torch.manual_seed(0)
    batch, kv_heads, cache, filled, dim = 3, 2, 24, 13, 8
    query = torch.randn(batch, kv_heads * 4, 1, dim, dtype=torch.float64)
    key = torch.randn(batch, kv_heads, cache, dim, dtype=torch.float64)
    value = torch.randn(batch, kv_heads, cache, dim, dtype=torch.float64)
    mask = torch.zeros(batch, 1, 1, cache, dtype=torch.bool)
    mask[:, :, :, :filled] = True
    mask[1, :, :, :2] = False  # left padding
    full, _ = attention.packed_gqa_sdpa(_Module(4), query, key, value, mask)
    for window in (filled, 16, cache):
        part, _ = attention.packed_gqa_sdpa(_Module(4), query, key, value, mask,
                                            **{attention.FILLED: torch.empty(window, dtype=torch.uint8)})
        torch.testing.assert_close(part, full)
    # what the positions past the window hold does not matter: they are not read
    key[:, :, 16:] = value[:, :, 16:] = float("nan")
    part, _ = attention.packed_gqa_sdpa(_Module(4), query, key, value, mask,
                                        **{attention.FILLED: torch.empty(16, dtype=torch.uint8)})
    torch.testing.assert_close(part, full)


def test_without_a_whole_cache_mask_nothing_is_dropped():
    key = value = torch.randn(1, 2, 10, 4)
    filled = torch.empty(4, dtype=torch.uint8)
    assert attention.attend_filled_only(key, value, None, filled)[0].shape[2] == 10  # nothing hides the rest
    short_mask = torch.ones(1, 1, 1, 6, dtype=torch.bool)
    assert attention.attend_filled_only(key, value, short_mask, filled)[0].shape[2] == 10
    k, v, m = attention.attend_filled_only(key, value, torch.ones(1, 1, 1, 10, dtype=torch.bool), filled)
    assert k.shape[2] == v.shape[2] == m.shape[-1] == 4


@pytest.fixture
def tiny(tiny_qwen3_vl) -> Path:
    return tiny_qwen3_vl


def _setup(path: Path):
    model, processor = load_sdpa(path)
    items = list(generate_items(3, seed=3, size=128))
    batch = encode_batch(processor, [i.question for i in items], [i.image for i in items], torch.device("cpu"))
    assert bucket_static_cache(model, 64)  # a cache longer than the tokens: positions to skip
    prefill_into_dynamic_cache(model)
    return model, batch


SETTINGS = {"max_new_tokens": 20, "min_new_tokens": 20, "do_sample": False, "cache_implementation": "static",
            "return_dict_in_generate": True, "output_logits": True}


def test_greedy_decoding_reads_fewer_positions_and_gives_the_same_tokens(tiny, monkeypatch):
    model, batch = _setup(tiny)
    width = batch["input_ids"].shape[1]
    with attention.packed_gqa(model):
        whole = model.generate(**batch, **SETTINGS)
        read = []
        real = attention.attend_filled_only
        monkeypatch.setattr(attention, "attend_filled_only",
                            lambda k, v, m, f: read.append((k.shape[2], None if f is None else f.shape[0]))
                            or real(k, v, m, f))
        with attend_filled(model, 8):
            windowed = model.generate(**batch, **SETTINGS)
    assert not hasattr(attention.base_model(model), "prepare_inputs_for_generation") or \
        "prepare_inputs_for_generation" not in vars(attention.base_model(model))  # the wrapper is gone after
    assert torch.equal(windowed.sequences, whole.sequences)
    for a, b in zip(windowed.logits, whole.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    cache = -(-(width + 19) // 64) * 64
    decode = [f for k, f in read if k == cache and f is not None]
    layers = model.config.text_config.num_hidden_layers
    assert len(decode) == 19 * layers  # every token step after the prompt pass, in every layer
    steps = decode[::layers]
    assert steps == sorted(steps) and all(f % 8 == 0 or f == cache for f in steps)
    assert steps[0] == -(-(width + 1) // 8) * 8 and steps[-1] == min(-(-(width + 19) // 8) * 8, cache)
    assert steps[-1] < cache  # the unwritten tail of the cache was never read
    assert [f for k, f in read if k != cache] == [None] * layers  # the prompt pass: its own cache, no window


def test_compiled_decoding_compiles_once_for_every_window(tiny):
    from torch._dynamo.utils import counters

    model, batch = _setup(tiny)
    settings = {**SETTINGS, **compile_settings(all_devices=True)}
    with attention.packed_gqa(model):
        whole = model.generate(**batch, **SETTINGS)  # eager: compiled greedy decoding gives its tokens (test_fastgen)
        torch._dynamo.reset()
        counters.clear()
        with attend_filled(model, 8):
            windowed = model.generate(**batch, **settings)
            graphs = counters["stats"]["unique_graphs"]
            again = model.generate(**batch, **settings)
    width = batch["input_ids"].shape[1]
    windows = len(range(-(-(width + 1) // 8), -(-(width + 19) // 8) + 1))
    assert windows >= 3
    assert torch.equal(windowed.sequences, whole.sequences) and torch.equal(again.sequences, whole.sequences)
    assert graphs <= 2, f"{graphs} graphs for {windows} windows: the window length must stay dynamic"
    assert counters["stats"]["unique_graphs"] == graphs  # a second rollout reuses them


def test_the_experiment_wraps_each_rollout_and_is_recorded(tiny):
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from vlmrl.engine.experimental.rollout import apply
    from vlmrl.engine.rollout.fast import enable_fast_generation

    model, _ = _setup(tiny)
    base = attention.base_model(model)
    seen = []

    def rollout():
        seen.append("prepare_inputs_for_generation" in vars(base))

    def trainer(model):
        return SimpleNamespace(generation_config=GenerationConfig(), generation_kwargs={}, model=model,
                               args=SimpleNamespace(bf16=False, fp16=False), _generate_single_turn=rollout)

    on = trainer(model)
    fast = apply(on, enable_fast_generation(on, kernels=False), filled_window=128)
    assert fast.cache_read == "filled positions, rounded up to 128" and fast.as_dict()["cache_read"] == fast.cache_read
    assert [name for name, _ in on.vlmrl_rollout_contexts][:2] == ["attention", "filled_window"]
    on._generate_single_turn()
    assert seen == [True] and "prepare_inputs_for_generation" not in vars(base)  # only inside the rollout
    plain = enable_fast_generation(trainer(model), kernels=False)
    assert plain.cache_read == "the whole static cache"  # the product never asks for it
    eager = AutoModelForImageTextToText.from_pretrained(str(tiny), attn_implementation="eager")
    refused = apply(eager_trainer := trainer(eager), enable_fast_generation(eager_trainer), filled_window=128)
    assert refused.cache_read == ("the whole static cache (the decode kernel needs vlmrl_sdpa) "
                                  "(the filled window needs vlmrl_sdpa)")


def test_the_bench_path_is_reported_beside_the_others():
    """A variant path (registered by benchmarks/engine_variants.py, not one of `PATHS`) gets its ratios too."""
    from vlmrl.bench import PATHS, BenchSettings, load_shapes, markdown_table, summarize

    assert "vlmrl-filled" not in PATHS

    def raw(path, seconds, fast=None):
        return {"path": path, "error": None, "fast_generation": fast, "peak_memory_gib": 20.0,
                "peak_reserved_gib": 21.0, "steps": [{"seconds": s, "generate_seconds": s - 5} for s in seconds]}

    results = [raw("plain", [100, 100]), raw("vlmrl", [60, 20], {"enabled": True, "cache_read": "the whole static cache"}),
               raw("vlmrl-filled", [60, 18], {"enabled": True, "cache_read": "filled positions, rounded up to 128"})]
    summary = summarize(BenchSettings(paths=["plain", "vlmrl", "vlmrl-filled"]), load_shapes("qwen3_vl_8b"),
                        {"matmul_tflops": 800, "copy_bandwidth_tbs": 4.0}, results, prompt_tokens=310)
    assert summary["ratios"]["filled_step_speedup"] == pytest.approx(100 / 18)
    table = markdown_table(summary)
    assert "vlmrl-filled: attention reads filled positions, rounded up to 128." in table
    assert "vlmrl: attention reads the whole static cache." in table


def test_the_window_reaches_the_attention_under_a_peft_adapter(tiny, monkeypatch):
    from peft import LoraConfig, get_peft_model

    model, batch = _setup(tiny)
    policy = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))  # as TRL wraps it
    windows = []
    real = attention.attend_filled_only
    monkeypatch.setattr(attention, "attend_filled_only",
                        lambda k, v, m, f: windows.append(None if f is None else f.shape[0]) or real(k, v, m, f))
    with attention.packed_gqa(policy), attend_filled(policy, 8):
        policy.generate(**batch, **SETTINGS)
    layers = model.config.text_config.num_hidden_layers
    assert windows[:layers] == [None] * layers  # the prompt pass
    width = batch["input_ids"].shape[1]  # the prompt, then 19 token steps of the 20 new tokens
    assert set(windows[layers:]) == {-(-(width + n) // 8) * 8 for n in range(1, 20)}
