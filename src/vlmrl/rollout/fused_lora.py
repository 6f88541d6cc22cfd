"""A token step's LoRA branch in one kernel: `base + scaling * (x Aᵀ) Bᵀ` for the few rows of a decode step.

In a compiled decode step each adapted projection (7 per layer, 252 for Qwen3-VL-8B) runs its LoRA branch as
cuBLAS's kernels for two skinny matmuls (rank 16; the first split over its 4,096-long reduction, with a second
kernel to sum the pieces) and an elementwise scale-and-add: 4 to 5 launches of a few microseconds each, ~2.5 ms
of an 11 ms token step on an H200 (`benchmarks/results/h200_decode_variants_kernel.md`). Here one Triton program
per column tile of the output computes the rank-16 projection of its rows, rounds it to the input's dtype (as the
first matmul's output is), multiplies it by its tile of B and adds it, scaled, to the base output's tile.

Inside `fused(model)` (rollouts with `train.rollout_fused_lora`) every plain LoRA layer (one active adapter, no
dropout, no DoRA or other variant) runs its branch through it when the call has at most `MAX_ROWS` rows, needs no
gradient and is on CUDA in fp16/bf16; the prompt pass and everything else keep PEFT's forward. The numbers are
PEFT's under autocast up to float summation order, and one rounding fewer: the scaled product is added to the
base output before it is rounded, not after (a difference far below the output's own rounding, since the adapter's
contribution is small against the base output). On a CPU the Triton interpreter runs it (tests).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from vlmrl.rollout.decode_attention import HAS_TRITON, interpreted

MAX_ROWS = 64  # a decode step's batch; more rows and each program's recomputed projection costs too much
BLOCK_N = 128  # output columns per program
BLOCK_K = 128  # reduction step of the projection


def usable(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, on_cpu: bool = False) -> bool:
    """True when the kernel can compute `base + scaling * (x Aᵀ) Bᵀ` for input `x` (the base output must then
    have x's dtype: checked by the caller): at most MAX_ROWS rows, fp16/bf16, A (rank, in) and B (out, rank) of
    rank <= 64, no gradient, on CUDA (or the CPU with `on_cpu`: the caller has checked that Triton runs its
    interpreter). Metadata only: no graph break."""
    features = x.shape[-1]
    rows = x.numel() // features if features else 0
    return (
        HAS_TRITON
        and x.dtype in (torch.float16, torch.bfloat16)
        and 0 < rows <= MAX_ROWS
        and a.dim() == 2 and b.dim() == 2
        and a.shape[1] == features and b.shape[1] == a.shape[0]
        and 0 < a.shape[0] <= 64
        and not (torch.is_grad_enabled() and (x.requires_grad or a.requires_grad or b.requires_grad))
        and (x.is_cuda or on_cpu)
    )


@torch.library.custom_op("vlmrl::lora_branch", mutates_args=())
def _lora_branch(base: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    features, outputs, rank = x.shape[-1], base.shape[-1], a.shape[0]
    rows2d = x.reshape(-1, features)
    base2d = base.reshape(-1, outputs)
    if rows2d.stride(-1) != 1:
        rows2d = rows2d.contiguous()
    if base2d.stride(-1) != 1:
        base2d = base2d.contiguous()
    a, b = a.contiguous(), b.contiguous()
    out = torch.empty(base2d.shape, dtype=base.dtype, device=base.device)
    rows = rows2d.shape[0]
    block_m = max(16, triton_next_power_of_2(rows))
    ranks = max(16, triton_next_power_of_2(rank))
    kernel = _kernel(interpreted())
    kernel[(-(-rows // block_m), -(-outputs // BLOCK_N))](
        rows2d, a, b, base2d, out, rows, outputs, features, rank,
        rows2d.stride(0), base2d.stride(0), scaling,
        BM=block_m, BN=BLOCK_N, BK=BLOCK_K, R=ranks, DOT_F32=interpreted(),
    )
    return out.reshape(base.shape)


@_lora_branch.register_fake
def _(base: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    return torch.empty_like(base)


def lora_branch(base: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """`base + scaling * (x @ a.T) @ b.T`, the projection rounded to x's dtype; a (rank, in), b (out, rank), in any
    float dtype (read as x's, as autocast would cast them). Call `usable` first."""
    return _lora_branch(base, x, a, b, float(scaling))


def triton_next_power_of_2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def _layers(model: Any) -> list[tuple[Any, str]]:
    """The plain LoRA layers of `model` with one active adapter, and its name."""
    from vlmrl.adapter_inputs import plain_lora
    from vlmrl.rollout.merge import lora_layers

    chosen = []
    for layer in lora_layers(model):
        active = [name for name in getattr(layer, "active_adapters", []) if name in layer.lora_A]
        if len(active) == 1 and plain_lora(layer) and not getattr(layer, "merged", False):
            chosen.append((layer, active[0]))
    return chosen


def _forward(layer: Any, name: str, on_cpu: bool) -> Any:
    original = type(layer).forward

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if layer.disable_adapters or layer.merged or args or kwargs:
            return original(layer, x, *args, **kwargs)
        a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
        if not usable(x, a, b, on_cpu=on_cpu):
            return original(layer, x)
        base = layer.base_layer(x)
        if base.dtype != x.dtype or base.shape[-1] != b.shape[0]:  # PEFT's own vanilla-LoRA sum, on this base
            adapter_input = layer._cast_input_dtype(x, a.dtype)
            return (base + layer.lora_B[name](layer.lora_A[name](adapter_input)) * layer.scaling[name]).to(base.dtype)
        return lora_branch(base, x, a, b, layer.scaling[name])

    return forward


def count(model: Any) -> int:
    """How many LoRA layers `fused` changes in `model`."""
    return len(_layers(model))


@contextlib.contextmanager
def fused(model: Any, *, on_cpu: bool = False) -> Iterator[int]:
    """Inside the block, the plain LoRA layers of `model` run decode-sized calls through `lora_branch`; yields how
    many layers. `on_cpu`: tests, with Triton's interpreter."""
    on_cpu = on_cpu and interpreted()
    layers = _layers(model)
    for layer, name in layers:
        layer.forward = _forward(layer, name, on_cpu)
    try:
        yield len(layers)
    finally:
        for layer, _ in layers:
            layer.__dict__.pop("forward", None)


@functools.cache
def _kernel(interpret: bool) -> Any:
    """The Triton kernel, built on first use, once for the GPU and once for the interpreter."""
    import triton
    import triton.language as tl

    @triton.jit
    def branch(X, A, B, Base, Out, rows, outputs, features, rank, sxm, sbase, scaling,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, R: tl.constexpr, DOT_F32: tl.constexpr):
        # DOT_F32: the interpreter's tl.dot reads bf16 as raw integers (see decode_attention). (The interpreter also
        # truncates to bf16 where a GPU rounds to nearest; tests allow for it.)
        m = tl.program_id(0) * BM + tl.arange(0, BM)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        r = tl.arange(0, R)
        k = tl.arange(0, BK)
        projection = tl.zeros((BM, R), tl.float32)
        for start in range(0, features, BK):
            kk = start + k
            x = tl.load(X + m[:, None] * sxm + kk[None, :], mask=(m[:, None] < rows) & (kk[None, :] < features),
                        other=0.0)
            a = tl.load(A + r[:, None] * features + kk[None, :], mask=(r[:, None] < rank) & (kk[None, :] < features),
                        other=0.0).to(x.dtype)
            if DOT_F32:
                projection += tl.dot(x.to(tl.float32), tl.trans(a.to(tl.float32)))
            else:
                projection += tl.dot(x, tl.trans(a))
        u = projection.to(X.dtype.element_ty)  # rounded as the first matmul's output is
        b = tl.load(B + n[:, None] * rank + r[None, :], mask=(n[:, None] < outputs) & (r[None, :] < rank),
                    other=0.0).to(X.dtype.element_ty)
        if DOT_F32:
            delta = tl.dot(u.to(tl.float32), tl.trans(b.to(tl.float32)))
        else:
            delta = tl.dot(u, tl.trans(b))
        inside = (m[:, None] < rows) & (n[None, :] < outputs)
        base = tl.load(Base + m[:, None] * sbase + n[None, :], mask=inside, other=0.0)
        out = base.to(tl.float32) + delta * scaling
        tl.store(Out + m[:, None] * outputs + n[None, :], out.to(Out.dtype.element_ty), mask=inside)

    return branch
