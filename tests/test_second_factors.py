"""The stacked projections' second step as one Triton kernel (`vlmrl.engine.rollout.second_factors`), run here by Triton's
CPU interpreter: the unfused step's values and roundings, inside a compiled step as one node, and a fallback."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import Block, lora_policy
from vlmrl.engine.rollout import second_factors
from vlmrl.engine.rollout.stacked import StackedProjections

pytestmark = pytest.mark.skipif(not second_factors.HAS_TRITON or not (torch.cuda.is_available()
                                                                       or second_factors.interpreted()),
                                reason="needs Triton on CUDA or its interpreter")


def _block_diagonal(outs: list[int], ranks: list[int]) -> torch.Tensor:
    second = torch.zeros(sum(outs), sum(ranks), dtype=torch.bfloat16)
    row = col = 0
    for out, rank in zip(outs, ranks, strict=True):
        second[row:row + out, col:col + rank] = torch.randn(out, rank) * 0.1
        row, col = row + out, col + rank
    return second


@pytest.mark.parametrize(("rows", "outs", "ranks", "per_column"), [
    (1, [70], [16], False), (20, [96, 40, 40], [16, 16, 16], True), (64, [200, 200], [16, 16], False)])
def test_the_kernel_gives_the_unfused_steps_values(rows, outs, ranks, per_column, monkeypatch):
    torch.manual_seed(rows)
    launches = []
    monkeypatch.setattr(second_factors, "_failed", {})
    real = second_factors._launch
    monkeypatch.setattr(second_factors, "_launch", lambda *a: launches.append(1) or real(*a))
    second = _block_diagonal(outs, ranks)
    stacked = torch.randn(rows, sum(outs) + sum(ranks), dtype=torch.bfloat16)
    scale = (torch.cat([torch.full((o,), s) for o, s in zip(outs, (2.0, 0.5, 1.25))]).to(torch.bfloat16)
             if per_column else 2.0)
    with torch.no_grad():
        assert second_factors.usable(stacked, second)
        got = second_factors.stacked_second(stacked, second, scale)
        expected = second_factors.reference(stacked, second, scale)
    assert launches == [1] and not second_factors._failed and got.dtype == torch.bfloat16 and got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=8e-3, atol=1e-2)  # a bf16 step at most: summation order
    assert (got == expected).float().mean() > 0.99  # rounded where the unfused step rounds


def test_it_reads_rows_laid_out_with_padding_so_a_compiled_step_need_not_copy_them(monkeypatch):
    # The op is tagged flexible_layout: inductor may hand it the stacked matmul's output with rows padded (on a GPU,
    # to 128 bytes), so the kernel must read each row through its stride.
    assert torch.Tag.flexible_layout in torch.ops.vlmrl.stacked_second.default.tags
    monkeypatch.setattr(second_factors, "_failed", {})
    torch.manual_seed(3)
    second = _block_diagonal([1100], [16])
    padded = torch.randn(5, 1152, dtype=torch.bfloat16)[:, :1116]
    assert padded.stride() == (1152, 1)
    with torch.no_grad():
        got = torch.ops.vlmrl.stacked_second(padded, second, None, 2.0)
        expected = second_factors.reference(padded.contiguous(), second, 2.0)
    assert not second_factors._failed
    torch.testing.assert_close(got, expected, rtol=8e-3, atol=1e-2)
    assert (got == expected).float().mean() > 0.99


def test_what_the_kernel_does_not_take_stays_on_the_unfused_step():
    second = _block_diagonal([64], [16])
    with torch.no_grad():
        assert not second_factors.usable(torch.randn(65, 80, dtype=torch.bfloat16), second)  # a prompt pass's rows
        assert not second_factors.usable(torch.randn(8, 80), second.float())  # float32
    assert not second_factors.usable(torch.randn(8, 80, dtype=torch.bfloat16), second)  # gradients on


def test_a_block_under_the_rollout_autocast_runs_it_compiled_as_one_node_per_group(monkeypatch):
    from torch._dynamo.utils import counters

    monkeypatch.setattr(second_factors, "_failed", {})
    block = lora_policy(Block(64).to(torch.bfloat16))
    x, y = torch.randn(4, 5, 64, dtype=torch.bfloat16), torch.randn(4, 5, 64, dtype=torch.bfloat16)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)
    stack = StackedProjections(block)
    with torch.no_grad(), autocast, stack.active():
        expected = block(x, y)
    nodes = []

    def backend(gm, example_inputs):
        nodes.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad(), autocast, stack.active(fused=True):
        got = torch.compile(block, backend=backend, fullgraph=True)(x, y)
    # one per group computed: q/k/v for x, then for y (k reads y) and again for x (v: what q computed is gone),
    # gate/up for y and for x, o for x
    assert len(stack.groups) == 3 and nodes.count("vlmrl.stacked_second.default") == 6
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=8e-3, atol=1e-2)
    assert not second_factors._failed  # the kernel ran
    assert all(not g.fused for g in stack.groups)  # off again after the block


def test_where_the_kernel_cannot_run_the_step_falls_back_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(second_factors, "_failed", {})
    monkeypatch.setattr(second_factors, "_launch", lambda *a: (_ for _ in ()).throw(RuntimeError("no kernel here")))
    second = _block_diagonal([64], [16])
    stacked = torch.randn(8, 80, dtype=torch.bfloat16)
    with torch.no_grad(), caplog.at_level("WARNING", logger="vlmrl.engine.rollout.second_factors"):
        first = second_factors.stacked_second(stacked, second, 2.0)
        again = second_factors.stacked_second(stacked, second, 2.0)
    expected = second_factors.reference(stacked, second, 2.0)
    assert torch.equal(first, expected) and torch.equal(again, expected)
    assert caplog.text.count("cannot run") == 1 and "no kernel here" in caplog.text


def test_kernels_run_it_in_rollouts_only(monkeypatch):
    from tests.helpers import fake_trainer
    from vlmrl.engine.rollout.fast import enable_fast_generation

    monkeypatch.setattr(second_factors, "_failed", {})
    launches = []
    real = second_factors._launch
    monkeypatch.setattr(second_factors, "_launch", lambda *a: launches.append(1) or real(*a))
    block = lora_policy(Block(64).to(torch.bfloat16))
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)

    def rollout():
        with torch.no_grad():
            return block(x, x)

    trainer = fake_trainer(block, rollout)
    fast = enable_fast_generation(trainer)  # the product's default: kernels on
    assert fast.adapters.endswith("vlmrl.engine.rollout.group_step), else its second step one (second_factors)")
    trainer._generate_single_turn()
    assert len(launches) == 4 and not second_factors._failed  # q/k/v once, o, gate/up twice (gate reads x again)
    with torch.no_grad():
        block(x, x)  # outside rollouts: PEFT's own forwards
    assert len(launches) == 4
    plain = fake_trainer(lora_policy(Block(64).to(torch.bfloat16)), lambda: None)
    # off with the kernels (train.rollout.kernels=false)
    assert "second_factors" not in enable_fast_generation(plain, kernels=False).adapters
