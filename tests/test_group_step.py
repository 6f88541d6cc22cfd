"""A stacked group's token step as one kernel (`vlmrl.engine.rollout.group_step`): the arithmetic it replaces (cuBLAS's
stacked matmul, then the second step as `second_factors` rounds it), with biases, per-column scales and K split, in
Triton's CPU interpreter (tests/conftest.py) or on a CUDA GPU; the stacked projections running it at token steps,
eager and compiled; and the shapes it leaves to the path before."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import Block, compiled_calls, lora_policy
from vlmrl.engine.rollout import arrivals, group_step, second_factors
from vlmrl.engine.rollout.decode_attention import HAS_TRITON, interpreted
from vlmrl.engine.rollout.stacked import StackedProjections

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not HAS_TRITON or not (DEVICE == "cuda" or interpreted()),
                                reason="needs Triton on CUDA or its interpreter (tests/conftest.py)")


def _close(got, expected):
    """The same roundings, the sums in another order: within a unit in the last place, nearly all equal."""
    torch.testing.assert_close(got, expected, rtol=2**-7, atol=2**-7)
    assert (got == expected).float().mean() >= 0.95


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("per_column", [False, True])
@pytest.mark.parametrize(("rows", "k"), [(5, 256), (20, 384)])  # 256: K split in two (on the CPU's 2 "SMs")
@torch.no_grad()
def test_it_computes_the_matmul_and_second_step_it_replaces(bias, per_column, rows, k, monkeypatch):
    monkeypatch.setattr(arrivals, "_counters", {})
    outs, ranks = [64, 32, 32], [4, 2, 4]
    gen = torch.Generator().manual_seed(rows + k)
    weight = (torch.randn(sum(outs) + sum(ranks), k, generator=gen) * 0.05).to(DEVICE, torch.bfloat16)
    second = torch.zeros(sum(outs), sum(ranks))
    o = c = 0
    for out, rank in zip(outs, ranks):
        second[o:o + out, c:c + rank] = torch.randn(out, rank, generator=gen) * 0.05
        o, c = o + out, c + rank
    second = second.to(DEVICE, torch.bfloat16)
    b = torch.cat([torch.randn(sum(outs), generator=gen), torch.zeros(sum(ranks))]).to(DEVICE, torch.bfloat16)
    scale = (torch.rand(sum(outs), generator=gen) * 2).to(DEVICE, torch.bfloat16) if per_column else 2.0
    x = torch.randn(2, rows, k, generator=gen).to(DEVICE, torch.bfloat16)
    windows = group_step.rank_windows(outs, ranks, torch.device(DEVICE))
    assert windows[1] == 16 and windows[0].tolist() == [0, 4]  # q's ranks, then k's and v's (one 64-output tile)
    assert group_step.usable(x, weight, second, windows)
    got = group_step.group_step(x, weight, b if bias else None, second, scale, windows)
    expected = second_factors.reference(F.linear(x, weight, b if bias else None), second, scale)
    assert got.shape == expected.shape == (2, rows, sum(outs))
    _close(got, expected)
    counters = list(arrivals._counters.values())
    if k == 256:  # split in two: the tiles' last splits summed them and set their counters back to 0
        assert counters and not any(c.any() for c in counters)
    monkeypatch.setattr(arrivals, "COUNTERS", 0)  # no counters to be had: the path before, exactly
    before = group_step.group_step(x, weight, b if bias else None, second, scale, windows)
    assert torch.equal(before, expected) or k != 256
    assert not group_step._failed


def test_it_leaves_other_steps_to_the_path_before():
    x = torch.zeros(4, 128, dtype=torch.bfloat16, device=DEVICE)
    weight = torch.zeros(80, 128, dtype=torch.bfloat16, device=DEVICE)
    second = torch.zeros(64, 16, dtype=torch.bfloat16, device=DEVICE)
    windows = group_step.rank_windows([64], [16], torch.device(DEVICE))
    with torch.no_grad():
        assert group_step.usable(x, weight, second, windows)
        assert not group_step.usable(x[:, :64], weight[:, :64], second, windows)  # K not a multiple of 128
        assert not group_step.usable(x.float(), weight.float(), second.float(), windows)  # bf16 only
        assert not group_step.usable(torch.zeros(65, 128, dtype=torch.bfloat16, device=DEVICE), weight, second,
                                     windows)  # a prompt pass
    assert not group_step.usable(x, weight, second, windows)  # training
    assert group_step.rank_windows([32, 32], [40, 40], torch.device(DEVICE)) is None  # 80 ranks in one tile


def test_the_stacked_projections_run_each_group_in_one_launch_at_token_steps(monkeypatch):
    block = lora_policy(Block(128).to(torch.bfloat16)).to(DEVICE)
    torch.manual_seed(1)
    x, y = (torch.randn(4, 5, 128, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    stack = StackedProjections(block)
    with torch.no_grad(), stack.active(fused=False):
        expected = block(x, y)  # cuBLAS's matmul, then the second step unfused
    calls = collections.Counter()
    real = group_step.group_step
    monkeypatch.setattr(group_step, "group_step", lambda *a: calls.update(["group"]) or real(*a))
    with torch.no_grad(), stack.active(fused=True):
        got = block(x, y)
    for a, b in zip(got, expected, strict=True):
        _close(a, b)
    assert calls == {"group": 6}  # per group computed: q/k/v for x, y and x again, o once, gate/up for y and x
    monkeypatch.undo()
    with torch.no_grad(), stack.active(fused=True):
        compiled, nodes = compiled_calls(block, x, y)
    assert all(torch.equal(a, b) for a, b in zip(compiled, got, strict=True))
    counted = collections.Counter(nodes)
    assert counted["vlmrl.group_step.default"] == 6 and counted["<built-in function linear>"] == 0
