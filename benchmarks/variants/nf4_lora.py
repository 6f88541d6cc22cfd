"""A 4-bit base's LoRA branch folded into the nf4 token step: the second factor, the scale and the sum run in the
product kernel's last pass. An experiment that lost: on an H200 it made the 4-bit step 1.18x slower (26.2 against
22.2 s) and the 36 x 7 projections with their branches 1.17x slower (15.0 against 12.8 ms at 32 rows) than PEFT's
own ops after the product's kernel (benchmarks/NOTES.md, "Folding the LoRA branch into the nf4 kernel").

A 4-bit base cannot take the adapter merged in without re-quantizing, so at a rollout token step PEFT's LoRA layer
runs, per adapted projection: the base (`Linear4bit`, on the product's kernel), a clone of its output, the first
factor (x A), the second (B), the scale and the sum. Here the first factor stays a matmul (as PEFT computes it), and
the kernel's split sum (`vlmrl.engine.rollout.nf4_triton.nf4_splits` with its LoRA epilogue) does the rest: each
output adds `round(round(xa @ B.T) * scale)` to its rounded base output and rounds, the roundings PEFT's eager
forward makes. The tiles then always write fp32 shares, and the epilogue reads the second factor a column of rank
values at a time per output; both cost more than the launches they save.

A second form, which tied on an H200 (a few per cent faster per projection set, not end to end:
benchmarks/NOTES.md): **the sum in the split pass** (`summed`). The branch runs as PEFT computes it, both
factors as matmuls, and only the scale and the sum move into the split pass, which then reads one value per output
(the branch's output) where the fold read a column of rank values. It saves the element-wise kernel a compiled
token step runs per adapted projection (252 for Qwen3-VL-8B) and adds nothing the product's kernel does not
already do at the 8B shapes, where every projection splits K at 16-32 rows. The roundings are PEFT's, so given the
same base output and branch it is bitwise PEFT's eager sum.

Public: `nf4_lora_matmul` and `nf4_summed_matmul` (the custom ops' callers); `nf4_lora_decode(model, summed=...)`,
which routes the token steps of PEFT LoRA layers over routable `Linear4bit` bases through one of them while active,
beside `vlmrl.engine.rollout.nf4.nf4_decode`; `adapted_layers(model)`, `unfused_reason(layer)` and `probe(model,
summed=...)` (a launch), for the caller to decide and record. `rollout.apply(..., nf4_kernel="folded" | "summed")`
turns them on (bench paths `vlmrl-nf4-folded`, `vlmrl-nf4-summed`). The kernel's launch with the branch in its split
sum: `nf4_launch`.
Limits: plain LoRA (one active adapter, no variant, dropout or bias of its own; `lora_layers.plain_reason`), the
branch computed in the activations' dtype (bf16/fp16: under an autocast of that dtype or with adapters stored in
it), rows and devices as `nf4` routes them; anything else runs PEFT's own forward.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from vlmrl.engine.rollout import nf4

from . import nf4_launch

log = logging.getLogger(__name__)


def nf4_lora_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, xa: torch.Tensor,
                    second: torch.Tensor, scale: float, *, quant_state: Any = None,
                    config: list[int] | None = None) -> torch.Tensor:
    """`base + scale * (xa @ second.T)` rounded as PEFT rounds it, `base` = `nf4_matmul(x, weight, bias)`; `xa`
    [..., rank] the first factor's output and `second` [out, rank] the second factor, both in x's dtype."""
    lora = (xa.reshape(-1, xa.shape[-1]).contiguous(), second.contiguous(), float(scale))
    return nf4_launch.call(_nf4_lora_matmul, x, weight, bias, quant_state, config, lora)


@torch.library.custom_op("vlmrl::nf4_lora_matmul", mutates_args=())
def _nf4_lora_matmul(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code2: torch.Tensor | None,
                     absmax2: torch.Tensor | None, offset: torch.Tensor | None, lut: torch.Tensor,
                     bias: torch.Tensor | None, xa: torch.Tensor, second: torch.Tensor, scale: float, blocksize: int,
                     blocksize2: int, rounding: int, config: list[int]) -> torch.Tensor:
    return nf4_launch.kernel_or_reference((x, packed, absmax, code2, absmax2, offset, lut, bias, blocksize,
                                           blocksize2, rounding, config), design="lora", lora=(xa, second, scale))


@_nf4_lora_matmul.register_fake
def _output_like(x: torch.Tensor, packed: torch.Tensor, *args: Any) -> torch.Tensor:
    return nf4.output_like(x, packed)


def nf4_summed_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, branch: torch.Tensor,
                      scale: float, *, quant_state: Any = None, config: list[int] | None = None) -> torch.Tensor:
    """`base + scale * branch` rounded as PEFT rounds it, `base` = `nf4_matmul(x, weight, bias)`; `branch`
    [..., out] the LoRA branch's output (its second factor applied to its first's), in x's dtype."""
    n = (quant_state if quant_state is not None else weight.quant_state).shape[0]
    if branch.shape != (*x.shape[:-1], n) or branch.dtype != x.dtype:
        raise ValueError(f"the branch's output is {tuple(branch.shape)} in {branch.dtype}; the kernel takes "
                         f"{(*x.shape[:-1], n)} in {x.dtype}")
    summed = (branch.reshape(-1, n).contiguous(), float(scale))
    return nf4_launch.call(_nf4_summed_matmul, x, weight, bias, quant_state, config, summed)


@torch.library.custom_op("vlmrl::nf4_summed_matmul", mutates_args=())
def _nf4_summed_matmul(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code2: torch.Tensor | None,
                       absmax2: torch.Tensor | None, offset: torch.Tensor | None, lut: torch.Tensor,
                       bias: torch.Tensor | None, branch: torch.Tensor, scale: float, blocksize: int, blocksize2: int,
                       rounding: int, config: list[int]) -> torch.Tensor:
    return nf4_launch.kernel_or_reference((x, packed, absmax, code2, absmax2, offset, lut, bias, blocksize,
                                           blocksize2, rounding, config), design="summed", lora=(branch, None, scale))


@_nf4_summed_matmul.register_fake
def _summed_output_like(x: torch.Tensor, packed: torch.Tensor, *args: Any) -> torch.Tensor:
    return nf4.output_like(x, packed)


def unfused_reason(layer: Any) -> str | None:
    """Why `nf4_lora_decode` leaves PEFT LoRA layer `layer` to its own forward; None when it routes it."""
    from vlmrl.engine.lora_layers import plain_reason

    base = layer.get_base_layer()
    if not nf4.is_linear4bit(base):
        return f"a {type(base).__name__} base layer, not bitsandbytes' Linear4bit"
    return nf4.layer_reason(base) or plain_reason(layer)


def adapted_layers(model: torch.nn.Module) -> list[Any]:
    """The model's PEFT LoRA layers over a bitsandbytes `Linear4bit`."""
    from vlmrl.engine.lora_layers import lora_layers

    return [layer for layer in lora_layers(model) if nf4.is_linear4bit(layer.get_base_layer())]


def probe(model: torch.nn.Module, summed: bool = False) -> str | None:
    """Launch `nf4_lora_matmul` (`summed`: `nf4_summed_matmul`) once on the first layer `nf4_lora_decode` would
    route, at `nf4.MIN_ROWS` zero rows; why it cannot run there (a Triton build or launch error; it would then fall
    back to dequantize + matmul, slower than bitsandbytes), or None."""
    layer = next((m for m in adapted_layers(model) if unfused_reason(m) is None), None)
    if layer is None:
        return "no plain LoRA layer over a Linear4bit the kernel takes"
    base, name = layer.get_base_layer(), next(iter(layer.lora_A.keys()))
    dtype = base.compute_dtype if base.compute_dtype in nf4.DTYPES else torch.bfloat16
    second = layer.lora_B[name].weight
    x = torch.zeros(nf4.MIN_ROWS, base.in_features, device=base.weight.device, dtype=dtype)
    with torch.no_grad():
        if summed:
            nf4_summed_matmul(x, base.weight, base.bias, x.new_zeros(nf4.MIN_ROWS, base.out_features), 1.0,
                              quant_state=base.weight.quant_state)
        else:
            nf4_lora_matmul(x, base.weight, base.bias, x.new_zeros(nf4.MIN_ROWS, second.shape[1]),
                            second.to(dtype), 1.0, quant_state=base.weight.quant_state)
    return nf4_launch.failure(x, "summed" if summed else "lora")


@contextlib.contextmanager
def nf4_lora_decode(model: torch.nn.Module, max_rows: int = nf4.MAX_ROWS, min_rows: int = nf4.MIN_ROWS,
                    summed: bool = False) -> Iterator[tuple[int, int]]:
    """While active, forwards of the model's PEFT LoRA layers over routable `Linear4bit` bases with `min_rows` to
    `max_rows` rows, no gradient, adapters on and not merged, and the branch in the activations' dtype run the
    first factor as PEFT does and the rest in `nf4_lora_matmul` (`summed`: both factors as PEFT does, the scale and
    sum in `nf4_summed_matmul`); everything else runs PEFT's own forward. Yields (layers routed, LoRA layers over a
    `Linear4bit`)."""
    over_4bit = adapted_layers(model)
    folded = [layer for layer in over_4bit if unfused_reason(layer) is None]
    with nf4.forwards_replaced(folded, lambda layer, forward: _fused(layer, forward, min_rows, max_rows, summed)):
        if over_4bit:
            log.info("nf4 LoRA branch's %s in the token-step kernel for %d of %d LoRA layers over Linear4bit",
                     "scale and sum" if summed else "second factor and sum", len(folded), len(over_4bit))
        yield len(folded), len(over_4bit)


def _branch_dtype(x: torch.Tensor, first: torch.Tensor) -> torch.dtype:
    """The dtype PEFT computes the branch in: the autocast's where one is on (it then casts nothing itself), else
    the first factor's, which it casts x to."""
    if torch.is_autocast_enabled():  # as PEFT asks (CUDA's autocast)
        return torch.get_autocast_dtype("cuda") if x.is_cuda else first.dtype
    return first.dtype


def _fused(layer: Any, fallback: Any, min_rows: int, max_rows: int, summed: bool) -> Any:
    base = layer.get_base_layer()
    name = next(iter(layer.lora_A.keys()))

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        first, second = layer.lora_A[name], layer.lora_B[name]
        dtype = base.compute_dtype if base.compute_dtype is not None else x.dtype
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if (args or kwargs or torch.is_grad_enabled() or layer.disable_adapters or layer.merged
                or list(layer.active_adapters) != [name] or not min_rows <= rows <= max_rows
                or x.dtype != dtype or dtype not in nf4.DTYPES or x.device != base.weight.device
                or _branch_dtype(x, first.weight) != dtype):
            return fallback(x, *args, **kwargs)
        xa = first(x)  # as PEFT computes it: dropout is the identity, the autocast (if any) casts
        qs = getattr(base.weight, "quant_state", None) or base.quant_state
        if summed:
            return nf4_summed_matmul(x, base.weight, base.bias, second(xa).to(dtype), layer.scaling[name],
                                     quant_state=qs)
        return nf4_lora_matmul(x, base.weight, base.bias, xa.to(dtype), second.weight.to(dtype),
                               layer.scaling[name], quant_state=qs)

    return forward
