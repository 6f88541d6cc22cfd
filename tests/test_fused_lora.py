"""A token step's LoRA branch as one kernel (`vlmrl.rollout.fused_lora`, `train.rollout_fused_lora`), on CUDA where
there is one and otherwise in Triton's CPU interpreter (tests/conftest.py turns it on): PEFT's numbers under
autocast, only for decode-sized calls of plain LoRA layers, and only inside the rollouts that ask for it."""

from __future__ import annotations

import pytest
import torch

from vlmrl.rollout import fused_lora
from vlmrl.rollout.decode_attention import interpreted

pytestmark = pytest.mark.skipif(not fused_lora.HAS_TRITON, reason="needs Triton (its CPU interpreter)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def interpreter():
    if DEVICE == "cpu" and not interpreted():
        pytest.skip("Triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it)")


def _reference(base, x, a, b, scaling):
    """What the kernel computes: the projection rounded to x's dtype, then base + scaling * projection Bᵀ,
    rounded once."""
    projection = (x.double() @ a.to(x.dtype).double().T).to(x.dtype)
    return (base.double() + scaling * (projection.double() @ b.to(x.dtype).double().T)).to(x.dtype)


@pytest.mark.parametrize("rows,features,outputs,rank", [(1, 64, 128, 16), (3, 200, 300, 8), (33, 130, 70, 20)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernel_adds_the_scaled_branch_to_the_base_output(rows, features, outputs, rank, dtype):
    torch.manual_seed(rows)
    x = torch.randn(rows, 1, features, device=DEVICE).to(dtype)
    base = torch.randn(rows, 1, outputs, device=DEVICE).to(dtype)
    a = torch.randn(rank, features, device=DEVICE) * 0.1  # float32, as PEFT stores them: read as x's dtype
    b = torch.randn(outputs, rank, device=DEVICE) * 0.1
    out = fused_lora.lora_branch(base, x, a, b, 2.0)
    assert out.shape == base.shape and out.dtype == dtype
    expected = _reference(base, x, a, b, 2.0)
    # Rounding steps of the dtype (Triton's interpreter truncates to bf16 where a GPU rounds to nearest), on the
    # sizes of the two terms rather than of their sum, which can cancel.
    step = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
    size = base.double().abs() + 2.0 * ((x.double().abs() @ a.double().abs().T) @ b.double().abs().T)
    assert ((out.double() - expected.double()).abs() <= 3 * step * size + 1e-6).all()


def _adapted(dropout: float = 0.0):
    from peft import LoraConfig, get_peft_model

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(96, 160)
            self.o = torch.nn.Linear(160, 64, bias=False)

        def forward(self, x):
            return self.o(torch.relu(self.q(x)))

    torch.manual_seed(0)
    model = get_peft_model(Block().to(DEVICE, torch.bfloat16),
                           LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules=["q", "o"]))
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.05)  # a trained-looking adapter
    return model


def _counting(monkeypatch):
    calls = []
    real = fused_lora.lora_branch
    monkeypatch.setattr(fused_lora, "lora_branch", lambda *a: calls.append(a[1].shape) or real(*a))
    return calls


def test_inside_the_block_decode_sized_calls_take_the_kernel_and_give_peft_s_numbers(monkeypatch):
    model = _adapted()
    calls = _counting(monkeypatch)
    x = torch.randn(4, 1, 96, device=DEVICE, dtype=torch.bfloat16)
    long = torch.randn(2, 40, 96, device=DEVICE, dtype=torch.bfloat16)  # 80 rows: a prompt pass
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16):
        expected, expected_long = model(x), model(long)
        with fused_lora.fused(model, on_cpu=True) as layers:
            out = model(x)
            assert len(calls) == 2  # both layers
            out_long = model(long)
            assert len(calls) == 2  # too many rows: PEFT's forward
        again = model(x)
    assert layers == 2 and fused_lora.count(model) == 2
    assert torch.equal(again, expected)  # PEFT's forward again after the block
    assert torch.equal(out_long, expected_long)
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out.float(), expected.float(), atol=0.05, rtol=2 ** -6)  # bf16 steps of ~1
    assert not any("forward" in vars(m) for m in model.modules())


def test_layers_it_does_not_compute_keep_peft_s_forward(monkeypatch):
    calls = _counting(monkeypatch)
    x = torch.randn(4, 1, 96, device=DEVICE, dtype=torch.bfloat16)
    with fused_lora.fused(_adapted(dropout=0.1), on_cpu=True) as layers:  # dropout: not a plain layer
        pass
    assert layers == 0
    model = _adapted()
    with fused_lora.fused(model, on_cpu=True), torch.autocast(DEVICE, dtype=torch.bfloat16):
        model(x.requires_grad_())  # training: a gradient is wanted
        with model.disable_adapter():
            model(x)
    assert calls == []
    with fused_lora.fused(model, on_cpu=False):  # the CPU without asking for the interpreter
        with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16):
            model(x)
    assert calls == [] or DEVICE == "cuda"


def test_a_compiled_step_traces_it_without_a_graph_break():
    model = _adapted()
    x = torch.randn(4, 1, 96, device=DEVICE, dtype=torch.bfloat16)
    torch._dynamo.reset()
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16), fused_lora.fused(model, on_cpu=True):
        eager = model(x)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(compiled, eager)


def test_rollouts_fuse_only_when_asked_and_the_setting_is_recorded(tiny_qwen3_vl):
    from types import SimpleNamespace

    from peft import LoraConfig, get_peft_model
    from transformers import GenerationConfig

    from tests.conftest import load_sdpa
    from vlmrl.bench.run import fast_options
    from vlmrl.config import Config, TrainConfig
    from vlmrl.rollout.fast import enable_fast_generation

    model, _ = load_sdpa(tiny_qwen3_vl)
    policy = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    seen = []

    def trainer():
        return SimpleNamespace(generation_config=GenerationConfig(), generation_kwargs={}, model=policy,
                               args=SimpleNamespace(bf16=False, fp16=False),
                               _generate_single_turn=lambda: seen.append(
                                   sum("forward" in vars(m) for m in policy.modules())))

    on = trainer()
    fast = enable_fast_generation(on, fused_lora=True)
    layers = 2 * model.config.text_config.num_hidden_layers
    assert fast.adapters.endswith(f"token steps run each LoRA branch as one kernel ({layers} layers, "
                                  "vlmrl.rollout.fused_lora)")
    on._generate_single_turn()
    off = trainer()
    assert "one kernel" not in enable_fast_generation(off).adapters
    off._generate_single_turn()
    assert seen == [layers, 0]
    assert not any("forward" in vars(m) for m in policy.modules())  # only inside the rollout
    merged = enable_fast_generation(trainer(), fused_lora=True, merge=True)  # merged: no branch to fuse
    assert "one kernel" not in merged.adapters
    assert TrainConfig().rollout_fused_lora is False  # opt-in
    assert fast_options("vlmrl-fused-lora")["fused_lora"] is True
    config = Config()
    before = config.fingerprint()
    config.train.rollout_fused_lora = True
    assert config.fingerprint() == before  # how a rollout is computed, not what the run produces
