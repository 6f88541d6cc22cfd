"""Stacked projections for rollouts (`vlmrl.engine.rollout.stacked`, wherever they apply): what PEFT's forwards
compute, with 8 matmuls per layer instead of 21, the base weights moved once and the loss pass unchanged."""

from __future__ import annotations

import collections
import importlib.util

import pytest
import torch

from tests.conftest import load_sdpa
from tests.helpers import Block, compiled_calls, fake_trainer, lora_policy
from vlmrl.data.synthetic import generate_items
from vlmrl.engine.lora_layers import lora_layers
from vlmrl.engine.rollout.fast import (
    bucket_static_cache,
    compile_settings,
    enable_fast_generation,
    prefill_into_dynamic_cache,
)
from vlmrl.engine.rollout.generation import encode_batch
from vlmrl.engine.rollout.stacked import StackedProjections

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SETTINGS = {"max_new_tokens": 12, "min_new_tokens": 12, "do_sample": False, "cache_implementation": "static",
            "return_dict_in_generate": True, "output_logits": True}


@pytest.fixture
def policy_and_batch(tiny_qwen3_vl):
    model, processor = load_sdpa(tiny_qwen3_vl)
    items = list(generate_items(3, seed=3, size=128))
    batch = encode_batch(processor, [i.question for i in items], [i.image for i in items], torch.device("cpu"))
    bucket_static_cache(model, 64)
    prefill_into_dynamic_cache(model)
    return lora_policy(model), batch


def _linear_calls_per_graph(policy, batch, context) -> tuple[list[int], torch.Tensor]:
    """Decode compiled through a backend that counts the `linear` calls dynamo captured in each graph."""
    from torch._dynamo.utils import counters

    graphs: list[int] = []

    def backend(gm, example_inputs):
        graphs.append(sum(1 for n in gm.graph.nodes if n.op == "call_function"
                          and getattr(n.target, "__name__", "") == "linear"))
        return gm.forward

    torch._dynamo.reset()
    counters.clear()
    settings = compile_settings(all_devices=True)
    settings["compile_config"].backend, settings["compile_config"].mode = backend, None
    with context:
        out = policy.generate(**batch, **{**SETTINGS, **settings})
    assert not counters["graph_break"], dict(counters["graph_break"])
    return graphs, out.sequences


def test_rollouts_compute_what_peft_computes_with_eight_matmuls_per_layer(policy_and_batch):
    import contextlib

    policy, batch = policy_and_batch
    ids = batch["input_ids"][:, :16]
    before = policy(input_ids=ids).logits
    reference = policy.generate(**batch, **SETTINGS)
    stack = StackedProjections(policy)
    assert stack.reason is None
    layers = policy.base_model.model.config.text_config.num_hidden_layers
    assert sorted(len(g.layers) for g in stack.groups) == sorted([1, 1, 2, 3] * layers)
    for group in stack.groups:  # each base weight is a view of its rows of the group's tensor: nothing copied
        start = 0
        for layer, out in zip(group.layers, group.outs):
            weight = layer.get_base_layer().weight
            assert weight.data_ptr() == group.weight[start:start + out].data_ptr() and not weight.requires_grad
            start += out
    assert torch.equal(policy(input_ids=ids).logits, before)  # the loss pass computes exactly what it did

    with stack.active():
        got = policy.generate(**batch, **SETTINGS)
    assert torch.equal(got.sequences, reference.sequences)
    for a, b in zip(got.logits, reference.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert all("forward" not in vars(layer) for layer in lora_layers(policy))  # PEFT's forwards again after
    assert all(g.second is None and not g.owed for g in stack.groups)

    peft_graphs, peft_tokens = _linear_calls_per_graph(policy, batch, contextlib.nullcontext())
    stacked_graphs, stacked_tokens = _linear_calls_per_graph(policy, batch, stack.active())
    assert peft_graphs == [21 * layers + 1]  # 7 base + 14 adapter matmuls per layer, and the LM head
    assert stacked_graphs == [8 * layers + 1]  # one graph: nothing about the stacking recompiles
    assert torch.equal(stacked_tokens, reference.sequences) and torch.equal(peft_tokens, reference.sequences)

    policy.merge_and_unload()  # exporting after training in the same process: the views merge and save
    assert torch.equal(stack.groups[0].layers[0].get_base_layer().weight, stack.groups[0].weight[:stack.groups[0].outs[0]])


def test_a_sibling_called_with_another_input_gets_its_own_result_and_scales_may_differ():
    torch.manual_seed(1)
    block = lora_policy(Block(), rank_pattern={"k_proj": 2}, alpha_pattern={"v_proj": 2}).requires_grad_(False)
    x, y = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    expected = block(x, y)
    stack = StackedProjections(block)
    with stack.active():
        got = block(x, y)
        calls = collections.Counter()
        real = type(stack.groups[0]).compute
        for group in stack.groups:
            group.compute = lambda x, g=group: calls.update([len(g.layers)]) or real(g, x)
        block(x, y)
        scale = stack.groups[0].scale
    assert [len(g.layers) for g in stack.groups] == [3, 2, 1]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # q(x) computes q/k/v; k(y) misses and computes them for y; v(x) is then owed nothing and computes again;
    # gate(y) serves up(y); the last gate(x) computes for x
    assert calls == {3: 3, 2: 2, 1: 1}
    assert isinstance(scale, torch.Tensor) and scale.shape == (32,)  # rank and alpha patterns: one scale per output column


@pytest.mark.parametrize(("lora", "reason"), [({"lora_dropout": 0.1}, "LoRA dropout"),
                                              ({"use_dora": True}, "DoRA adapters")])
def test_what_cannot_be_stacked_is_left_as_it_is_and_says_why(lora, reason):
    block = lora_policy(Block(), **lora)
    weights = [p for n, p in block.named_parameters() if "base_layer" in n]
    stack = StackedProjections(block)
    assert stack.reason.startswith(reason) and not stack.groups
    assert [p for n, p in block.named_parameters() if "base_layer" in n] == weights  # nothing moved
    assert StackedProjections(Block()).reason == "no LoRA layers"


def test_stacking_replaces_the_copies_by_default_and_wraps_each_rollout():
    seen = []

    def make():
        model = lora_policy(Block().to(torch.bfloat16))
        trainer = fake_trainer(model, lambda: seen.append(["forward" in vars(m) for m in lora_layers(model)]))
        return model, trainer

    model, trainer = make()
    fast = enable_fast_generation(trainer)  # the product's defaults
    assert fast.adapters.startswith("stacked by shared input for rollouts (3 groups of 3/2/1 projections")
    assert [name for name, _ in trainer.vlmrl_rollout_contexts if name in ("offload", "adapter_copies", "stacked")] \
        == ["offload", "stacked"]
    trainer._generate_single_turn()
    assert seen == [[True] * 6]
    assert not any("forward" in vars(m) for m in lora_layers(model))
    model, trainer = make()
    trainer.args.bf16 = False  # float32 adapters over a bf16 base with no autocast to match them
    refused = enable_fast_generation(trainer)
    assert refused.adapters.startswith("not stacked (the adapters' dtype differs")
    model = lora_policy(Block().to(torch.bfloat16), lora_dropout=0.1)
    fallback = enable_fast_generation(fake_trainer(model, lambda: None))
    assert fallback.adapters.startswith("not stacked (LoRA dropout") and "; bfloat16 copies made per rollout" in \
        fallback.adapters  # refused: the copies apply, and the record says so


def test_in_bf16_under_the_rollout_autocast_it_computes_what_the_adapter_copies_compute():
    from vlmrl.engine.rollout.adapter_cast import LowPrecisionAdapters

    block = lora_policy(Block(64).to(torch.bfloat16))  # float32 adapters over a bf16 base, as PEFT keeps them
    x, y = torch.randn(4, 5, 64, dtype=torch.bfloat16), torch.randn(4, 5, 64, dtype=torch.bfloat16)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)
    with torch.no_grad(), autocast, LowPrecisionAdapters(block, torch.bfloat16).active():
        expected = block(x, y)
    stack = StackedProjections(block)
    with torch.no_grad(), autocast, stack.active():
        got = block(x, y)
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
def test_over_a_4bit_base_the_first_factors_are_stacked_and_compute_what_the_copies_compute(monkeypatch):
    """Over bitsandbytes nf4 bases only the first factors are stacked (one matmul for q/k/v, one for gate/up), each
    member's second step one kernel over its nf4 output where the members' bases are not all on the nf4 kernel: bit
    for bit what PEFT's branch over the bf16 adapter copies computes, eager and compiled in one graph."""
    from tests.helpers import nf4_block_with_expected
    from vlmrl.engine.rollout import nf4, nf4_branch, second_factors

    monkeypatch.setattr(nf4_branch, "takes", lambda layer, dtype: False)  # (the next test: where they are)
    # PEFT's forwards over the nf4 kernel, with the bf16 adapter copies
    block, x, y, autocast, expected = nf4_block_with_expected()
    assert StackedProjections(block, first_factors=False).reason.startswith("a Linear4bit base layer")
    assert StackedProjections(block).reason.startswith("a Linear4bit base layer")  # only where asked
    stack = StackedProjections(block, torch.bfloat16, first_factors=True)
    assert stack.reason is None and stack.first_factors_only and [len(g.layers) for g in stack.groups] == [3, 2, 1]
    assert all(g.weight.shape == (sum(g.ranks), 64) for g in stack.groups)
    assert stack.nbytes == (4 + 2 + 4 + 4 + 4 + 4) * 64 * 2
    # each member's own [out, rank] second factor in bf16, no block-diagonal zeros: q, k (rank 2), v, o, gate, up
    assert stack.second_nbytes() == (64 * 4 + 32 * 2 + 32 * 4 + 64 * 4 + 128 * 4 + 128 * 4) * 2
    calls = collections.Counter()
    real = second_factors.added_second
    monkeypatch.setattr(second_factors, "added_second", lambda *a: calls.update(["kernel"]) or real(*a))
    for fused in (True, False):
        with torch.no_grad(), autocast, nf4.nf4_decode(block), stack.active(fused=fused):
            got = block(x, y)
        for a, b in zip(got, expected, strict=True):
            assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    # per member computed (3 q/k/v computes, 2 gate/up, 1 o: the owed outputs as in the bf16 stacking): the fused
    # step where asked (20 rows, bf16), the unfused one otherwise
    assert calls == {"kernel": 14}
    assert all(not g.seconds and not g.owed for g in stack.groups)
    assert all("forward" not in vars(layer) for layer in lora_layers(block))
    monkeypatch.undo()
    monkeypatch.setattr(nf4_branch, "takes", lambda layer, dtype: False)
    with torch.no_grad(), autocast, nf4.nf4_decode(block), stack.active(fused=True):
        compiled, nodes = compiled_calls(block, x, y)
    assert all(torch.equal(a, b) for a, b in zip(compiled, expected, strict=True))
    counted = collections.Counter(nodes)
    assert (counted["vlmrl.nf4_matmul.default"], counted["vlmrl.added_second.default"]) == (14, 14)
    assert counted["<built-in function linear>"] == 6  # one first-factor matmul per group computed, no second one
    # once the token steps are back on CUDA graph trees, the rollouts after run PEFT's own branch again
    with torch.no_grad(), autocast, nf4.nf4_decode(block), stack.active(fused=True, first_factors=lambda: False):
        assert all("forward" not in vars(layer) for layer in lora_layers(block))
        assert all(torch.equal(a, b) for a, b in zip(block(x, y), expected, strict=True))


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
def test_over_bases_on_the_nf4_kernel_each_member_and_its_branch_are_one_launch(monkeypatch):
    """Where every member's base is on the nf4 kernel, a token step runs each member, base and LoRA branch, in one
    launch of it (`nf4_branch`): no first-factor matmul, no second-step kernel; PEFT's branch over the bf16 adapter
    copies to the bit in Triton's interpreter (its sums' order is the kernel's), eager and compiled in one graph."""
    from tests.helpers import NF4_DEVICE, nf4_block_with_expected
    from vlmrl.engine.rollout import nf4, nf4_branch, second_factors

    block, x, y, autocast, expected = nf4_block_with_expected()
    stack = StackedProjections(block, torch.bfloat16, first_factors=True)

    def same(got):
        for a, b in zip(got, expected, strict=True):
            if NF4_DEVICE == "cpu":
                assert a.dtype == torch.bfloat16 and torch.equal(a, b)
            else:  # the first factors' sums in another order than cuBLAS's: within a unit in the last place
                torch.testing.assert_close(a, b, rtol=2**-7, atol=2**-7)

    calls = collections.Counter()
    for module, name in ((second_factors, "added_second"), (nf4_branch, "branch_step")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, name=name, real=real: calls.update([name]) or real(*a))
    with torch.no_grad(), autocast, nf4.nf4_decode(block), stack.active(fused=True):
        same(block(x, y))
    assert calls == {"branch_step": 14}  # one launch per member computed, no second step apart
    assert all(not g.seconds and not g.in_kernel for g in stack.groups)  # released after the block
    calls.clear()
    with torch.no_grad(), autocast, nf4.nf4_decode(block), stack.active(fused=False):
        same(block(x, y))
    assert not calls  # without the kernels the branch is PEFT's arithmetic, apart
    monkeypatch.undo()
    with torch.no_grad(), autocast, nf4.nf4_decode(block), stack.active(fused=True):
        compiled, nodes = compiled_calls(block, x, y)
    same(compiled)
    counted = collections.Counter(nodes)
    assert counted["vlmrl.nf4_branch.default"] == 14
    assert counted["vlmrl.added_second.default"] == counted["<built-in function linear>"] == 0
