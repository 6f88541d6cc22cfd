"""A token step's attention over a static KV cache, reading only the cache blocks some position of which is attended.

At a decode step each sequence has one new query token. `vlmrl_sdpa` folds the G query heads of a KV head into
G query rows (`vlmrl.engine.rollout.attention`) and calls SDPA, which reads the whole static cache, written or not
(a static cache holds prompt + all new tokens; on average a good part of it is still unwritten). Slicing the cache
to the filled length instead changes the shapes at each step, so CUDA graphs are recorded once per window (the
benchmark variant `vlmrl-filled`, benchmarks/variants/rollout.py).

This kernel keeps the shapes and reads the mask instead: the cache is cut into blocks of `block` positions, each
program of the first kernel walks its share of one sequence's blocks for one KV head, loads a block's mask entries
(a few bytes) and skips the block when none of them is attended (the unwritten tail, a left-padded prompt's start).
Its G query rows (padded to 16 for the tensor cores) keep a running max, sum and weighted value sum in float32, as
flash attention does. The shares split the cache so that there are enough programs to keep every SM streaming
(`splits`); the last share of a (sequence, head) to finish merges them in split order (a counter each,
`arrivals.split_counters`), or a second kernel does where no counters can be had (inside a CUDA graph capture that
comes before the device's counters exist). One share writes the output itself.

The result is SDPA's attention up to float summation order; like other flash kernels, the probabilities are
rounded to the values' dtype before they weight the values. It serves inference only: no gradient, one query
token, a boolean mask shared by all heads, fp16/bf16, head dims of 16 to 128 that are powers of two (Gemma 3's
256 stays on SDPA). Anything else stays on SDPA (`usable`). On a CPU (tests) the Triton interpreter runs it:
`TRITON_INTERPRET=1` must be set before Triton is first imported (tests/conftest.py does, on machines without
CUDA). What it is worth: benchmarks/NOTES.md ("The decode attention kernel").

`decode_attention` is a `torch.library` custom op, so a compiled decode step (and its CUDA graph) calls it as one
opaque node. Where Triton cannot build or launch the kernel (an older GPU without bf16 tensor-core dots, say), the
op logs a warning once and computes the same attention with SDPA from then on, rather than failing the rollout.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from vlmrl.engine.rollout.arrivals import split_counters

log = logging.getLogger(__name__)
T = TypeVar("T")
_failed: dict[tuple, str] = {}  # (device, dtype, dim, block) -> why the kernel could not run there

BLOCK = 64  # cache positions per block
WARPS = 4  # per program of the first kernel
ROWS = 16  # query rows per program: the fold's G rows, padded for tl.dot
PROGRAMS_PER_SM = 4
HAS_TRITON = importlib.util.find_spec("triton") is not None


def usable(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
           dropout: float = 0.0, *, on_cpu: bool = False) -> bool:
    """True when the kernel computes this attention: folded `query` (batch, kv_heads, G, dim) of G <= 16 rows,
    one query token per row, `key`/`value` (batch, kv_heads, positions, dim) in fp16/bf16, a boolean `mask`
    (batch or 1, 1, 1, positions), no dropout, no gradient, on CUDA (or the CPU with `on_cpu`: the caller has
    checked that Triton runs its interpreter).
    Reads tensor metadata only, so a compiled step traces it without a graph break."""
    dim = query.shape[-1]
    return (
        mask is not None
        and mask.dtype == torch.bool
        and mask.dim() == 4
        and mask.shape[1] == 1
        and mask.shape[2] == 1
        and mask.shape[-1] == key.shape[-2]
        and query.dim() == 4
        and query.shape[2] <= ROWS
        and query.dtype in (torch.float16, torch.bfloat16)
        and key.dtype == value.dtype == query.dtype
        and value.shape[-1] == dim
        and 16 <= dim <= 128
        and dim & (dim - 1) == 0
        and query.stride(-1) == key.stride(-1) == value.stride(-1) == 1
        and dropout == 0.0
        and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad))
        and (query.is_cuda or on_cpu)
        and HAS_TRITON
    )


def interpreted() -> bool:
    """True when Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def splits_for(batch: int, heads: int, positions: int, device: torch.device, block: int = BLOCK) -> int:
    """How many shares to cut each (sequence, head)'s cache into: enough programs for every SM to hold a few.
    Runs inside the custom op (eagerly, also under a compiled step)."""
    blocks = -(-positions // block)
    if device.type != "cuda":
        return min(2, blocks)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(blocks, -(-PROGRAMS_PER_SM * sms // (batch * heads))))


def kernel_or_fallback(failed: dict[tuple, str], where: tuple, kernel: Callable[[], T], fallback: Callable[[], T], *,
                       what: str, instead: str, logger: logging.Logger) -> T:
    """`kernel()`, unless it failed before at `where` (a key of `failed`, which records why); when it fails, or
    failed before, `fallback()`. A failure is warned of once, on `logger`: "the {what} cannot run on {where} (...);
    token steps use {instead} instead"."""
    if where not in failed:
        try:
            return kernel()
        except Exception as error:  # noqa: BLE001 (Triton's compile and launch errors share no base class)
            failed[where] = f"{type(error).__name__}: {error}"
            logger.warning("the %s cannot run on %s (%s); token steps use %s instead",
                           what, where, failed[where].splitlines()[0][:300], instead)
    return fallback()


@torch.library.custom_op("vlmrl::decode_attention", mutates_args=())
def _decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float,
                      block: int, splits: int) -> torch.Tensor:
    return kernel_or_fallback(
        _failed, (str(query.device), query.dtype, query.shape[-1], block),
        lambda: _launch(query, key, value, mask, scale, block, splits),
        lambda: torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale),
        what="decode attention kernel", instead="SDPA", logger=log)


def _launch(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float,
            block: int, splits: int) -> torch.Tensor:
    batch, heads, rows, dim = query.shape
    positions = key.shape[-2]
    splits = splits or splits_for(batch, heads, positions, query.device, block)
    blocks = -(-positions // block)
    chunk = -(-blocks // splits) * block  # positions per share, in whole blocks
    splits = -(-positions // chunk)
    acc = torch.empty(batch, heads, splits, rows, dim, device=query.device, dtype=torch.float32)  # the G real rows
    top = torch.empty(batch, heads, splits, rows, device=query.device, dtype=torch.float32)
    total = torch.empty_like(top)
    out = torch.empty(batch, heads, rows, dim, device=query.device, dtype=query.dtype)
    keep = mask.view(torch.uint8)  # same bytes, a type Triton loads as integers
    interpret = interpreted()
    partial, combine = _kernels(interpret)
    # the last share of a (sequence, head) to finish merges them (one counter each); a second kernel where no
    # counters can be had
    counters = split_counters(query.device, batch * heads) if splits > 1 else None
    log2e = 1.4426950408889634
    partial[(batch, heads, splits)](
        query, key, value, keep, acc, top, total,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        keep.stride(0) if keep.shape[0] > 1 else 0, keep.stride(3),
        positions, chunk, scale * log2e, out, out.stride(0), out.stride(1), out.stride(2),
        counters if counters is not None else out,
        G=rows, D=dim, R=ROWS, BLOCK=block, DOT_F32=interpret, MERGE=counters is not None,
        num_warps=WARPS,
    )
    if splits > 1 and counters is None:
        combine[(batch, heads)](
            acc, top, total, out, splits, out.stride(0), out.stride(1), out.stride(2),
            G=rows, D=dim, R=ROWS,
        )
    return out


@_decode_attention.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float, block: int,
      splits: int) -> torch.Tensor:
    return query.new_empty(query.shape)


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                     scale: float | None = None, *, block: int = BLOCK, splits: int | None = None) -> torch.Tensor:
    """softmax(query keyᵀ · scale, masked) value for folded `query` (batch, kv_heads, G, dim) against `key`,
    `value` (batch, kv_heads, positions, dim) and boolean `mask` (batch or 1, 1, 1, positions; True = attended);
    (batch, kv_heads, G, dim) in the query's dtype. A row with no attended position gives zeros. `splits`: shares
    per (sequence, head), chosen for the device when not given. Call `usable` first."""
    if scale is None:
        scale = query.shape[-1] ** -0.5
    return _decode_attention(query, key, value, mask, float(scale), block, splits or 0)


@functools.cache
def _kernels(interpret: bool) -> tuple[Any, Any]:
    """The two Triton kernels (the shares, and their merge where the first does not merge them), built on first use
    (importing vlmrl needs no Triton), once for the GPU and once for the interpreter (Triton picks it when a kernel
    is defined)."""
    import triton
    import triton.language as tl

    @triton.jit
    def shares_loaded(Ptr, where, ok, other, L2: tl.constexpr):
        # L2: read through L2 (.cg), past a stale L1, as the last program to arrive reads the others' shares
        if L2:
            return tl.load(Ptr + where, mask=ok, other=other, cache_modifier=".cg")
        return tl.load(Ptr + where, mask=ok, other=other)

    globals()["shares_loaded"] = shares_loaded  # a kernel finds the functions it calls among its module's globals

    @triton.jit
    def merged(Acc, Top, Total, Out, b, h, first, splits, sob, soh, sog, G: tl.constexpr, D: tl.constexpr,
               R: tl.constexpr, L2: tl.constexpr):
        # the shares of (sequence b, head h), `first` the index of its first, merged in split order into Out
        rows = tl.arange(0, R)
        cols = tl.arange(0, D)
        real = rows < G
        top = tl.full((R,), float("-inf"), tl.float32)
        for s in range(splits):
            top = tl.maximum(top, shares_loaded(Top, (first + s) * G + rows, real, float("-inf"), L2))
        top = tl.where(top == float("-inf"), 0.0, top)  # no attended position anywhere: every weight below is 0
        total = tl.zeros((R,), tl.float32)
        acc = tl.zeros((R, D), tl.float32)
        for s in range(splits):
            weight = tl.exp2(shares_loaded(Top, (first + s) * G + rows, real, float("-inf"), L2) - top)
            total += weight * shares_loaded(Total, (first + s) * G + rows, real, 0.0, L2)
            acc += weight[:, None] * shares_loaded(Acc, (first + s) * G * D + rows[:, None] * D + cols[None, :],
                                                   real[:, None], 0.0, L2)
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(Out + b * sob + h * soh + rows[:, None] * sog + cols[None, :], out.to(Out.dtype.element_ty),
                 mask=real[:, None])

    globals()["merged"] = merged

    @triton.jit
    def partial(Q, K, V, Keep, Acc, Top, Total,
                sqb, sqh, sqg, skb, skh, skl, svb, svh, svl, smb, sml,
                positions, chunk, scale_log2, Out, sob, soh, sog, Counters,
                G: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr, DOT_F32: tl.constexpr,
                MERGE: tl.constexpr):
        # DOT_F32: the interpreter's tl.dot reads bf16 as raw integers, so there the dots take float32 copies (exact:
        # bf16 values and their products are float32 values); compiled kernels multiply in the inputs' dtype.
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        splits = tl.num_programs(2)
        rows = tl.arange(0, R)
        cols = tl.arange(0, D)
        q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqg + cols[None, :], mask=rows[:, None] < G, other=0.0)
        top = tl.full((R,), float("-inf"), tl.float32)
        total = tl.zeros((R,), tl.float32)
        acc = tl.zeros((R, D), tl.float32)
        start = s * chunk
        end = tl.minimum(start + chunk, positions)
        for first in range(start, end, BLOCK):
            pos = first + tl.arange(0, BLOCK)
            inside = pos < end
            keep = tl.load(Keep + b * smb + pos * sml, mask=inside, other=0) != 0
            if tl.max(keep.to(tl.int32), 0) > 0:
                k = tl.load(K + b * skb + h * skh + pos[:, None] * skl + cols[None, :], mask=inside[:, None], other=0.0)
                if DOT_F32:
                    scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * scale_log2
                else:
                    scores = tl.dot(q, tl.trans(k)) * scale_log2
                scores = tl.where(keep[None, :], scores, float("-inf"))
                new_top = tl.maximum(top, tl.max(scores, 1))
                fade = tl.exp2(top - new_top)
                p = tl.exp2(scores - new_top[:, None])
                total = total * fade + tl.sum(p, 1)
                v = tl.load(V + b * svb + h * svh + pos[:, None] * svl + cols[None, :], mask=inside[:, None], other=0.0)
                weights = p.to(v.dtype)  # rounded like the values, as flash attention does
                if DOT_F32:
                    acc = acc * fade[:, None] + tl.dot(weights.to(tl.float32), v.to(tl.float32))
                else:
                    acc = acc * fade[:, None] + tl.dot(weights, v)
                top = new_top
        share = (b * tl.num_programs(1) + h) * splits + s
        real = rows < G
        if splits == 1:  # the only share: the output itself (what merging one share gives, bit for bit)
            out = acc / tl.where(total > 0, total, 1.0)[:, None]
            tl.store(Out + b * sob + h * soh + rows[:, None] * sog + cols[None, :], out.to(Out.dtype.element_ty),
                     mask=real[:, None])
        else:
            tl.store(Acc + share * G * D + rows[:, None] * D + cols[None, :], acc, mask=real[:, None])
            tl.store(Top + share * G + rows, top, mask=real)
            tl.store(Total + share * G + rows, total, mask=real)
            if MERGE:
                # every thread's stores before the count (released at GPU scope); the last share of this (sequence,
                # head) to arrive merges them, read through L2 after its acquire, and sets the counter back to 0
                tl.debug_barrier()
                pair = b * tl.num_programs(1) + h
                if tl.atomic_add(Counters + pair, 1, sem="acq_rel", scope="gpu") == splits - 1:
                    merged(Acc, Top, Total, Out, b, h, pair * splits, splits, sob, soh, sog, G, D, R, True)
                    tl.atomic_xchg(Counters + pair, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def combine(Acc, Top, Total, Out, splits, sob, soh, sog,
                G: tl.constexpr, D: tl.constexpr, R: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        merged(Acc, Top, Total, Out, b, h, (b * tl.num_programs(1) + h) * splits, splits, sob, soh, sog, G, D, R,
               False)

    return partial, combine
