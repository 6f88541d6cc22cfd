"""A 4-bit base's LoRA branch folded into the nf4 token step (`vlmrl.engine.experimental.nf4_lora`, an experiment
that lost on an H200: docs/benchmarks.md): within one
bf16/fp16 unit of PEFT's eager forward over bitsandbytes' dequantize-then-matmul, in Triton's CPU interpreter
(tests/conftest.py turns it on); routed for token steps only, with every other forward left to PEFT; the bench
variant's record; one node in a compiled step; the recorded fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.test_nf4 import BF, DEVICE, _layer, _model, _quantized, _rollout_trainer, _units, compiled_calls
from vlmrl.engine.experimental import nf4_lora
from vlmrl.engine.rollout import nf4

peft_bnb = pytest.importorskip("peft.tuners.lora.bnb")
pytestmark = pytest.mark.skipif(not nf4.HAS_TRITON or not (DEVICE == "cuda" or nf4.interpreted()),
                                reason="needs Triton on CUDA or its interpreter (tests/conftest.py)")


def _eager(x, packed, qs, bias, xa, second, scale):
    """PEFT's eager forward over bitsandbytes' dequantize + matmul: base, then + (xa @ B.T) * scale, each step
    rounded to x's dtype."""
    base = F.linear(x, BF.dequantize_4bit(packed, qs).to(x.dtype), bias)
    return base + F.linear(xa, second) * scale, base


@pytest.mark.parametrize(("rows", "bias", "split"), [(1, False, 1), (5, True, 2), (16, False, 1), (33, True, 2)])
@pytest.mark.parametrize("rank", [8, 12])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_it_is_peft_over_bitsandbytes_dequantize_then_matmul(dtype, rank, rows, bias, split, launches):
    packed, qs = _quantized(192, 256, weight_dtype=dtype)
    torch.manual_seed(rank + rows)
    x = torch.randn(rows, 256).to(DEVICE, dtype)
    b = torch.randn(192).to(DEVICE, dtype) if bias else None
    xa = (torch.randn(rows, rank) * 0.5).to(DEVICE, dtype)
    second = (torch.randn(192, rank) * 0.3).to(DEVICE, dtype)
    config = nf4.interpreter_config(256, 64)[:-1] + [split]  # one split: the tiles still write fp32 shares
    got = nf4_lora.nf4_lora_matmul(x, packed, b, xa, second, 2.0, quant_state=qs, config=config)
    expected, base = _eager(x, packed, qs, b, xa, second, 2.0)
    # the unit is taken at the larger of the two terms too: the base may be a unit from cuBLAS's (summation order),
    # which is a unit of the base, not of a sum that cancels
    terms = torch.maximum(base.float().abs(), (F.linear(xa, second) * 2.0).float().abs())
    scale = (x.float().abs() @ BF.dequantize_4bit(packed, qs).float().abs().T
             + (0 if b is None else b.float().abs()))
    units = _units(got, expected, torch.maximum(scale, terms * 2 ** 12))
    assert got.dtype == dtype and got.shape == (rows, 192)
    assert units.max() <= 1, f"{float(units.max()):.2f} units apart"
    assert (got == expected).float().mean() >= 0.9
    assert launches == [rows] and not nf4._failed
    # the branch is really in it: without it the outputs differ by far more than a unit
    assert _units(nf4.nf4_matmul(x, packed, b, quant_state=qs), expected, scale).max() > 4



def _rows_of_calls(monkeypatch, name):
    """The rows of each call to `nf4_lora.<name>` from now on (the call still runs)."""
    rows, real = [], getattr(nf4_lora, name)
    monkeypatch.setattr(nf4_lora, name, lambda *a, **kw: rows.append(a[0].shape[0]) or real(*a, **kw))
    return rows

def _peft(base, rank=8, alpha=16, **options):
    config = peft_bnb.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, init_lora_weights=False, **options)
    torch.manual_seed(1)
    return peft_bnb.Linear4bit(base, "default", config=config, r=rank, lora_alpha=alpha, lora_dropout=0.0,
                               init_lora_weights=False, **options)


def test_nf4_lora_decode_routes_token_steps_and_leaves_the_rest_to_peft(launches, monkeypatch):
    ops = _rows_of_calls(monkeypatch, "nf4_lora_matmul")
    model = _model(_peft(_layer(256, 192)), torch.nn.ReLU(), _peft(_layer(192, 128, bias=False), rank=4))
    step = torch.randn(4, 1, 256).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        expected = model(step)  # PEFT over bitsandbytes
        with nf4.nf4_decode(model), nf4_lora.nf4_lora_decode(model) as counts:
            got = model(step)
            assert ops == [4, 4] and launches == [4, 4]
            model(torch.randn(2, 40, 256).to(DEVICE, torch.bfloat16))  # a prompt pass: PEFT, bitsandbytes
            model(step[:1])  # one row
            model[0].enable_adapters(False)  # PEFT's switch: its own forward (the base alone, on the kernel)
            model(step)
            model[0].enable_adapters(True)
            assert ops == [4, 4, 4] and launches == [4, 4, 4, 4]  # the second layer folded still
    with nf4.nf4_decode(model), nf4_lora.nf4_lora_decode(model):
        model(step.clone().requires_grad_())  # gradients on: the loss pass
    assert counts == (2, 2) and ops == [4, 4, 4] and launches == [4, 4, 4, 4]
    assert all("forward" not in layer.__dict__ for layer in model)
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=4e-3)  # two layers, each within a unit


def test_only_plain_lora_in_the_activations_dtype_is_folded(launches):
    dropout = _peft(_layer(256, 64))
    dropout.lora_dropout["default"] = torch.nn.Dropout(0.1)
    assert nf4_lora.unfused_reason(dropout) == "LoRA dropout (each projection draws its own mask)"
    fp32 = _peft(_layer(64, 128))
    fp32.lora_A["default"].float(), fp32.lora_B["default"].float()  # float32 adapters, no autocast: PEFT casts x
    model = _model(dropout, torch.nn.ReLU(), fp32)
    x = torch.randn(3, 256).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        expected = model(x)
        with nf4_lora.nf4_lora_decode(model) as counts:
            got = model(x)
    assert counts == (1, 2) and launches == []  # the fp32 branch ran PEFT's forward, as did the dropout layer
    assert torch.equal(got, expected)


def test_the_bench_variant_folds_the_branch_and_says_so(launches, monkeypatch):
    from vlmrl.engine.experimental.rollout import apply
    from vlmrl.engine.rollout.fast import enable_fast_generation

    monkeypatch.setattr(nf4, "gpu_reason", lambda device: None)
    ops = _rows_of_calls(monkeypatch, "nf4_lora_matmul")
    model = _model(_peft(_layer(256, 192)))
    trainer = _rollout_trainer(model, torch.randn(4, 1, 256).to(DEVICE, torch.bfloat16))
    fast = enable_fast_generation(trainer)  # the product: the branch in PEFT's forward
    trainer._generate_single_turn()
    assert ops == [] and launches == [2, 4]  # the probe, the base's token step
    folded = apply(trainer, fast, nf4_kernel="folded")  # the bench path vlmrl-nf4-folded
    assert folded.weights == ("vlmrl nf4 kernel for token steps of 2-64 rows, the LoRA branch's second factor and "
                              "sum in its last pass for 1 of 1 adapted layers (experimental nf4_lora), bitsandbytes "
                              "Linear4bit otherwise")
    assert ops == [2] and launches == [2, 4, 2]  # its probe
    trainer._generate_single_turn()
    assert ops == [2, 4] and launches == [2, 4, 2, 4]
    assert "forward" in model[0].__dict__ and "forward" in model[0].base_layer.__dict__
    trainer.vlmrl_nf4_decode.close()
    assert "forward" not in model[0].__dict__ and "forward" not in model[0].base_layer.__dict__


def test_a_branch_that_cannot_fold_stays_in_peft_with_the_reason(launches, monkeypatch):
    from vlmrl.engine.experimental.rollout import apply
    from vlmrl.engine.rollout.fast import enable_fast_generation

    monkeypatch.setattr(nf4, "gpu_reason", lambda device: None)
    real = nf4.launch
    monkeypatch.setattr(nf4, "launch", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("out of resources"))
                        if kw.get("lora") is not None else real(*a, **kw))
    model = _model(_peft(_layer(256, 192)))
    trainer = _rollout_trainer(model, None)
    fast = apply(trainer, enable_fast_generation(trainer), nf4_kernel="folded")
    assert fast.weights == ("vlmrl nf4 kernel for token steps of 2-64 rows, the LoRA branch in PEFT's forward "
                            "(folding it asked for, not done: RuntimeError: out of resources), bitsandbytes "
                            "Linear4bit otherwise")
    assert "forward" not in model[0].__dict__ and "forward" in model[0].base_layer.__dict__
    trainer.vlmrl_nf4_decode.close()


def test_a_compiled_token_step_calls_it_as_one_node():
    layer = _peft(_layer(256, 64))
    x = torch.randn(3, 256).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        expected = layer(x)
        with nf4.nf4_decode(layer), nf4_lora.nf4_lora_decode(layer):
            got, nodes = compiled_calls(layer, x)
    assert [n for n in nodes if "nf4" in n] == ["vlmrl.nf4_lora_matmul.default"]
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=2e-3)


def test_a_kernel_that_cannot_run_falls_back_to_the_same_sum(monkeypatch, caplog):
    monkeypatch.setattr(nf4, "_failed", {})
    monkeypatch.setattr(nf4, "launch", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("no PTX for this GPU")))
    packed, qs = _quantized(64, 256)
    x = torch.randn(3, 256).to(DEVICE, torch.bfloat16)
    xa, second = torch.randn(3, 8).to(DEVICE, torch.bfloat16), torch.randn(64, 8).to(DEVICE, torch.bfloat16)
    got = nf4_lora.nf4_lora_matmul(x, packed, None, xa, second, 0.5, quant_state=qs)
    assert torch.equal(got, _eager(x, packed, qs, None, xa, second, 0.5)[0])
    assert list(nf4._failed.values()) == ["RuntimeError: no PTX for this GPU"]
    assert sum("nf4 matmul kernel cannot run" in r.message for r in caplog.records) == 1


# The second form: the branch's factors as PEFT runs them, only its scale and sum in the split pass ("summed").

@pytest.mark.parametrize(("rows", "bias", "split"), [(1, False, 1), (5, True, 2), (33, True, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_summed_form_is_bitwise_peft_eager_sum_over_the_kernel_base(dtype, rows, bias, split, launches):
    """Given the same base output (the product's kernel) and the same branch, the split pass's scale and sum make
    PEFT's roundings: bitwise its eager `base + branch * scale`."""
    packed, qs = _quantized(192, 256, weight_dtype=dtype)
    torch.manual_seed(rows)
    x = torch.randn(rows, 256).to(DEVICE, dtype)
    b = torch.randn(192).to(DEVICE, dtype) if bias else None
    branch = F.linear((torch.randn(rows, 8) * 0.5).to(DEVICE, dtype), (torch.randn(192, 8) * 0.3).to(DEVICE, dtype))
    config = nf4.interpreter_config(256, 64)[:-1] + [split]
    got = nf4_lora.nf4_summed_matmul(x, packed, b, branch, 0.7, quant_state=qs, config=config)
    base = nf4.nf4_matmul(x, packed, b, quant_state=qs, config=config)
    assert got.dtype == dtype and got.shape == (rows, 192)
    assert torch.equal(got, base + branch * 0.7)
    assert not torch.equal(got, base)  # the branch is in it
    assert launches == [rows, rows] and not nf4._failed
    # and within a unit of PEFT over bitsandbytes' dequantize + matmul, as the product's kernel is
    expected = F.linear(x, BF.dequantize_4bit(packed, qs).to(dtype), b) + branch * 0.7
    terms = torch.maximum(base.float().abs(), (branch * 0.7).float().abs())
    scale = x.float().abs() @ BF.dequantize_4bit(packed, qs).float().abs().T + (0 if b is None else b.float().abs())
    assert _units(got, expected, torch.maximum(scale, terms * 2 ** 12)).max() <= 1


def test_the_summed_bench_variant_routes_token_steps_and_says_so(launches, monkeypatch):
    from vlmrl.engine.experimental.rollout import apply
    from vlmrl.engine.rollout.fast import enable_fast_generation

    monkeypatch.setattr(nf4, "gpu_reason", lambda device: None)
    ops = _rows_of_calls(monkeypatch, "nf4_summed_matmul")
    model = _model(_peft(_layer(256, 192)))
    step = torch.randn(4, 1, 256).to(DEVICE, torch.bfloat16)
    trainer = _rollout_trainer(model, step)
    with torch.no_grad():
        expected = model(step)  # PEFT over bitsandbytes
    fast = apply(trainer, enable_fast_generation(trainer), nf4_kernel="summed")  # the bench path vlmrl-nf4-summed
    assert fast.weights == ("vlmrl nf4 kernel for token steps of 2-64 rows, the LoRA branch's scale and sum in its "
                            "last pass for 1 of 1 adapted layers (experimental nf4_lora), bitsandbytes Linear4bit "
                            "otherwise")
    assert ops == [2]  # its probe
    with torch.no_grad():
        got = model(step)
        model(torch.randn(2, 40, 256).to(DEVICE, torch.bfloat16))  # a prompt pass: PEFT over bitsandbytes
    assert ops == [2, 4]
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=4e-3)
    trainer.vlmrl_nf4_decode.close()
    assert "forward" not in model[0].__dict__ and "forward" not in model[0].base_layer.__dict__


def test_a_compiled_token_step_calls_the_summed_form_as_one_node():
    layer = _peft(_layer(256, 64))
    x = torch.randn(3, 256).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        expected = layer(x)
        with nf4.nf4_decode(layer), nf4_lora.nf4_lora_decode(layer, summed=True):
            got, nodes = compiled_calls(layer, x)
    assert [n for n in nodes if "nf4" in n] == ["vlmrl.nf4_summed_matmul.default"]
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=2e-3)


def test_a_branch_of_the_wrong_shape_or_dtype_is_refused():
    """The split pass reads one branch value per output: another shape would read past it on a GPU."""
    packed, qs = _quantized(64, 256)
    x = torch.randn(3, 256).to(DEVICE, torch.bfloat16)
    with pytest.raises(ValueError, match=r"\(3, 32\) in torch.bfloat16; the kernel takes \(3, 64\)"):
        nf4_lora.nf4_summed_matmul(x, packed, None, torch.zeros(3, 32).to(DEVICE, torch.bfloat16), 1.0, quant_state=qs)
    with pytest.raises(ValueError, match="in torch.float32; the kernel takes"):
        nf4_lora.nf4_summed_matmul(x, packed, None, torch.zeros(3, 64).to(DEVICE), 1.0, quant_state=qs)
