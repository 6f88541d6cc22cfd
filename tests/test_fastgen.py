"""The fast rollout path on the CPU: grouped-query attention without KV copies (`vlmrl.engine.rollout.attention`) gives the
same attention, the same gradients and the same greedy generations, compiled or not, and under compilation it
really skips `repeat_kv` (the copy that made compiled decode slow on the GPU)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText

from tests.conftest import load_sdpa as _load
from tests.helpers import AttentionModule, fake_trainer
from vlmrl.data.synthetic import generate_items
from vlmrl.engine.rollout import attention
from vlmrl.engine.rollout.generation import generate_batch
from vlmrl.models.tiny import build_tiny_model


def _reference(query, key, value, mask, scaling):
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2)


def _padded_causal_mask(batch: int, q_len: int, kv_len: int, pad: list[int]) -> torch.Tensor:
    """Bool [B, 1, Q, L]: causal over the last q_len positions, left padding of pad[b] positions."""
    rows = torch.arange(kv_len - q_len, kv_len)[:, None]
    cols = torch.arange(kv_len)[None, :]
    mask = (cols <= rows)[None, None].repeat(batch, 1, 1, 1)
    for b, p in enumerate(pad):
        mask[b, :, :, :p] = False
    return mask


@pytest.mark.parametrize("q_len, kv_len", [(1, 9), (5, 5), (3, 11)])
def test_folded_attention_equals_repeated_kv_forward_and_backward(q_len, kv_len):
    torch.manual_seed(0)
    batch, kv_heads, groups, dim = 3, 2, 4, 8
    query = torch.randn(batch, kv_heads * groups, q_len, dim, dtype=torch.float64, requires_grad=True)
    key = torch.randn(batch, kv_heads, kv_len, dim, dtype=torch.float64, requires_grad=True)
    value = torch.randn(batch, kv_heads, kv_len, dim, dtype=torch.float64, requires_grad=True)
    mask = _padded_causal_mask(batch, q_len, kv_len, pad=[0, 1, 2])
    out, _ = attention.packed_gqa_sdpa(AttentionModule(groups), query, key, value, mask, scaling=0.3)
    ref = _reference(query, key, value, mask, 0.3)
    assert out.shape == (batch, q_len, kv_heads * groups, dim)
    torch.testing.assert_close(out, ref)
    grads = torch.autograd.grad(out.square().sum(), (query, key, value))
    ref_grads = torch.autograd.grad(ref.square().sum(), (query, key, value))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want)


def test_without_a_mask_it_defers_to_transformers_sdpa(monkeypatch):
    import transformers.integrations.sdpa_attention as sdpa

    seen = []
    real = sdpa.sdpa_attention_forward
    monkeypatch.setattr(sdpa, "sdpa_attention_forward", lambda *a, **k: seen.append(1) or real(*a, **k))
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    out, _ = attention.packed_gqa_sdpa(AttentionModule(2), q, k, v, None)
    assert seen == [1] and out.shape == (1, 3, 4, 8)


@pytest.fixture
def tiny(tiny_qwen3_vl) -> Path:
    return tiny_qwen3_vl


def _prompts(n: int):
    items = list(generate_items(n, seed=3, size=128))
    return [i.question for i in items], [i.image for i in items]


def test_switching_changes_only_the_language_model(tiny):
    model, _ = _load(tiny)
    assert attention.use_packed_gqa(model)
    assert model.config.text_config._attn_implementation == attention.NAME
    assert model.config.vision_config._attn_implementation == "sdpa"
    layer = model.model.language_model.layers[0].self_attn
    assert layer.config._attn_implementation == attention.NAME  # the modules read the same config object
    eager = AutoModelForImageTextToText.from_pretrained(str(tiny), attn_implementation="eager")
    assert not attention.use_packed_gqa(eager)


@pytest.mark.slow  # ~13 s: four generations, two compiled
def test_greedy_generation_is_unchanged_eager_and_compiled(tiny, monkeypatch):
    import transformers.integrations.sdpa_attention as sdpa

    prompts, images = _prompts(3)  # different prompt lengths: left padding, a real mask
    model, processor = _load(tiny)
    baseline = generate_batch(model, processor, prompts, images, max_new_tokens=12)
    copies = []
    real_repeat = sdpa.repeat_kv
    monkeypatch.setattr(sdpa, "repeat_kv", lambda h, n: copies.append(n) or real_repeat(h, n))
    with monkeypatch.context() as patch:  # control: compiled decoding on transformers' own sdpa
        patch.setattr(attention, "use_packed_gqa", lambda model: False)
        compiled_plain = generate_batch(model, processor, prompts, images, max_new_tokens=12, compiled=True,
                                        compile_all_devices=True)
    assert copies, "control: transformers' sdpa copies the KV heads under compilation"
    assert model.config.text_config._attn_implementation == "sdpa"
    copies.clear()
    torch._dynamo.reset()
    from vlmrl.engine.rollout import step_inputs

    entered = []
    real_step_inputs = step_inputs.step_token_inputs
    monkeypatch.setattr(step_inputs, "step_token_inputs", lambda m: entered.append(m) or real_step_inputs(m))
    compiled_folded = generate_batch(model, processor, prompts, images, max_new_tokens=12, compiled=True,
                                     compile_all_devices=True)
    assert entered == [model]  # compiled evaluation cuts the per-token inputs as rollouts do
    assert model.config.text_config._attn_implementation == attention.NAME  # the compiled path switched it
    folded = generate_batch(model, processor, prompts, images, max_new_tokens=12)
    assert copies == [], "vlmrl_sdpa must not copy the KV heads"
    texts = [[g[0].text for g in gens] for gens in (folded, baseline, compiled_plain, compiled_folded)]
    assert texts[0] == texts[1] == texts[2] == texts[3]


def test_training_with_fast_generation_records_it_and_scopes_it_to_rollouts(tmp_path, captured, monkeypatch):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from tests.helpers import quick_config
    from vlmrl.common.io import read_json, read_jsonl
    from vlmrl.engine.lora_layers import lora_layers
    from vlmrl.models import lora
    from vlmrl.pipeline import prepare_with_budget
    from vlmrl.train.stage import train

    seen = []  # (attention implementation, adapter merged, gradients on) at each attention call

    def spy(implementation):
        real = ALL_ATTENTION_FUNCTIONS[implementation]

        def call(module, *args, **kwargs):
            if hasattr(module, "q_proj"):  # the language model's attention (the vision tower's has qkv)
                seen.append((implementation, module.q_proj.merged, torch.is_grad_enabled()))
            return real(module, *args, **kwargs)
        return call

    captured_apply = lora.apply_lora

    def trained_adapter(model, config, **kwargs):  # non-zero B: merging really changes the base weights
        wrapped, report = captured_apply(model, config, **kwargs)
        with torch.no_grad():
            for layer in lora_layers(wrapped):
                for b in layer.lora_B.values():
                    b.weight.normal_(std=0.05)
        return wrapped, report

    monkeypatch.setattr(lora, "apply_lora", trained_adapter)
    attention.register()
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", spy("sdpa"))
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, attention.NAME, spy(attention.NAME))
    config = quick_config(tmp_path, "train.max_steps=2", "train.rollout.fast=always")
    prepare_with_budget(config, config.run_dir)
    train(config, config.run_dir)
    summary = read_json(config.run_dir / "train" / "summary.json")
    record = summary["fast_generation"]
    assert record["enabled"] and record["attention"] == attention.NAME
    compile_cache = Path(summary["compile_cache"]["inductor_dir"])  # the compiled decode's cache went there
    assert compile_cache == Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) and any(compile_cache.rglob("*"))
    assert record["prefill"] == "dynamic cache, then static"
    assert summary["recompile_limit_hits"] == []  # every token step ran compiled (the step's inputs are cut)
    assert "merge" not in record  # (the merged rollout is a bench variant: benchmarks/variants/merge.py)
    language = {s for s in seen if s[0] == attention.NAME}
    assert language == {(attention.NAME, False, False)}, "rollouts: folded attention, the adapter unmerged, no grad"
    assert (("sdpa", False, True) in seen), "the loss pass runs transformers' sdpa with the LoRA branches"
    assert captured["model"].config.text_config._attn_implementation == "sdpa"  # switched back after rollouts
    model = captured["model"]
    for name, param in model.named_parameters():
        if "lora_" not in name:  # base weights: as they were, bit for bit
            assert torch.equal(param.detach(), captured["before"][name]), name
    assert len(read_jsonl(config.run_dir / "train" / "rollouts.jsonl")) == 16


def test_attention_switch_is_scoped_to_its_block(tiny):
    model, _ = _load(tiny)
    with attention.packed_gqa(model):
        assert model.config.text_config._attn_implementation == attention.NAME
    assert model.config.text_config._attn_implementation == "sdpa"
    eager = AutoModelForImageTextToText.from_pretrained(str(tiny), attn_implementation="eager")
    with attention.packed_gqa(eager):
        assert eager.config.text_config._attn_implementation == "eager"


def _cache(out):
    """The generate output's cache: `cache` in transformers after 5.17, `past_key_values` up to 5.17 (the version
    Unsloth's bench runs with)."""
    return out.cache if hasattr(out, "cache") else out.past_key_values


def test_prompt_pass_on_a_dynamic_cache_fills_the_static_cache_the_same(tiny, monkeypatch):
    from vlmrl.engine.rollout.fast import prefill_into_dynamic_cache
    from vlmrl.engine.rollout.generation import encode_batch

    prompts, images = _prompts(3)  # different lengths: left padding
    model, processor = _load(tiny)
    batch = encode_batch(processor, prompts, images, torch.device("cpu"), bucket=16)
    settings = {"max_new_tokens": 6, "do_sample": False, "cache_implementation": "static",
                "return_dict_in_generate": True}
    plain = model.generate(**batch, **settings)
    assert prefill_into_dynamic_cache(model) == "dynamic cache, then static"
    from transformers import DynamicCache

    prompt_caches = []
    real_init = DynamicCache.__init__
    monkeypatch.setattr(DynamicCache, "__init__", lambda self, *a, **k: prompt_caches.append(1) or real_init(self, *a, **k))
    moved = model.generate(**batch, **settings)
    assert prompt_caches == [1], "the prompt pass ran on a dynamic cache"
    assert torch.equal(moved.sequences, plain.sequences)
    for a, b in zip(_cache(plain).layers, _cache(moved).layers):
        assert a.keys.shape == b.keys.shape  # the static cache keeps its full length
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)
        assert int(a.get_seq_length()) == int(b.get_seq_length())
    prompt_caches.clear()
    model.generate(**batch, **{**settings, "cache_implementation": "dynamic"})
    assert prompt_caches == [1], "a dynamic-cache generate is left as it is (one cache, its own)"


def test_the_static_cache_length_is_bucketed_and_the_prompt_is_not_padded(tiny):
    from vlmrl.engine.rollout.fast import bucket_static_cache
    from vlmrl.engine.rollout.generation import encode_batch

    prompts, images = _prompts(2)
    model, processor = _load(tiny)
    batch = encode_batch(processor, prompts, images, torch.device("cpu"))
    settings = {"do_sample": False, "cache_implementation": "static", "return_dict_in_generate": True}
    plain = model.generate(**batch, max_new_tokens=5, **settings)
    width = batch["input_ids"].shape[1]
    assert _cache(plain).layers[0].keys.shape[2] == width + 4  # transformers: prompt + max_new_tokens - 1
    assert bucket_static_cache(model, 64) and bucket_static_cache(model, 16)  # the second replaces the first
    assert not hasattr(model._prepare_static_cache._vlmrl_original, "_vlmrl_original")  # no wrapper in a wrapper
    out = model.generate(**batch, max_new_tokens=5, **settings)
    assert _cache(out).layers[0].keys.shape[2] == -(-(width + 4) // 16) * 16
    assert out.sequences.shape[1] == width + 5 and torch.equal(out.sequences, plain.sequences)


def test_rollouts_run_under_the_training_autocast_when_adapters_are_fp32(monkeypatch):
    from types import SimpleNamespace

    from vlmrl.engine.rollout.fast import rollout_autocast_dtype

    base = torch.nn.Linear(4, 4).to(torch.bfloat16).requires_grad_(False)
    mixed = torch.nn.Sequential(base, torch.nn.Linear(4, 4))  # frozen bf16 base + trainable fp32 adapter
    assert rollout_autocast_dtype(mixed, SimpleNamespace(bf16=True, fp16=False)) == torch.bfloat16
    assert rollout_autocast_dtype(mixed, SimpleNamespace(bf16=False, fp16=False)) is None  # fp32 run
    all_bf16 = torch.nn.Sequential(base, torch.nn.Linear(4, 4).to(torch.bfloat16))
    assert rollout_autocast_dtype(all_bf16, SimpleNamespace(bf16=True, fp16=False)) is None  # QLoRA: TRL cast them

    from vlmrl.engine.rollout.fast import enable_fast_generation

    seen = []
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def rollout(*args):
        seen.append((torch.is_autocast_enabled(device), torch.get_autocast_dtype(device),
                     torch.is_autocast_cache_enabled()))
        return args

    trainer = fake_trainer(mixed, rollout)
    from vlmrl.engine.rollout import step_graph
    from vlmrl.engine.rollout.fast import STEP_GRAPH

    monkeypatch.setattr(step_graph, "cuda_reason", lambda model: None)  # as on a GPU
    fast = enable_fast_generation(trainer)
    assert fast.autocast == "bfloat16"

    # a bf16 base: each rollout's token step recorded as one graph, compiled without CUDA graph trees for that
    assert fast.step_graph == STEP_GRAPH and fast.mode == trainer.generation_config.compile_config.mode == "default"
    assert [name for name, _ in trainer.vlmrl_rollout_contexts][-2:] == ["step_graph", "compile_over_4bit"]
    assert trainer._generate_single_turn(1, 2) == (1, 2)
    # under the training autocast, without its cast cache (it would hold a bf16 copy of every adapter weight)
    assert seen == [(True, torch.bfloat16, False)]
    assert not torch.is_autocast_enabled(device)  # only inside the rollout


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "gemma3"])
def test_other_families_generate_the_same_with_folded_attention(arch, tmp_path, monkeypatch):
    path = build_tiny_model(arch, tmp_path / arch, hidden_size=64, num_layers=2)
    model, processor = _load(path)
    prompts, images = _prompts(3)
    baseline = generate_batch(model, processor, prompts, images, max_new_tokens=10)
    assert attention.use_packed_gqa(model)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    foldable = []

    def spy(module, query, key, value, mask, **kwargs):
        foldable.append(mask is not None and getattr(module, "num_key_value_groups", 1) > 1)
        return attention.packed_gqa_sdpa(module, query, key, value, mask, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, attention.NAME, spy)
    folded = generate_batch(model, processor, prompts, images, max_new_tokens=10)
    assert any(foldable), "the language model's grouped attention never reached the fold"
    assert [g[0].text for g in folded] == [g[0].text for g in baseline]
    assert [g[0].tokens for g in folded] == [g[0].tokens for g in baseline]


def test_compiling_over_a_4bit_base_is_allowed_only_inside_the_block(monkeypatch):
    """transformers refuses to compile generation over a bitsandbytes base (`is_compileable` False); the
    rollout context lifts that for its duration when bitsandbytes' matmul is a traceable torch op."""
    from transformers import BitsAndBytesConfig
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer

    from vlmrl.engine.rollout import quantized_base as fast

    quantizer = Bnb4BitHfQuantizer(BitsAndBytesConfig(load_in_4bit=True))
    model = type("Model", (), {"hf_quantizer": quantizer})()
    assert quantizer.is_compileable is False
    monkeypatch.setattr(fast, "bnb_ops_traceable", lambda: False)
    with fast.compile_over_4bit(model):
        assert quantizer.is_compileable is False  # an older bitsandbytes: its layers would break the graph
    monkeypatch.setattr(fast, "bnb_ops_traceable", lambda: True)
    with pytest.raises(RuntimeError), fast.compile_over_4bit(model):
        assert quantizer.is_compileable is True
        assert isinstance(quantizer, Bnb4BitHfQuantizer)
        raise RuntimeError("a failed rollout")
    assert type(quantizer) is Bnb4BitHfQuantizer and quantizer.is_compileable is False
    with fast.compile_over_4bit(object()):  # no quantizer: nothing to do
        pass


@pytest.mark.parametrize("rows", [1, 2])  # one row: a slice of it counts as contiguous yet keeps its row stride
def test_token_steps_get_only_their_own_tokens_type_ids(tiny, rows):
    # transformers before 5.23 handed every token step the whole mm_token_type_ids, one column longer each step (a
    # new shape for a compiled step at every token); the stand-in below does that on any version.
    from vlmrl.engine.rollout.generation import encode_batch
    from vlmrl.engine.rollout.step_inputs import step_token_inputs

    prompts, images = _prompts(2)
    model, processor = _load(tiny)
    batch = encode_batch(processor, prompts[:rows], images[:rows], torch.device("cpu"), bucket=16)
    assert "mm_token_type_ids" in batch
    settings = {"max_new_tokens": 5, "do_sample": False, "cache_implementation": "static"}
    expected = model.generate(**batch, **settings)
    prepare = model.prepare_inputs_for_generation

    def as_before_5_23(input_ids, *args, **kwargs):
        inputs = prepare(input_ids, *args, **kwargs)
        inputs["mm_token_type_ids"] = kwargs["mm_token_type_ids"]
        return inputs

    widths, strides = [], []
    forward = model.forward

    @functools.wraps(forward)  # generate checks its keyword arguments against the signature
    def recording(*args, **kwargs):
        types = kwargs["mm_token_type_ids"]
        widths.append((kwargs["input_ids"].shape[1], types.shape[1]))
        strides.append(types.stride())
        return forward(*args, **kwargs)

    model.forward = recording
    model.prepare_inputs_for_generation = as_before_5_23
    try:
        model.generate(**batch, **settings)
        assert [w for n, w in widths[1:]] == list(range(widths[0][1] + 1, widths[0][1] + 5))  # the stand-in grows it
        widths.clear()
        strides.clear()
        with step_token_inputs(model):
            got = model.generate(**batch, **settings)
        assert model.prepare_inputs_for_generation is as_before_5_23  # put back after the block
    finally:
        del model.forward, model.prepare_inputs_for_generation
    assert widths[0][0] == widths[0][1] > 1  # the prompt pass keeps all of its columns
    assert widths[1:] == [(1, 1)] * 4 and strides[1:] == [(1, 1)] * 4  # the same shape and strides at every step
    assert torch.equal(got, expected)
