"""Liger's fused kernels in the loss pass (`vlmrl.engine.loss.kernels`, `train.rollout.kernels`): installed on the text
model's own modules, called for eager CUDA tensors only (never inside a compiled graph, never on the CPU), with
Qwen's casting; on CUDA, no farther from float32 than the modules' own bf16 forwards."""

from __future__ import annotations

import types

import pytest
import torch

from vlmrl.engine.loss import kernels as loss_kernels


def _model(path, dtype=torch.float32):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(path), dtype=dtype)


def _ids(model, rows=2, length=12):
    g = torch.Generator().manual_seed(0)
    return torch.randint(10, model.config.text_config.vocab_size, (rows, length), generator=g)


def _expected_counts(model) -> dict:
    layers = model.config.text_config.num_hidden_layers
    return {"rms_norm": 1 + 4 * layers, "silu_gate": layers, "rotary": layers}  # final norm; 2 + q_norm, k_norm


def test_installed_on_the_cpu_it_computes_what_the_modules_did(tiny_qwen3_vl):
    from transformers.models.qwen3_vl import modeling_qwen3_vl

    model = _model(tiny_qwen3_vl)
    ids = _ids(model)
    before = model(input_ids=ids).logits
    own_rope = modeling_qwen3_vl.apply_rotary_pos_emb
    try:
        assert loss_kernels.install(model) == _expected_counts(model)
        assert loss_kernels.install(model)["rms_norm"] == 0  # installed once, not wrapped twice
        assert torch.equal(model(input_ids=ids).logits, before)
    finally:
        loss_kernels.uninstall(model)
    assert modeling_qwen3_vl.apply_rotary_pos_emb is own_rope
    assert not any("forward" in vars(m) or hasattr(m, "vlmrl_liger") for m in model.modules())


class _Recorder:
    """Stands in for Liger's functions, computing what the modules compute, and records each call's arguments."""

    def __init__(self):
        self.calls: dict[str, list] = {"rms_norm": [], "silu_gate": [], "rotary": []}
        recorder = self

        class RMSNorm:
            @staticmethod
            def apply(x, weight, eps, offset, casting_mode, in_place):
                recorder.calls["rms_norm"].append((eps, offset, casting_mode, in_place))
                h = x.float()
                return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

        class SiLUMul:
            @staticmethod
            def apply(a, b):
                recorder.calls["silu_gate"].append(a.shape)
                return torch.nn.functional.silu(a) * b

        def rotary(q, k, cos, sin):
            recorder.calls["rotary"].append(q.shape)
            from transformers.models.qwen3_vl.modeling_qwen3_vl import rotate_half

            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

        self.rms_norm, self.silu_mul, self.rotary = RMSNorm, SiLUMul, rotary


@pytest.fixture
def liger(monkeypatch):
    """Liger's three entry points replaced by `_Recorder`, and every tensor taken for a CUDA one."""
    pytest.importorskip("liger_kernel", reason="liger-kernel is installed on Linux only (pyproject.toml)")
    import liger_kernel.ops
    import liger_kernel.ops.swiglu
    import liger_kernel.transformers.rope

    recorder = _Recorder()
    monkeypatch.setattr(liger_kernel.ops, "LigerRMSNormFunction", recorder.rms_norm)
    monkeypatch.setattr(liger_kernel.ops.swiglu, "LigerSiLUMulFunction", recorder.silu_mul)
    monkeypatch.setattr(liger_kernel.transformers.rope, "liger_rotary_pos_emb", recorder.rotary)
    monkeypatch.setattr(loss_kernels, "_on_cuda", lambda x: True)
    return recorder


def test_eager_calls_go_to_liger_with_qwens_casts_and_compiled_graphs_keep_the_modules_own(tiny_qwen3_vl, liger):
    model = _model(tiny_qwen3_vl)
    ids = _ids(model)
    before = model(input_ids=ids).logits
    counts = _expected_counts(model)
    try:
        loss_kernels.install(model)
        eager = model(input_ids=ids).logits
        assert {name: len(calls) for name, calls in liger.calls.items()} == counts  # one forward: each module once
        eps = model.config.text_config.rms_norm_eps
        assert set(liger.calls["rms_norm"]) == {(eps, 0.0, "llama", False)}  # Qwen's casts; dY kept
        torch.testing.assert_close(eager, before)
        for calls in liger.calls.values():
            calls.clear()
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="eager", fullgraph=False)(input_ids=ids).logits
        assert all(not calls for calls in liger.calls.values()), "a compiled graph called Liger's kernels"
        torch.testing.assert_close(compiled, before)
    finally:
        loss_kernels.uninstall(model)
        torch._dynamo.reset()


def test_gradients_flow_through_the_installed_modules(tiny_qwen3_vl, liger):
    model = _model(tiny_qwen3_vl)
    ids = _ids(model)
    model(input_ids=ids).logits.float().square().mean().backward()
    own = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    try:
        loss_kernels.install(model)
        model(input_ids=ids).logits.float().square().mean().backward()
    finally:
        loss_kernels.uninstall(model)
    assert liger.calls["rms_norm"] and liger.calls["silu_gate"] and liger.calls["rotary"]
    for name, grad in own.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, msg=name)


def test_what_enable_records(tiny_qwen3_vl, monkeypatch):
    model = _model(tiny_qwen3_vl)
    trainer = types.SimpleNamespace(model=model)
    assert loss_kernels.enable(trainer, wanted=False) == "the modules' own (kernels off)"
    if not torch.cuda.is_available():
        assert loss_kernels.enable(trainer).endswith("no CUDA device (Liger's kernels are Triton kernels for CUDA)")
    monkeypatch.setattr(loss_kernels, "liger_missing", lambda: None)
    other = types.SimpleNamespace(model=types.SimpleNamespace(config=types.SimpleNamespace(model_type="gemma3")))
    assert loss_kernels.enable(other) == ("the modules' own (Liger's kernels are installed for qwen3_vl, "
                                         "qwen2_5_vl, not gemma3)")
    try:
        c = _expected_counts(model)
        assert loss_kernels.enable(trainer) == (
            f"Liger's fused kernels outside compiled graphs: RMSNorm x{c['rms_norm']}, SiLU gate x{c['silu_gate']}, "
            f"RoPE in {c['rotary']} layers")
    finally:
        loss_kernels.uninstall(model)


def test_where_liger_runs_its_registry_keeps_quiet_about_backends_for_other_hardware(monkeypatch):
    """Liger 0.8's registry logs a WARNING per op for its CuTe DSL and Ascend backends on a plain CUDA build; once
    vlmrl finds Liger usable, only that logger's errors get through."""
    import logging

    pytest.importorskip("liger_kernel.ops")
    registry = logging.getLogger("liger_kernel.backends.registry")
    monkeypatch.setattr(registry, "level", logging.NOTSET)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert loss_kernels.liger_missing() is not None and registry.getEffectiveLevel() < logging.ERROR
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert loss_kernels.liger_missing() is None
    assert registry.level == logging.ERROR


def test_the_setting_is_on_by_default_and_left_out_of_the_fingerprint():
    from vlmrl.config.schema import Config

    config = Config()
    assert config.train.rollout.kernels is True
    fingerprint = config.fingerprint()
    config.train.rollout.kernels = False
    assert config.fingerprint() == fingerprint


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Liger's kernels run on CUDA")
def test_on_cuda_no_farther_from_float32_than_the_modules_own(tiny_qwen3_vl):
    model = _model(tiny_qwen3_vl, torch.float32).cuda()
    ids = _ids(model, rows=4, length=64).cuda()

    def run():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits.float()
        logits.log_softmax(-1).mean().backward()
        return logits.detach(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}

    reference, ref_grads = run()
    model.to(torch.bfloat16)
    own, own_grads = run()
    try:
        assert loss_kernels.install(model) == _expected_counts(model)
        fused, fused_grads = run()
    finally:
        loss_kernels.uninstall(model)
    own_error = (own - reference).abs().max().item()
    assert (fused - reference).abs().max().item() <= 1.5 * own_error + 1e-3
    for name, grad in ref_grads.items():
        own_rel = ((own_grads[name] - grad).norm() / grad.norm()).item()
        assert ((fused_grads[name] - grad).norm() / grad.norm()).item() <= 1.5 * own_rel + 1e-3, name
