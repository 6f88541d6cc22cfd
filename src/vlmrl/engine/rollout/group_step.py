"""A stacked group's token step as one Triton kernel: its base matmul, its adapters' first factors and its second step.

At a token step a group of projections that share an input (`vlmrl.engine.rollout.stacked`: q/k/v, gate/up, or one
projection) ran as cuBLAS's matmul over the stacked weight (base rows, then the first factors' rows; often split-K
with a reduction kernel after it), then the second step's kernel (`second_factors`). Here one launch does all of it:
a grid of (output tiles, K splits); each program multiplies x's rows by its tile of base rows and by the rank rows
its tile's outputs need (the second factors are block-diagonal, so one member's ranks: `rank_windows`), both on the
tensor cores in float32; the tile's last split to arrive (one counter a tile, `arrivals`) sums both kinds of share
in split order and does the second step on the tile in its epilogue: base (+ bias) rounded, the rank-space inputs
rounded, their product by the second factors rounded, scaled (a float, or one value a column) and rounded, added
and rounded, as `second_factors` rounds. Only the sums' order differs from cuBLAS's.

Public: `usable(x, weight, second, windows)`, `rank_windows(outs, ranks, device)` (made once per group),
`group_step(x, weight, bias, second, scale, windows)`. Limits: bf16, 1-64 rows, ranks within a tile up to 64,
`in_features` a multiple of `BLOCK_K`; CUDA, or Triton's interpreter on a CPU (tests). Where the tile's splits
cannot be summed in the kernel (no counters to be had) or Triton cannot build or launch it (warned once), the same
arithmetic as before: cuBLAS's matmul, then the second step.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from vlmrl.engine.rollout import second_factors
from vlmrl.engine.rollout.arrivals import split_counters
from vlmrl.engine.rollout.decode_attention import HAS_TRITON, interpreted, kernel_or_fallback

log = logging.getLogger(__name__)
_failed: dict[tuple, str] = {}  # (device, dtype) -> why the kernel could not run there

MAX_ROWS = 64
BLOCK_N, BLOCK_K, STAGES, WARPS = 64, 128, 3, 4  # the best of an H100 sweep at every group shape, 32 rows
PROGRAMS_PER_SM = 1.4  # split K (by powers of two) until the grid has about this many programs an SM
MAX_RP = 64
# second_factors' device helpers (rounding, the second step on a tile), put here when the kernel is built: Triton
# finds the functions a kernel calls among its module's globals
to_bf16: Any = None
added_rounded: Any = None


def rank_windows(outs: list[int], ranks: list[int], device: torch.device) -> tuple[torch.Tensor, int] | None:
    """For each tile of `BLOCK_N` outputs, the first of the ranks its outputs read (int32, on `device`), and how many
    rank rows a program takes (a power of two, 16 at least); None where a tile's ranks span more than `MAX_RP`."""
    spans, o, c = [], 0, 0
    for out, rank in zip(outs, ranks, strict=True):
        spans.append((o, o + out, c, c + rank))
        o, c = o + out, c + rank
    starts, widest = [], 0
    for lo in range(0, o, BLOCK_N):
        hit = [(c0, c1) for o0, o1, c0, c1 in spans if o0 < lo + BLOCK_N and lo < o1]
        first, last = min(c0 for c0, _ in hit), max(c1 for _, c1 in hit)
        starts.append(first)
        widest = max(widest, last - first)
    rp = max(16, 1 << (widest - 1).bit_length())
    return None if rp > MAX_RP else (torch.tensor(starts, dtype=torch.int32, device=device), rp)


def usable(x: torch.Tensor, weight: torch.Tensor, second: torch.Tensor | None, windows: Any) -> bool:
    """True when the kernel computes this group's step: a few bf16 rows, K a multiple of `BLOCK_K`, rank windows
    made, on CUDA (or the interpreter), no gradient. Reads metadata only (a compiled step traces it)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (HAS_TRITON and windows is not None and second is not None and 0 < rows <= MAX_ROWS
            and x.dtype == weight.dtype == second.dtype == torch.bfloat16 and x.shape[-1] % BLOCK_K == 0
            and not torch.is_grad_enabled() and (x.is_cuda or interpreted()))


def group_step(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, second: torch.Tensor, scale: Any,
               windows: tuple[torch.Tensor, int]) -> torch.Tensor:
    """The group's outputs [..., width] for `weight` [width + ranks, in] (base rows, then first-factor rows),
    `second` [width, ranks] block-diagonal, `scale` a float or a [width] tensor. Call `usable` first."""
    starts, rp = windows
    scales = scale if isinstance(scale, torch.Tensor) else None
    out = _group_step(x.reshape(-1, x.shape[-1]), weight, bias, second, scales,
                      1.0 if scales is not None else float(scale), starts, rp)
    return out.view(*x.shape[:-1], second.shape[0])


@torch.library.custom_op("vlmrl::group_step", mutates_args=())
def _group_step(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, second: torch.Tensor,
                scales: torch.Tensor | None, scale: float, starts: torch.Tensor, rp: int) -> torch.Tensor:
    def apart() -> torch.Tensor:
        return second_factors.linear_and_second(x, weight, bias, second, scales if scales is not None else scale)

    def kernel() -> torch.Tensor:
        out = _launch(x, weight, bias, second, scales, scale, starts, rp)
        return out if out is not None else apart()

    return kernel_or_fallback(_failed, (str(x.device), x.dtype), kernel, apart, what="stacked group-step kernel",
                              instead="cuBLAS and the second-step kernel", logger=log)


@_group_step.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, second: torch.Tensor,
      *args: Any) -> torch.Tensor:
    return x.new_empty((x.shape[0], second.shape[0]))


def splits_for(tiles: int, k: int, sms: int) -> int:
    """K splits (a power of two dividing K into whole `BLOCK_K` steps) until the grid has about `PROGRAMS_PER_SM`
    programs on each of `sms` SMs."""
    splits = 1
    while tiles * splits < PROGRAMS_PER_SM * sms and k % (2 * splits * BLOCK_K) == 0:
        splits *= 2
    return splits


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, second: torch.Tensor,
            scales: torch.Tensor | None, scale: float, starts: torch.Tensor, rp: int) -> torch.Tensor | None:
    rows, k = x.shape
    width, ranks = second.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    second = second.contiguous()
    tiles = -(-width // BLOCK_N)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 2
    splits = splits_for(tiles, k, sms)
    counters = split_counters(x.device, tiles) if splits > 1 else None
    if splits > 1 and counters is None:
        return None
    block_m = max(16, 1 << (rows - 1).bit_length())
    out = torch.empty(rows, width, device=x.device, dtype=x.dtype)
    partial = torch.empty(splits, rows, width, device=x.device, dtype=torch.float32) if splits > 1 else out
    shares = torch.empty(tiles, splits, rp, block_m, device=x.device, dtype=torch.float32) if splits > 1 else out
    interpret = interpreted()
    _kernel(interpret)[(tiles, splits)](
        x, weight, weight[width:], second, scales if scales is not None else out, bias if bias is not None else out,
        out, partial, shares, counters if counters is not None else out, starts, rows, width, k, ranks, x.stride(0),
        weight.stride(0), k // splits, scale, BLOCK_N=BLOCK_N, BLOCK_M=block_m, BLOCK_K=BLOCK_K, RP=rp, SPLITS=splits,
        PER_COLUMN=scales is not None, HAS_BIAS=bias is not None, DOT_F32=interpret, num_warps=WARPS,
        num_stages=STAGES)
    return out


@functools.cache
def _kernel(interpret: bool) -> Any:
    """The Triton kernel, built on first use (importing vlmrl needs no Triton)."""
    import triton
    import triton.language as tl

    second_factors.kernel(interpret)  # builds the second step's arithmetic on a tile, which this kernel ends in
    # a kernel finds the functions it calls among its module's globals
    globals().update(to_bf16=second_factors.to_bf16, added_rounded=second_factors.added_rounded)

    @triton.jit
    def finished(acc, acc_a, Second, Scales, Bias, Out, n, m, n_ok, m_ok, r, r_ok, N, R, scale,
                 PER_COLUMN: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr):
        # the tile's outputs: base (+ bias) rounded, plus the second step as second_factors rounds it
        if HAS_BIAS:
            acc += tl.load(Bias + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        factors = tl.load(Second + n[:, None] * R + r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        if PER_COLUMN:
            scale = tl.load(Scales + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        # the rank-space inputs rounded (the first factors' rows of a stacked bias are zeros)
        out = added_rounded(to_bf16(acc), factors, to_bf16(acc_a), scale, DOT_F32)
        tl.store(Out + m[None, :] * N + n[:, None], out.to(Out.dtype.element_ty), mask=m_ok[None, :] & n_ok[:, None])

    globals()["finished"] = finished

    @triton.jit
    def group_step(X, W, A, Second, Scales, Bias, Out, Partial, Shares, Counters, Starts, M, N, K, R, sxm, swn,
                   per_split, scale, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                   RP: tl.constexpr, SPLITS: tl.constexpr, PER_COLUMN: tl.constexpr, HAS_BIAS: tl.constexpr,
                   DOT_F32: tl.constexpr):
        # out[m, n] for the tile's outputs n: the base rows W[n] and the rank rows A[r] its outputs read, over this
        # split's k, transposed (W's tile the wide operand, x's the narrow one); the last split sums and finishes
        t = tl.program_id(0)
        n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        n_ok = n < N
        m_ok = m < M
        r = tl.load(Starts + t) + tl.arange(0, RP)
        r_ok = r < R
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_a = tl.zeros((RP, BLOCK_M), dtype=tl.float32)
        start = tl.program_id(1) * per_split
        for k in range(start, start + per_split, BLOCK_K):
            kk = k + tl.arange(0, BLOCK_K)
            w = tl.load(W + n[:, None] * swn + kk[None, :], mask=n_ok[:, None], other=0.0)
            a = tl.load(A + r[:, None] * swn + kk[None, :], mask=r_ok[:, None], other=0.0)
            xt = tl.load(X + m[None, :] * sxm + kk[:, None], mask=m_ok[None, :], other=0.0)
            if DOT_F32:  # the interpreter's dot reads bf16 as integers: exact float32 copies there
                acc += tl.dot(w.to(tl.float32), xt.to(tl.float32))
                acc_a += tl.dot(a.to(tl.float32), xt.to(tl.float32))
            else:
                acc = tl.dot(w, xt, acc)
                acc_a = tl.dot(a, xt, acc_a)
        if SPLITS == 1:
            finished(acc, acc_a, Second, Scales, Bias, Out, n, m, n_ok, m_ok, r, r_ok, N, R, scale, PER_COLUMN,
                     HAS_BIAS, DOT_F32)
        else:
            # each split's shares stored; every thread's stores before the count (released at GPU scope); the last
            # to arrive reads them through L2 after its acquire, sums them in split order, finishes, resets the count
            where = m[None, :] * N + n[:, None]
            ok = m_ok[None, :] & n_ok[:, None]
            ranks = tl.arange(0, RP)[:, None] * BLOCK_M + m[None, :]
            tl.store(Partial + tl.program_id(1) * M * N + where, acc, mask=ok)
            tl.store(Shares + (t * SPLITS + tl.program_id(1)) * RP * BLOCK_M + ranks, acc_a)
            tl.debug_barrier()
            if tl.atomic_add(Counters + t, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
                acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                acc_a = tl.zeros((RP, BLOCK_M), dtype=tl.float32)
                for s in tl.static_range(SPLITS):
                    acc += tl.load(Partial + s * M * N + where, mask=ok, other=0.0, cache_modifier=".cg")
                    acc_a += tl.load(Shares + (t * SPLITS + s) * RP * BLOCK_M + ranks, cache_modifier=".cg")
                finished(acc, acc_a, Second, Scales, Bias, Out, n, m, n_ok, m_ok, r, r_ok, N, R, scale, PER_COLUMN,
                         HAS_BIAS, DOT_F32)
                tl.atomic_xchg(Counters + t, 0, sem="relaxed", scope="gpu")

    return group_step
