"""A 4-bit projection's token step with its LoRA branch in the nf4 kernel (`vlmrl.engine.rollout.nf4_branch`): the
unfused arithmetic (the kernel's base output, then `second_factors.added` over x @ firstᵀ) at every split shape, in
Triton's CPU interpreter (tests/conftest.py) or on a CUDA GPU; the split counters left at zero; and the unfused path
where the K splits cannot be summed in the kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import nf4_quantized
from vlmrl.engine.rollout import arrivals, nf4, nf4_branch, second_factors

pytest.importorskip("bitsandbytes")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not nf4.HAS_TRITON or not (DEVICE == "cuda" or nf4.interpreted()),
                                reason="needs Triton on CUDA or its interpreter (tests/conftest.py)")


def _inputs(rows, k, rank, bias, seed=0):
    packed, qs = nf4_quantized(96, k, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, torch.bfloat16)
    first = (torch.randn(rank, k, generator=gen) * 0.05).to(DEVICE, torch.bfloat16)
    second = (torch.randn(96, rank, generator=gen) * 0.05).to(DEVICE, torch.bfloat16)
    b = torch.randn(96, generator=gen).to(DEVICE, torch.bfloat16) if bias else None
    return x, packed, qs, b, first, second


def _branch(x, packed, qs, bias, first, second, scale, config):
    """The op with tile settings `config` (the product's launch chooses them by shape)."""
    def op(*args):
        return nf4_branch._branch(*args[:8], first, second, scale, *args[8:11], config)

    return nf4.call(op, x, packed, bias, qs, None)


def _unfused(x, packed, qs, bias, first, second, scale, config):
    base = nf4.nf4_matmul(x, packed, bias, quant_state=qs, config=config)
    return second_factors.added(base, F.linear(x, first), second, scale)


@pytest.mark.parametrize(("rows", "k", "config"), [
    (3, 256, [64, 64, 4, 1, 1]),  # no split: the tile writes its output
    (3, 256, [64, 64, 4, 1, 3]),  # 2 splits (of 3 asked): the last to arrive sums both kinds of share
    (5, 320, [16, 64, 4, 1, 2]),  # a partial last split, 6 tiles
    (20, 512, [32, 128, 4, 1, 4]),
])
@pytest.mark.parametrize("rank", [4, 20])  # 20: 32 rank rows a program, 12 of them masked
@pytest.mark.parametrize("bias", [False, True])
def test_it_computes_the_unfused_branch_over_the_kernels_base(rows, k, config, rank, bias, monkeypatch):
    monkeypatch.setattr(arrivals, "_counters", {})
    args = _inputs(rows, k, rank, bias, seed=k + rank)
    got = _branch(*args, 2.0, config)
    expected = _unfused(*args, 2.0, config)
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    # the base's sums are the kernel's own; the first factors' are summed in the kernel's order, not F.linear's
    torch.testing.assert_close(got, expected, rtol=2**-7, atol=2**-7)
    assert (got == expected).float().mean() >= 0.95
    if config[-1] > 1:
        counters = list(arrivals._counters.values())  # (keyed by the device the launch ran on)
        assert counters and not any(c.any() for c in counters)  # every counter back at 0 for the next launch


def test_where_the_splits_cannot_be_summed_in_the_kernel_the_branch_is_computed_apart(monkeypatch):
    monkeypatch.setattr(arrivals, "COUNTERS", 0)  # no counters to be had
    args = _inputs(3, 256, 4, True)
    assert torch.equal(_branch(*args, 0.5, [64, 64, 4, 1, 3]), _unfused(*args, 0.5, [64, 64, 4, 1, 3]))
    assert not nf4_branch._failed  # the kernel did not fail: it had nothing to sum the splits with


@torch.no_grad()
def test_it_takes_token_steps_of_bf16_only():
    x = torch.zeros(4, 64, dtype=torch.bfloat16, device=DEVICE)
    second = torch.zeros(96, 16, dtype=torch.bfloat16, device=DEVICE)
    assert nf4_branch.usable(x, second)
    assert not nf4_branch.usable(x.half(), second.half())  # fp16: the second step's kernel is bf16 only
    assert not nf4_branch.usable(x[:1], second)  # one row: bitsandbytes' own gemv
    assert not nf4_branch.usable(torch.zeros(65, 64, dtype=torch.bfloat16, device=DEVICE), second)  # a prompt pass
    assert not nf4_branch.usable(x, torch.zeros(96, 65, dtype=torch.bfloat16, device=DEVICE))  # rank over 64
    with torch.enable_grad():
        assert not nf4_branch.usable(x, second)  # training
