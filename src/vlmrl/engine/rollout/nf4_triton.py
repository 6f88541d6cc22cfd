"""The Triton source of the nf4 token-step kernel that `vlmrl.engine.rollout.nf4` launches (its docstring says
what it computes and how it is checked).

Public: `kernels(interpret)` -> (`nf4_tiles`: 2-D tiles of packed bytes read as int32 words, each word's 8 nibbles
looked up from the word shifted and joined back into the rows' order (high nibble first) against x's columns read
along k, each program writing its fp32 share when K is split, else the rounded output, its table lookups loads or,
compiled, warp shuffles (`SHUFFLE`); with `SPLITS` and per-tile `Counters`, the last split of a tile to finish sums
the shares into `Final` (`sum_if_last`); `nf4_splits`: the same fixed-order sum as a second kernel, unrolled over the
split count, bias added and rounded once). With `LORA`, `nf4_tiles` computes a projection's LoRA branch too
(`vlmrl.engine.rollout.nf4_branch` says how). Building them also puts their device helpers (`rounded`, `dot_operand`,
`store_tile`, `block_scales`, `x_tile`, `times_x`, `first_times_x`, `with_second`, `lane_table`, `held_by`, `nibble`,
`word_weights`, `shares_summed`, `split_shares_summed`, `arrived`, `sum_if_last`, `lora_sum_if_last`) in this
module's globals, where Triton finds them (and other kernels built on them may take them); the second step's
arithmetic on a tile is `second_factors`' (`added_rounded`).
Limits: those of `nf4` (nf4 codes, bf16/fp16 activations, CUDA or Triton's interpreter); the shuffles are inline
PTX (compiled only) and read the right values only where each thread keeps its own lane's table value, which
a compiler's re-layout could break: `nf4.launch` checks them against the loads once per setting. The in-kernel split
sum needs launches on one device not to overlap (its counters are shared).
"""

from __future__ import annotations

import functools
from typing import Any

from vlmrl.engine.rollout import second_factors

# second_factors' device helpers (rounding, the second step on a tile), put here when the kernels are built: Triton
# finds the functions a kernel calls among its module's globals
to_bf16: Any = None
added_rounded: Any = None


@functools.cache
def kernels(interpret: bool) -> tuple[Any, Any]:
    """(nf4_tiles, nf4_splits), built on first use (importing vlmrl needs no Triton); `interpret`
    keys the cache, as Triton's interpreter is chosen when a kernel is built."""
    import triton
    import triton.language as tl

    globals()["tl"] = tl  # Triton's interpreter looks for the language among a device function's globals
    second_factors.kernel(interpret)  # the second step's arithmetic on a tile, which the LoRA branch ends in
    globals().update(to_bf16=second_factors.to_bf16, added_rounded=second_factors.added_rounded)

    @triton.jit
    def rounded(x, CODE: tl.constexpr, EXACT: tl.constexpr):
        # float32 -> the nearest bf16 (CODE 1) or fp16 (CODE 2) value, ties to even, kept in float32 (CODE 0: x).
        # On the bits for bf16 in the interpreter, which truncates where compiled kernels round.
        if CODE == 1:
            if EXACT:
                bits = x.to(tl.uint32, bitcast=True)
                bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
                x = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)  # noqa: PLR0124 (False for NaN only)
            else:
                x = x.to(tl.bfloat16).to(tl.float32)
        elif CODE == 2:
            x = x.to(tl.float16).to(tl.float32)
        return x

    globals()["rounded"] = rounded  # a kernel finds the functions it calls among its module's globals

    @triton.jit
    def dot_operand(w, WQ: tl.constexpr, XQ: tl.constexpr, TY: tl.constexpr, EXACT: tl.constexpr):
        # fp32 weights rounded to the weight dtype, then cast to the activations' (exact fp32 copies in the
        # interpreter, whose tl.dot reads bf16 as integers)
        if EXACT:
            return rounded(rounded(w, WQ, True), XQ, True)
        if WQ == 1:
            w = w.to(tl.bfloat16)
        elif WQ == 2:
            w = w.to(tl.float16)
        return w.to(TY)

    globals()["dot_operand"] = dot_operand

    @triton.jit
    def store_tile(acc, Out, Bias, n, m, n_ok, m_ok, M, N, PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                   XQ: tl.constexpr, EXACT: tl.constexpr):
        # a program's [BLOCK_N, BLOCK_M] sums (out transposed): its split's fp32 share, or bias added and rounded once
        where = m[None, :] * N + n[:, None]
        mask = m_ok[None, :] & n_ok[:, None]
        if PARTIAL:
            tl.store(Out + tl.program_id(1) * M * N + where, acc, mask=mask)
        else:
            if HAS_BIAS:
                acc = acc + tl.load(Bias + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(Out + where, rounded(acc, XQ, EXACT).to(Out.dtype.element_ty), mask=mask)

    globals()["store_tile"] = store_tile

    @triton.jit
    def block_scales(Absmax, Code2, Absmax2, offset, n, n_ok, blocks, kh, j, BLOCKSIZE2: tl.constexpr,
                     HALF: tl.constexpr, NB: tl.constexpr, BLOCK_N: tl.constexpr, KH: tl.constexpr,
                     NESTED: tl.constexpr):
        # [BLOCK_N, KH]: the block scale of each column, j its first packed byte's offset in the step (a byte, or a
        # word of 4 in one block), the step's NB blocks' absmax (decoded through the nested state when
        # double-quantised) spread over their columns by selects
        scale = tl.zeros((BLOCK_N, KH), dtype=tl.float32)
        for b in tl.static_range(NB):
            block = n * blocks + kh // HALF + b
            ok = n_ok & (kh // HALF + b < blocks)
            if NESTED:
                code = tl.load(Absmax + block, mask=ok, other=0).to(tl.int32)
                s = tl.load(Code2 + code) * tl.load(Absmax2 + block // BLOCKSIZE2, mask=ok, other=0.0)
                s = s + offset  # rounded apart from the product (no fusion), as bitsandbytes does
            else:
                s = tl.load(Absmax + block, mask=ok, other=0.0)
            scale = tl.where((j // HALF == b)[None, :], s[:, None], scale)
        return scale

    globals()["block_scales"] = block_scales

    @triton.jit
    def x_tile(X, m, m_ok, stride_x, kh, end, KH: tl.constexpr, EVEN: tl.constexpr, EXACT: tl.constexpr):
        # x's [2 KH, BLOCK_M] tile of the step, read along k, contiguous: coalesced 16-byte loads
        t = 2 * kh + tl.arange(0, 2 * KH)
        xk = X + m[None, :] * stride_x + t[:, None]
        if EVEN:
            xs = tl.load(xk, mask=m_ok[None, :], other=0.0)
        else:
            xs = tl.load(xk, mask=m_ok[None, :] & (t < 2 * end)[:, None], other=0.0)
        if EXACT:
            xs = xs.to(tl.float32)
        return xs

    globals()["x_tile"] = x_tile

    @triton.jit
    def times_x(acc, w, X, m, m_ok, stride_x, kh, end, KH: tl.constexpr, EVEN: tl.constexpr, EXACT: tl.constexpr):
        # acc + the step's weights w [BLOCK_N, 2 KH], in the row's order, times x's tile
        return tl.dot(w, x_tile(X, m, m_ok, stride_x, kh, end, KH, EVEN, EXACT), acc)

    globals()["times_x"] = times_x

    @triton.jit
    def first_times_x(acc_a, First, r, r_ok, K, xs, kh, end, KH: tl.constexpr, EVEN: tl.constexpr,
                      EXACT: tl.constexpr):
        # acc_a + the LoRA first factors' rows r (bf16 [RP, 2 KH] of the step, read along k) times x's tile xs
        t = 2 * kh + tl.arange(0, 2 * KH)
        at = First + r[:, None] * K + t[None, :]
        if EVEN:
            a = tl.load(at, mask=r_ok[:, None], other=0.0)
        else:
            a = tl.load(at, mask=r_ok[:, None] & (t < 2 * end)[None, :], other=0.0)
        if EXACT:
            a = a.to(tl.float32)
        return tl.dot(a, xs, acc_a)

    globals()["first_times_x"] = first_times_x

    @triton.jit
    def with_second(acc, acc_a, Second, Bias, Final, n, m, n_ok, m_ok, r, r_ok, M, N, R, lora_scale,
                    HAS_BIAS: tl.constexpr, EXACT: tl.constexpr):
        # the member's output: its base output (+ bias) rounded, plus its LoRA branch as the product's second step
        # rounds it (second_factors.added: the rank-space inputs rounded, their product by the second factor rounded,
        # scaled and rounded, added and rounded), in bf16
        if HAS_BIAS:
            acc += tl.load(Bias + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        second = tl.load(Second + n[:, None] * R + r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        out = added_rounded(to_bf16(acc), second, to_bf16(acc_a), lora_scale, EXACT)
        tl.store(Final + m[None, :] * N + n[:, None], out.to(Final.dtype.element_ty),
                 mask=m_ok[None, :] & n_ok[:, None])

    globals()["with_second"] = with_second

    @triton.jit
    def lora_sum_if_last(Partial, SharesA, Second, Bias, Final, Counters, n, m, n_ok, m_ok, r, r_ok, M, N, R,
                         lora_scale, SPLITS: tl.constexpr, RP: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr, EXACT: tl.constexpr):
        # `sum_if_last` for a launch with the LoRA branch: the last split of a tile sums the base shares and the
        # rank-space shares in split order and writes the member's output (`with_second`)
        tile, last = arrived(Counters, SPLITS)
        if last:
            _, _, acc = split_shares_summed(Partial, n, m, n_ok, m_ok, M, N, SPLITS, BLOCK_N, BLOCK_M)
            where_a = (tile * SPLITS * RP + tl.arange(0, RP)[:, None]) * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
            acc_a = shares_summed(tl.zeros((RP, BLOCK_M), dtype=tl.float32), SharesA, where_a,
                                  tl.full((RP, BLOCK_M), 1, tl.int1), RP * BLOCK_M, SPLITS, True)
            with_second(acc, acc_a, Second, Bias, Final, n, m, n_ok, m_ok, r, r_ok, M, N, R, lora_scale, HAS_BIAS,
                        EXACT)
            tl.atomic_xchg(Counters + tile, 0, sem="relaxed", scope="gpu")

    globals()["lora_sum_if_last"] = lora_sum_if_last

    @triton.jit
    def lane_table(Lut, like):
        # each element: the table entry (its lane mod 16) of the lane holding it, from uniform values only, never a
        # tensor load, whose own layout Triton may later convert, moving values to other lanes' threads (Triton 3.6
        # did: benchmarks/NOTES.md). `like` only gives the shape; every operand is the same for a thread's elements.
        lane = tl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r", [tl.zeros_like(like)], dtype=tl.int32,
                                         is_pure=True, pack=1) & 15
        held = tl.zeros_like(like).to(tl.float32) + tl.load(Lut)
        for k in tl.static_range(1, 16):
            held = tl.where(lane == k, tl.load(Lut + k), held)
        return held.to(tl.int32, bitcast=True)

    globals()["lane_table"] = lane_table

    @triton.jit
    def held_by(held, code):
        # the float32 `held` by lane `code` (0-15) of this warp, where every lane holds entry (its lane mod 16)
        bits = tl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;", "=r,r,r",
                                         [held, code], dtype=tl.int32, is_pure=True, pack=1)
        return bits.to(tl.float32, bitcast=True)

    globals()["held_by"] = held_by

    @triton.jit
    def nibble(held, Lut, w, SHIFT: tl.constexpr, SHUFFLE: tl.constexpr):
        # the table value of the nibble at bits SHIFT..SHIFT+3 of the int32 words w. A shuffle reads its source lane
        # from the index's low 5 bits only, and lane l holds entry l mod 16 (`lane_table`), so the shifted word is
        # itself the index: the bit above the nibble only picks the lane's twin. The loads mask it.
        if SHUFFLE:
            return held_by(held, w >> SHIFT)
        return tl.load(Lut + ((w >> SHIFT) & 15))

    globals()["nibble"] = nibble

    @triton.jit
    def word_weights(held, Lut, w, scale, WQ: tl.constexpr, XQ: tl.constexpr, TY: tl.constexpr,
                     EXACT: tl.constexpr, SHUFFLE: tl.constexpr):
        # [BLOCK_N, KW] words of 8 nibbles -> [BLOCK_N, 8 KW] weights in the row's order: weight 2b is byte b's
        # high nibble (bits 8b + 4), 2b + 1 its low one (bits 8b), each its table value times the word's block scale
        # (a word's 4 bytes lie in one block), rounded as bitsandbytes rounds
        v0, v1 = nibble(held, Lut, w, 4, SHUFFLE), nibble(held, Lut, w, 0, SHUFFLE)
        v2, v3 = nibble(held, Lut, w, 12, SHUFFLE), nibble(held, Lut, w, 8, SHUFFLE)
        v4, v5 = nibble(held, Lut, w, 20, SHUFFLE), nibble(held, Lut, w, 16, SHUFFLE)
        v6, v7 = nibble(held, Lut, w, 28, SHUFFLE), nibble(held, Lut, w, 24, SHUFFLE)
        # [BLOCK_N, KW, 2, 2, 2]: index (a, b, c) is the word's weight 4a + 2b + c, so the reshape keeps row order
        joined = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
        joined = dot_operand(joined * scale[:, :, None, None, None], WQ, XQ, TY, EXACT)
        return tl.reshape(joined, (w.shape[0], 8 * w.shape[1]))

    globals()["word_weights"] = word_weights

    @triton.jit
    def shares_summed(acc, Partial, at, ok, size, SPLITS: tl.constexpr, L2: tl.constexpr):
        # acc + the SPLITS fp32 shares at offsets `at` (share s at s * size), split 0 first: the one order both split
        # sums keep, so that their outputs are equal bit for bit; L2: read through L2 (.cg), past a stale L1
        for s in tl.static_range(SPLITS):
            if L2:
                acc += tl.load(Partial + s * size + at, mask=ok, other=0.0, cache_modifier=".cg")
            else:
                acc += tl.load(Partial + s * size + at, mask=ok, other=0.0)
        return acc

    globals()["shares_summed"] = shares_summed

    @triton.jit
    def nf4_splits(Partial, Bias, Out, size, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, XQ: tl.constexpr,
                   EXACT: tl.constexpr, BLOCK: tl.constexpr):
        # the splits' shares summed in order, the bias added, rounded once. Unrolled, so every split's load is in
        # flight at once: a loop over a runtime count waited out one memory latency per split (the profile in
        # benchmarks/NOTES.md: the sum took as long as the projection it finished at 16-64 splits)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < size
        acc = shares_summed(tl.zeros((BLOCK,), dtype=tl.float32), Partial, i, ok, size, SPLITS, False)
        if HAS_BIAS:
            acc += tl.load(Bias + i % N, mask=ok, other=0.0).to(tl.float32)
        tl.store(Out + i, rounded(acc, XQ, EXACT).to(Out.dtype.element_ty), mask=ok)

    @triton.jit
    def split_shares_summed(Partial, n, m, n_ok, m_ok, M, N, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_M: tl.constexpr):
        # (the tile's output offsets, their mask, its SPLITS fp32 shares summed in split order, read through L2)
        where = m[None, :] * N + n[:, None]
        mask = m_ok[None, :] & n_ok[:, None]
        acc = shares_summed(tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), Partial, where, mask, M * N, SPLITS, True)
        return where, mask, acc

    globals()["split_shares_summed"] = split_shares_summed

    @triton.jit
    def arrived(Counters, SPLITS: tl.constexpr):
        # (this program's output tile, whether it is the tile's last split to arrive): the barrier puts every thread's
        # stores before the count, released at GPU scope; the last one's acquire makes the others' shares visible
        tl.debug_barrier()
        tile = tl.program_id(0) * tl.num_programs(2) + tl.program_id(2)
        return tile, tl.atomic_add(Counters + tile, 1, sem="acq_rel", scope="gpu") == SPLITS - 1

    globals()["arrived"] = arrived

    @triton.jit
    def sum_if_last(Partial, Bias, Final, Counters, n, m, n_ok, m_ok, M, N, SPLITS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr, XQ: tl.constexpr,
                    EXACT: tl.constexpr):
        # after a program stored its split's share: the tile's last program to arrive (its counter says so) sums
        # the SPLITS shares in order, adds the bias, rounds once, writes Final and sets the counter back to 0 for
        # the next launch. The barrier puts every thread's stores before the count (released at GPU scope); the
        # last program's shares are read through L2 (.cg) after its acquire, as CUTLASS's split-K semaphore does.
        tile, last = arrived(Counters, SPLITS)
        if last:
            where, mask, acc = split_shares_summed(Partial, n, m, n_ok, m_ok, M, N, SPLITS, BLOCK_N, BLOCK_M)
            if HAS_BIAS:
                acc += tl.load(Bias + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(Final + where, rounded(acc, XQ, EXACT).to(Final.dtype.element_ty), mask=mask)
            tl.atomic_xchg(Counters + tile, 0, sem="relaxed", scope="gpu")

    globals()["sum_if_last"] = sum_if_last

    @triton.jit
    def nf4_tiles(X, Packed, Absmax, Code2, Absmax2, Offset, Lut, Bias, Out, M, N, K, stride_x, per_split,
                  BLOCKSIZE2: tl.constexpr, HALF: tl.constexpr, NB: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_M: tl.constexpr, NESTED: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                  WQ: tl.constexpr, XQ: tl.constexpr, EXACT: tl.constexpr, EVEN: tl.constexpr,
                  SHUFFLE: tl.constexpr = False, Final=None, Counters=None, SPLITS: tl.constexpr = 0, First=None,
                  Second=None, SharesA=None, R=0, lora_scale=1.0, RP: tl.constexpr = 16, LORA: tl.constexpr = False):
        # out[m, n] (or split s's share, fp32) = sum over this split's k of x[m, k] * W[n, k]; W[n, k] is the
        # nibble k % 2 (high first) of byte n * K/2 + k // 2, times absmax[(n * K + k) // blocksize].
        # On 2-D tiles only: the packed bytes read as int32 words, [BLOCK_N, KW] a step (KH bytes a row, contiguous
        # along k), each word's 8 nibbles looked up straight from the word shifted (one shift and one lookup a
        # weight, no byte unpacking, no mask: `nibble`) and joined back into [BLOCK_N, 2 KH] in the row's order
        # (`word_weights`), so x's [2 KH, BLOCK_M] tile is read along k in 16-byte loads; each block's scale, a
        # [BLOCK_N] vector, is spread over its HALF / 4 words by selects. The table lookups: loads of Lut, or
        # (SHUFFLE, compiled only) warp shuffles: every thread holds, once, the table value of its lane, and each
        # lookup reads the one held by the lane the code names, no address and no memory.
        # benchmarks/nf4_sass.py counts the loop's instructions (benchmarks/NOTES.md).
        # LORA (bf16): the member's LoRA branch too. Each step also multiplies x's tile by the first factor's rows
        # (First [R, K], bf16, RP of them) into rank-space sums; where the tile's output is written (the last split
        # to finish, or the only one), both are rounded and the second step is done on the tile (`with_second`).
        KH: tl.constexpr = NB * HALF  # packed bytes per row per step
        KW: tl.constexpr = KH // 4  # words per row per step (HALF >= 16 bytes)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        n_ok, m_ok = n < N, m < M
        blocks = K // (2 * HALF)  # per weight row
        row = blocks * HALF  # packed bytes per weight row: a multiple of HALF, so Triton vectorizes the row loads
        j = tl.arange(0, KW)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        r = tl.arange(0, RP)
        r_ok = r < R
        acc_a = tl.zeros((RP, BLOCK_M), dtype=tl.float32)
        start = tl.program_id(1) * per_split
        end = tl.multiple_of(tl.minimum(start + per_split, row), HALF)  # (per_split: whole steps)
        offset = tl.load(Offset) if NESTED else 0.0
        words = Packed.to(tl.pointer_type(tl.int32)) + n[:, None] * (row // 4) + j[None, :]
        if EVEN:  # every step whole: only rows masked, so each thread loads 16 contiguous bytes at once
            following = tl.load(words + start // 4, mask=n_ok[:, None], other=0)
        else:
            following = tl.load(words + start // 4, mask=n_ok[:, None] & (start // 4 + j < end // 4)[None, :],
                                other=0)
        held = lane_table(Lut, following) if SHUFFLE else following
        for kh in range(start, end, KH):
            # the next step's words, in flight while this step's are decoded (with num_stages > 1 Triton's
            # pipeliner would stage the table lookups through shared memory instead, 4 bytes a copy)
            w = following
            if EVEN:  # the last step reloads its own words rather than read past the split
                following = tl.load(words + tl.minimum(kh + KH, end - KH) // 4, mask=n_ok[:, None], other=0)
            else:
                following = tl.load(words + (kh + KH) // 4,
                                    mask=n_ok[:, None] & ((kh + KH) // 4 + j < end // 4)[None, :], other=0)
            scale = block_scales(Absmax, Code2, Absmax2, offset, n, n_ok, blocks, kh, 4 * j, BLOCKSIZE2, HALF, NB,
                                 BLOCK_N, KW, NESTED)
            weights = word_weights(held, Lut, w, scale, WQ, XQ, X.dtype.element_ty, EXACT, SHUFFLE)
            if LORA:
                xs = x_tile(X, m, m_ok, stride_x, kh, end, KH, EVEN, EXACT)
                acc = tl.dot(weights, xs, acc)
                acc_a = first_times_x(acc_a, First, r, r_ok, K, xs, kh, end, KH, EVEN, EXACT)
            else:
                acc = times_x(acc, weights, X, m, m_ok, stride_x, kh, end, KH, EVEN, EXACT)
        if LORA and not PARTIAL:
            with_second(acc, acc_a, Second, Bias, Out, n, m, n_ok, m_ok, r, r_ok, M, N, R, lora_scale, HAS_BIAS,
                        EXACT)
        else:
            store_tile(acc, Out, Bias, n, m, n_ok, m_ok, M, N, PARTIAL, HAS_BIAS, XQ, EXACT)
        if LORA and PARTIAL:  # (a LoRA launch that splits K always has counters)
            tile = tl.program_id(0) * tl.num_programs(2) + tl.program_id(2)
            tl.store(SharesA + ((tile * SPLITS + tl.program_id(1)) * RP + r[:, None]) * BLOCK_M
                     + tl.arange(0, BLOCK_M)[None, :], acc_a)
            lora_sum_if_last(Out, SharesA, Second, Bias, Final, Counters, n, m, n_ok, m_ok, r, r_ok, M, N, R,
                             lora_scale, SPLITS, RP, BLOCK_N, BLOCK_M, HAS_BIAS, EXACT)
        elif SPLITS:  # the splits summed by the last of them to finish (else by nf4_splits, a second kernel)
            sum_if_last(Out, Bias, Final, Counters, n, m, n_ok, m_ok, M, N, SPLITS, BLOCK_N, BLOCK_M, HAS_BIAS, XQ,
                        EXACT)

    return nf4_tiles, nf4_splits
