"""The token-step attention kernel (`vlmrl.engine.rollout.decode_attention`, `train.rollout.kernels`), on CUDA where
there is one and otherwise in Triton's CPU interpreter (tests/conftest.py turns it on): SDPA's attention, blocks
nothing attends to left unread, the cases it refuses left to SDPA, and the rollouts that turn it on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import load_sdpa
from tests.helpers import AttentionModule as _Module
from vlmrl.engine.rollout import attention
from vlmrl.engine.rollout import decode_attention as kernel_module
from vlmrl.engine.rollout.decode_attention import BLOCK, HAS_TRITON, decode_attention, interpreted, usable

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (its CPU interpreter)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def interpreter():
    if DEVICE == "cpu" and not interpreted():
        pytest.skip("Triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it)")
    yield
    assert not kernel_module._failed, f"the kernel fell back to SDPA: {kernel_module._failed}"


def _inputs(dtype, batch=3, kv_heads=2, groups=4, positions=150, dim=32, seed=0, device=DEVICE):
    torch.manual_seed(seed)
    query = torch.randn(batch, kv_heads * groups, 1, dim).to(device, dtype)
    key = torch.randn(batch, kv_heads, positions, dim).to(device, dtype)
    value = torch.randn(batch, kv_heads, positions, dim).to(device, dtype)
    mask = torch.zeros(batch, 1, 1, positions, dtype=torch.bool, device=device)
    mask[0, ..., :positions - 20] = True  # a filled cache with an unwritten tail
    mask[1, ..., 40:positions - 60] = True  # left padding and a tail
    mask[2, ..., positions // 2] = True  # one position
    # folded as vlmrl_sdpa folds it: a view, not a copy
    return query.reshape(batch, kv_heads, groups, dim), key, value, mask


def _reference(query, key, value, mask):
    return torch.nn.functional.scaled_dot_product_attention(query.double(), key.double(), value.double(),
                                                            attn_mask=mask)


@pytest.mark.parametrize("dtype,tolerance", [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("splits,block", [(1, BLOCK), (2, 32), (3, 16)])
def test_it_is_sdpas_attention(dtype, tolerance, splits, block):
    query, key, value, mask = _inputs(dtype)
    out = decode_attention(query, key, value, mask, block=block, splits=splits)
    assert out.dtype == dtype and out.shape == query.shape
    reference = _reference(query, key, value, mask)
    torch.testing.assert_close(out.double(), reference, atol=tolerance, rtol=0)
    # as close as SDPA itself in that dtype
    sdpa = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    assert (out.double() - reference).abs().max() <= 2 * (sdpa.double() - reference).abs().max() + 1e-3


@pytest.mark.parametrize("splits", [2, 3])
def test_the_last_share_to_finish_merges_them_as_the_second_kernel_did(splits, monkeypatch):
    from vlmrl.engine.rollout import arrivals

    monkeypatch.setattr(arrivals, "_counters", {})
    query, key, value, mask = _inputs(torch.bfloat16)
    launched = []
    real = kernel_module._kernels

    def counted(interpret):
        partial, combine = real(interpret)

        class Counted:
            def __getitem__(self, grid):
                return lambda *a, **k: launched.append(grid) or combine[grid](*a, **k)

        return partial, Counted()

    monkeypatch.setattr(kernel_module, "_kernels", counted)
    # on a GPU the shares finish in any order: launch after launch, the last reads every other's (acquire/release)
    runs = [decode_attention(query, key, value, mask, block=32, splits=splits) for _ in range(50 if DEVICE == "cuda" else 1)]
    in_kernel = runs[0]
    assert not launched  # merged in the first kernel,
    assert all(torch.equal(run, in_kernel) for run in runs)
    counters = list(arrivals._counters.values())  # (keyed by the device the launch ran on)
    assert counters and not any(c.any() for c in counters)  # every counter back at 0 for the next launch
    monkeypatch.setattr(arrivals, "COUNTERS", 0)  # no counters to be had: the second kernel merges them
    two_kernels = decode_attention(query, key, value, mask, block=32, splits=splits)
    assert launched and torch.equal(in_kernel, two_kernels)  # bit for bit: the same order


def test_a_scale_and_a_mask_shared_by_the_batch():
    query, key, value, mask = _inputs(torch.float16)
    shared = mask[:1]
    out = decode_attention(query, key, value, shared, scale=0.3, splits=2)
    reference = torch.nn.functional.scaled_dot_product_attention(query.double(), key.double(), value.double(),
                                                                 attn_mask=shared, scale=0.3)
    torch.testing.assert_close(out.double(), reference, atol=3e-3, rtol=0)


def test_blocks_nothing_attends_to_are_not_read():
    query, key, value, mask = _inputs(torch.float16, positions=4 * 16)
    mask[:] = False
    mask[..., 16:32] = True  # the second block of 16 only
    expected = decode_attention(query, key, value, mask, block=16, splits=2)
    for cache in (key, value):
        cache[:, :, :16] = float("nan")
        cache[:, :, 32:] = float("nan")
    out = decode_attention(query, key, value, mask, block=16, splits=2)
    assert torch.equal(out, expected)


def test_a_row_that_attends_to_nothing_gives_zeros():
    query, key, value, mask = _inputs(torch.float16)
    mask[1] = False
    out = decode_attention(query, key, value, mask, splits=2)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out[0].double(), _reference(query, key, value, mask)[0], atol=3e-3, rtol=0)


def test_what_it_does_not_compute_is_left_to_sdpa():
    query, key, value, mask = _inputs(torch.bfloat16, device="cpu")
    assert usable(query, key, value, mask, on_cpu=True)
    assert not usable(query, key, value, mask)  # a CPU without the interpreter
    assert not usable(query, key, value, mask.float().log(), on_cpu=True)  # an additive mask
    assert not usable(query.float(), key.float(), value.float(), mask, on_cpu=True)
    assert not usable(query, key, value, mask, 0.1, on_cpu=True)  # dropout
    assert not usable(query, key, value, mask.expand(-1, 1, 2, -1), on_cpu=True)  # two query tokens
    assert not usable(query.repeat(1, 1, 5, 1), key, value, mask, on_cpu=True)  # 20 rows per KV head
    assert not usable(query[..., :24], key[..., :24], value[..., :24], mask, on_cpu=True)  # dim not a power of 2
    wide = torch.zeros(3, 2, 4, 256, dtype=torch.bfloat16)
    assert not usable(wide, key.new_zeros(3, 2, 150, 256), key.new_zeros(3, 2, 150, 256), mask, on_cpu=True)
    assert not usable(query.requires_grad_(), key, value, mask, on_cpu=True)  # training
    with torch.no_grad():
        assert usable(query, key, value, mask, on_cpu=True)


def _token_step(groups=4, dtype=torch.bfloat16):
    query, key, value, mask = _inputs(dtype, groups=groups)
    batch, kv_heads, _, dim = query.shape
    return query.reshape(batch, kv_heads * groups, 1, dim), key, value, mask


def test_vlmrl_sdpa_runs_token_steps_through_it_inside_the_block_only(monkeypatch):
    calls = []
    real = kernel_module.decode_attention
    monkeypatch.setattr(kernel_module, "decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    query, key, value, mask = _token_step()
    outside, _ = attention.packed_gqa_sdpa(_Module(4), query, key, value, mask)
    assert calls == []
    with attention.decode_kernel(on_cpu=True):
        inside, _ = attention.packed_gqa_sdpa(_Module(4), query, key, value, mask)
        assert calls == [1]
        prompt = torch.randn(3, 8, 5, 32, dtype=torch.bfloat16, device=DEVICE)  # a prompt pass: SDPA
        attention.packed_gqa_sdpa(_Module(4), prompt, key, value,
                                  torch.ones(3, 1, 5, 150, dtype=torch.bool, device=DEVICE))
        assert calls == [1]
    assert not attention._decode_kernel  # restored
    assert inside.shape == outside.shape == (3, 1, 8, 32)
    torch.testing.assert_close(inside.double(), outside.double(), atol=2e-2, rtol=0)
    with attention.decode_kernel(False, on_cpu=True):
        attention.packed_gqa_sdpa(_Module(4), query, key, value, mask)
    assert calls == [1]


def test_a_compiled_token_step_calls_it_without_a_graph_break():
    query, key, value, mask = _token_step()
    expected, _ = attention.packed_gqa_sdpa(_Module(4), query, key, value, mask)

    def step(q, k, v, m):
        return attention.packed_gqa_sdpa(_Module(4), q, k, v, m)[0]

    torch._dynamo.reset()
    with attention.decode_kernel(on_cpu=True):
        eager = step(query, key, value, mask)
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(query, key, value, mask)
    assert torch.equal(compiled, eager)
    torch.testing.assert_close(compiled.double(), expected.double(), atol=2e-2, rtol=0)


@pytest.fixture
def tiny(tiny_qwen3_vl) -> Path:
    return tiny_qwen3_vl


def test_greedy_decoding_with_the_kernel_gives_the_same_tokens(tiny, monkeypatch):
    from vlmrl.data.synthetic import generate_items
    from vlmrl.engine.rollout.fast import bucket_static_cache, prefill_into_dynamic_cache
    from vlmrl.engine.rollout.generation import encode_batch

    model, processor = load_sdpa(tiny)
    model.to(DEVICE, torch.float16)
    items = list(generate_items(2, seed=3, size=128))
    batch = encode_batch(processor, [i.question for i in items], [i.image for i in items], torch.device(DEVICE))
    batch["pixel_values"] = batch["pixel_values"].to(torch.float16)
    assert bucket_static_cache(model, 64)  # positions past the tokens: blocks to skip
    prefill_into_dynamic_cache(model)
    settings = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "cache_implementation": "static",
                "return_dict_in_generate": True, "output_logits": True}
    calls = []
    real = kernel_module.decode_attention
    monkeypatch.setattr(kernel_module, "decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    with attention.packed_gqa(model):
        sdpa = model.generate(**batch, **settings)
        assert calls == []
        with attention.decode_kernel(on_cpu=True):
            fast = model.generate(**batch, **settings)
    assert len(calls) == 5 * model.config.text_config.num_hidden_layers  # every token step after the prompt's
    assert torch.equal(fast.sequences, sdpa.sequences)
    for a, b in zip(fast.logits, sdpa.logits):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=0)


def test_rollouts_run_it_and_the_setting_is_recorded(tiny):
    from types import SimpleNamespace

    from transformers import AutoModelForImageTextToText, GenerationConfig

    from vlmrl.engine.rollout.fast import enable_fast_generation

    model, _ = load_sdpa(tiny)
    seen = []

    def trainer(model):
        return SimpleNamespace(generation_config=GenerationConfig(), generation_kwargs={}, model=model,
                               args=SimpleNamespace(bf16=False, fp16=False),
                               _generate_single_turn=lambda: seen.append(attention._decode_kernel))

    on = trainer(model)
    fast = enable_fast_generation(on)  # kernels on: the product's default
    assert fast.cache_read.endswith("token steps skip the blocks nothing attends to (vlmrl.engine.rollout.decode_attention), "
                                    "and rows that have ended attend to their own position only "
                                    "(vlmrl.engine.rollout.finished)")
    on._generate_single_turn()
    assert seen == [True] and not attention._decode_kernel  # on for the rollout only
    off = trainer(model)
    assert enable_fast_generation(off, kernels=False).cache_read == "the whole static cache"
    off._generate_single_turn()
    assert seen == [True, False]
    eager = AutoModelForImageTextToText.from_pretrained(str(tiny), attn_implementation="eager")
    refused = enable_fast_generation(trainer(eager))
    assert refused.cache_read == "the whole static cache (the decode kernel needs vlmrl_sdpa)"


def test_vlmrl_train_turns_it_on_by_default():
    from vlmrl.config.schema import Config

    assert Config().train.rollout.kernels is True  # passed to enable_fast_generation(kernels=...) by vlmrl train
    # how a token step's attention is summed is not what a run produces: a finished stage stays done
    config = Config()
    before = config.fingerprint()
    config.train.rollout.kernels = False
    assert config.fingerprint() == before


def test_where_triton_cannot_run_it_sdpa_computes_the_step_and_says_so(monkeypatch, caplog):
    def broken(interpret):
        raise RuntimeError("no bf16 dot on this GPU")

    monkeypatch.setattr(kernel_module, "_kernels", broken)
    monkeypatch.setattr(kernel_module, "_failed", {})
    query, key, value, mask = _inputs(torch.bfloat16)
    with caplog.at_level("WARNING", logger="vlmrl.engine.rollout.decode_attention"):
        first = decode_attention(query, key, value, mask)
        second = decode_attention(query, key, value, mask)
    sdpa = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    assert torch.equal(first, sdpa) and torch.equal(second, sdpa)
    where = (str(query.device), torch.bfloat16, 32, BLOCK)
    assert [r.getMessage() for r in caplog.records if "cannot run" in r.getMessage()] == [
        (f"the decode attention kernel cannot run on {where} (RuntimeError: no bf16 dot on this GPU); token steps use "
         "SDPA instead")]  # once
