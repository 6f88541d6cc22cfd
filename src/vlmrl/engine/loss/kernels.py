"""Liger's fused Triton kernels for the language model's RMSNorm, RoPE and SiLU gate, wherever the model runs
eagerly on CUDA: TRL's loss pass above all (forward, the checkpoint's recomputation, backward).

A profile of the seed recipe's loss pass (`benchmarks/step_profile.py`) spends more of its kernel time in elementwise
and reduction kernels and in copies and casts than in the matmuls that set its floor. Most of the elementwise work is three small functions that eager PyTorch runs as
chains of kernels, each reading and writing a whole activation: Qwen3-VL's RMSNorm (a float32 copy, a square, a
mean, a rsqrt, two multiplies and a cast back; 4 per layer with q_norm and k_norm), the rotary embedding (rotate
half, two multiplies and an add for q and for k), and the MLP's SiLU gate (SiLU, then a multiply), and each of
them again, in more kernels, in the backward. Liger Kernel (`liger-kernel`, maintained by LinkedIn, used by TRL's
`use_liger_kernel`) has each of them as one Triton kernel forward and one backward.

`enable` installs them on the text model's modules of a Qwen3-VL or Qwen2.5-VL model, instance by instance (no
class is patched). RoPE is the exception: the attention calls a module-level function, so that function is replaced
for the family, process-wide, until `uninstall`; another model of that family on CUDA (a reference model, say)
then runs Liger's RoPE too, which computes the same function. Each replacement dispatches at every call: Liger's
kernel for a CUDA tensor outside `torch.compile`, the module's own forward otherwise. So the compiled rollout
decode step, whose graph inductor already fuses, traces the original code (and its CUDA graph is unchanged), a
CPU run computes what it always did, and the loss pass, which runs eagerly, gets the fused kernels.

Numerics: the same functions, computed in float32 inside each kernel and rounded once where eager PyTorch rounds
between steps (RMSNorm in Liger's "llama" casting mode is Qwen's order of casts; the SiLU gate rounds SiLU's output
to bf16 in eager PyTorch and not in Liger). Differences are at the bf16 rounding step; a GPU test
(`tests/test_loss_kernels.py`, skipped without CUDA) checks that outputs and gradients are no farther from float32
than the modules' own bf16 forwards.
Liger's RMSNorm may write its input gradient over its output gradient (`in_place`); it is off here, since a norm's
output gradient is not always its own (a residual stream can share it).
With `train.rollout.kernels` off the modules keep their own forwards. What the kernels are worth:
benchmarks/NOTES.md ("Liger's kernels in the loss pass").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

# the model types whose text model is built from the modules `install` knows (RMSNorm, MLP with a SiLU gate,
# and the module-level `apply_rotary_pos_emb` the attention calls)
FAMILIES = {"qwen3_vl": "transformers.models.qwen3_vl.modeling_qwen3_vl",
            "qwen2_5_vl": "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl"}


def liger_missing() -> str | None:
    """Why Liger's kernels cannot run here; None when they can."""
    if not torch.cuda.is_available():
        return "no CUDA device (Liger's kernels are Triton kernels for CUDA)"
    try:
        import liger_kernel.ops  # noqa: F401
    except (ImportError, AttributeError, RuntimeError, OSError) as exc:  # not installed, or not for this torch/triton
        return f"liger-kernel cannot be imported ({type(exc).__name__}: {exc})"
    # Liger's op registry warns, at each op's first call, that its optional backends (CuTe DSL, Ascend) cannot be
    # imported: two lines of noise in every CUDA run's log. It records them (`_DISCOVERY_FAILURES`) either way.
    logging.getLogger("liger_kernel.backends.registry").setLevel(logging.ERROR)
    return None


def _on_cuda(x: torch.Tensor) -> bool:
    return x.is_cuda


def _eager_cuda(x: torch.Tensor) -> bool:
    """Liger's kernel for this call: a CUDA tensor, and not while torch.compile traces (dynamo evaluates this to
    False there, so a compiled graph holds the module's own code)."""
    return _on_cuda(x) and not torch.compiler.is_compiling()


def _rms_norm(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    from liger_kernel.ops import LigerRMSNormFunction

    own = module.forward

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if not _eager_cuda(hidden_states):
            return own(hidden_states)
        return LigerRMSNormFunction.apply(hidden_states, module.weight, module.variance_epsilon, 0.0, "llama", False)

    return forward


def _silu_gate(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    own = module.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not _eager_cuda(x):
            return own(x)
        return module.down_proj(LigerSiLUMulFunction.apply(module.gate_proj(x), module.up_proj(x)))

    return forward


def _rotary(own: Callable) -> Callable:
    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if args or kwargs or not _eager_cuda(q) or q.dtype != k.dtype:
            return own(q, k, cos, sin, *args, **kwargs)
        # looked up per call: this module-level function can outlive the test or model that installed it
        from liger_kernel.transformers import rope

        return rope.liger_rotary_pos_emb(q, k, cos, sin)

    apply_rotary_pos_emb.vlmrl_liger = own  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def text_model(model: Any) -> tuple[str, Any] | None:
    """(model type, its language model: the module with `layers` and `norm`) for a family in FAMILIES."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        return None
    for module in model.modules():
        if type(module).__name__.endswith("TextModel") and hasattr(module, "layers") and hasattr(module, "norm"):
            return model_type, module
    return None


def install(model: Any) -> dict[str, int]:
    """Put the dispatching forwards on `model`'s text modules; how many of each were installed."""
    import importlib

    found = text_model(model)
    if found is None:
        return {}
    model_type, text = found
    norms = [text.norm]
    for layer in text.layers:
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [m for m in (getattr(layer.self_attn, "q_norm", None), getattr(layer.self_attn, "k_norm", None))
                  if m is not None]
    gates = [layer.mlp for layer in text.layers
             if getattr(getattr(layer.mlp, "config", None), "hidden_act", None) in ("silu", "swish")]
    counts = {
        "rms_norm": sum(_replace(m, _rms_norm) for m in norms
                        if type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon")),
        "silu_gate": sum(_replace(m, _silu_gate) for m in gates),
    }
    modeling = importlib.import_module(FAMILIES[model_type])
    rope = modeling.apply_rotary_pos_emb
    if not hasattr(rope, "vlmrl_liger"):
        modeling.apply_rotary_pos_emb = _rotary(rope)
    counts["rotary"] = len(text.layers)
    return counts


def _replace(module: torch.nn.Module, dispatching: Callable[[torch.nn.Module], Callable]) -> bool:
    """Give `module` the forward `dispatching` makes of it, unless it has one already; whether it was given."""
    if hasattr(module, "vlmrl_liger"):
        return False
    module.forward = dispatching(module)
    module.vlmrl_liger = True
    return True


def uninstall(model: Any) -> None:
    """The modules' own forwards back, and the family's module-level rotary function."""
    import importlib

    for module in model.modules():
        if getattr(module, "vlmrl_liger", False):
            del module.forward
            del module.vlmrl_liger
    found = text_model(model)
    if found is not None:
        modeling = importlib.import_module(FAMILIES[found[0]])
        modeling.apply_rotary_pos_emb = getattr(modeling.apply_rotary_pos_emb, "vlmrl_liger",
                                                modeling.apply_rotary_pos_emb)


def enable(trainer: Any, *, wanted: bool = True) -> str:
    """Liger's kernels on `trainer.model`'s text modules where they apply; what was done, for the record."""
    if not wanted:
        return "the modules' own (kernels off)"
    missing = liger_missing()
    if missing:
        return f"the modules' own: {missing}"
    model = trainer.model
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    counts = install(base)
    if not counts:
        model_type = getattr(getattr(base, "config", None), "model_type", None)
        return f"the modules' own (Liger's kernels are installed for {', '.join(FAMILIES)}, not {model_type})"
    log.info("loss kernels: Liger's RMSNorm (%d), SiLU gate (%d), RoPE (%d layers) outside compiled graphs",
             counts["rms_norm"], counts["silu_gate"], counts["rotary"])
    return (f"Liger's fused kernels outside compiled graphs: RMSNorm x{counts['rms_norm']}, SiLU gate "
            f"x{counts['silu_gate']}, RoPE in {counts['rotary']} layers")


__all__ = ["FAMILIES", "enable", "install", "liger_missing", "text_model", "uninstall"]
