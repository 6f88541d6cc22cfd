"""Whether a Triton split-K kernel reads a token step's stacked bf16 projection weights closer to the bandwidth than
cuBLAS does, at Qwen3-VL-8B's four group shapes (an experiment: nothing in `src` uses it).

Why: in the H200 shape sweep (`results/h200_stacked_matmul_shapes.md`) cuBLAS reads the gate/up group at 3.8 TB/s
but o at 2.4, q/k/v at 3.05 and down at 3.2 (split-K kernels plus a separate reduction kernel), 114.9 us a layer
against 90.8 us at gate/up's rate: about 0.9 ms of a token step over 36 layers.

The kernel: out = x @ W.T for x [M, K] (M <= 64 token rows) and W [N, K] row-major, computed transposed (W's tile is
the tensor cores' wide operand, x's the narrow one) over a grid of (N tiles, K splits). Each program accumulates its
split's share in float32; with one split it rounds and stores, with several it stores the share and the tile's last
program to arrive (one atomic counter a tile) sums the shares in split order and stores the bf16 output, so there
is no second kernel and the sum's order is fixed. Each configuration (tile, K step, splits, pipeline stages, warps)
is timed as cuBLAS is in `stacked_matmul_shapes.py`: 64 calls in one CUDA graph cycling through 16 copies of W
(each call reads W from memory), 20 replays; its outputs are checked against float64 sums (in bf16 units).

Usage: python benchmarks/skinny_gemm.py OUTDIR [ROWS] [--no-sweep]   (CUDA; ROWS default 32; --no-sweep: cuBLAS, the
                                                                      path before and the product's group step only)
       python benchmarks/skinny_gemm.py --check           (the kernel against float64 sums, small shapes, any device;
                                                           on a CPU run it with TRITON_INTERPRET=1)
"""

from __future__ import annotations

import functools
import itertools
import json
import sys
from pathlib import Path

import torch
from stacked_matmul_shapes import graph_of, replay_us

GROUPS = {  # name: (the members' output widths, their LoRA ranks, in): Qwen3-VL-8B's stacked groups at rank 16
    "q/k/v": ([4096, 1024, 1024], [16, 16, 16], 4096),
    "o": ([4096], [16], 4096),
    "gate/up": ([12288, 12288], [16, 16], 4096),
    "down": ([4096], [16], 12288),
}
SCALE = 2.0  # lora_alpha / r
COPIES, CALLS, REPLAYS = 16, 64, 20


@functools.cache
def kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def skinny(X, W, Out, Partial, Counters, M, N, K, sxm, swn, per_split,
               BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
               DOT_F32: tl.constexpr):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        n_ok = n < N
        m_ok = m < M
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        start = tl.program_id(1) * per_split
        for k in range(start, start + per_split, BLOCK_K):
            kk = k + tl.arange(0, BLOCK_K)
            w = tl.load(W + n[:, None] * swn + kk[None, :], mask=n_ok[:, None], other=0.0)
            xt = tl.load(X + m[None, :] * sxm + kk[:, None], mask=m_ok[None, :], other=0.0)
            if DOT_F32:  # the interpreter's dot reads bf16 as integers: exact float32 copies there
                acc += tl.dot(w.to(tl.float32), xt.to(tl.float32))
            else:
                acc = tl.dot(w, xt, acc)
        where = m[None, :] * N + n[:, None]
        ok = m_ok[None, :] & n_ok[:, None]
        if SPLITS == 1:
            tl.store(Out + where, acc.to(Out.dtype.element_ty), mask=ok)
        else:
            tl.store(Partial + tl.program_id(1) * M * N + where, acc, mask=ok)
            tl.debug_barrier()
            seen = tl.atomic_add(Counters + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
            if seen == SPLITS - 1:
                total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                for s in tl.static_range(SPLITS):
                    total += tl.load(Partial + s * M * N + where, mask=ok, other=0.0, cache_modifier=".cg")
                tl.store(Out + where, total.to(Out.dtype.element_ty), mask=ok)
                tl.atomic_xchg(Counters + tl.program_id(0), 0, sem="relaxed", scope="gpu")

    return skinny


class Skinny:
    """One configuration's launch, with its buffers made before any CUDA graph capture."""

    def __init__(self, rows: int, n: int, k: int, device: torch.device, *, block_n: int, block_k: int, splits: int,
                 stages: int, warps: int):
        if k % (splits * block_k):
            raise ValueError(f"K={k} is not a multiple of splits x block_k = {splits * block_k}")
        self.rows, self.n, self.k = rows, n, k
        self.block_n, self.block_k, self.splits, self.stages, self.warps = block_n, block_k, splits, stages, warps
        self.block_m = max(16, 1 << (rows - 1).bit_length())
        self.tiles = -(-n // block_n)
        self.partial = torch.empty(splits, rows, n, device=device, dtype=torch.float32)
        self.counters = torch.zeros(self.tiles, device=device, dtype=torch.int32)
        self.out = torch.empty(rows, n, device=device, dtype=torch.bfloat16)

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        interpret = x.device.type == "cpu"
        kernel()[(self.tiles, self.splits)](
            x, w, self.out, self.partial, self.counters, self.rows, self.n, self.k, x.stride(0), w.stride(0),
            self.k // self.splits, BLOCK_N=self.block_n, BLOCK_M=self.block_m, BLOCK_K=self.block_k,
            SPLITS=self.splits, DOT_F32=interpret, num_warps=self.warps, num_stages=self.stages)
        return self.out

    def label(self) -> str:
        return f"n{self.block_n} k{self.block_k} s{self.splits} st{self.stages} w{self.warps}"


def block_second(outs: list[int], ranks: list[int], device: torch.device, seed: int = 0) -> torch.Tensor:
    """A group's block-diagonal second factors, as `stacked._Group.load` lays them out (small random values)."""
    gen = torch.Generator().manual_seed(seed)
    second = torch.zeros(sum(outs), sum(ranks))
    o = c = 0
    for out, rank in zip(outs, ranks, strict=True):
        second[o:o + out, c:c + rank] = torch.randn(out, rank, generator=gen) * 0.02
        o, c = o + out, c + rank
    return second.to(device, torch.bfloat16)


def fused_step(x: torch.Tensor, weight: torch.Tensor, second: torch.Tensor, scale: float, outs: tuple[int, ...],
               ranks: tuple[int, ...]) -> torch.Tensor:
    """The product's group step in one kernel (`vlmrl.engine.rollout.group_step`, its settings by rule)."""
    from vlmrl.engine.rollout import group_step

    windows = _windows(outs, ranks, x.device)
    return group_step.group_step(x, weight, None, second, scale, windows)


@functools.cache
def _windows(outs: tuple[int, ...], ranks: tuple[int, ...], device: torch.device):
    from vlmrl.engine.rollout import group_step

    return group_step.rank_windows(list(outs), list(ranks), device)


def product_step(x: torch.Tensor, weight: torch.Tensor, second: torch.Tensor, scale: float) -> torch.Tensor:
    """The path before: the stacked matmul on cuBLAS, then the second-step kernel (or, on a CPU, the same
    arithmetic unfused)."""
    from vlmrl.engine.rollout import second_factors

    stacked = torch.nn.functional.linear(x, weight)
    if second_factors.usable(stacked, second):
        return second_factors.stacked_second(stacked, second, scale)
    return second_factors.reference(stacked, second, scale)


def units(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """The largest distance of `out` from the float64 product, in bf16 units in the last place of the exact value
    (rounding to nearest is within 0.5, Triton's interpreter, which truncates, within 1), the unit floored at 2^-12
    of the row's sum of |x w| so that outputs near zero are not counted in tiny units."""
    exact = x.double() @ w.double().T
    scale = (x.double().abs() @ w.double().abs().T) * 2.0**-12
    unit = torch.maximum(torch.exp2(torch.floor(torch.log2(exact.abs())) - 7), scale)
    return float(((out.double() - exact).abs() / unit).max())


def configs(rows: int, n: int, k: int, sms: int) -> list[dict]:
    out = []
    for block_n, block_k, stages, warps in itertools.product((64, 128), (128, 256), (3, 5), (4,)):
        tiles = -(-n // block_n)
        for splits in (1, 2, 3, 4, 6, 8, 12, 16):
            programs = tiles * splits
            if k % (splits * block_k) or not sms <= programs <= 4 * sms:
                continue
            out.append({"block_n": block_n, "block_k": block_k, "splits": splits, "stages": stages, "warps": warps})
    return out


def timed(call, weights: list[torch.Tensor], x: torch.Tensor) -> float:
    """Microseconds per `call(x, w)`, CALLS of them cycling through `weights` in one CUDA graph."""
    graph, _ = graph_of([lambda w=weights[i % COPIES]: call(x, w) for i in range(CALLS)])
    return replay_us(graph, REPLAYS) / CALLS


def main(out: Path, rows: int, sweep: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    result: dict = {"device": torch.cuda.get_device_name(), "rows": rows, "groups": {}}
    lines = [(f"{result['device']}; {rows} token rows, bf16, each call reading its own copy of the group's weights "
              f"({COPIES} cycled in one CUDA graph); us per call, TB/s over the stacked weight; units: the largest "
              "distance from the exact float64 result (bf16 units, floored as `units` does) of the group step in one "
              "kernel and of the path before (cuBLAS's matmul, then the second-step kernel)"), "",
             ("| group | stacked rows x in | cuBLAS stacked matmul | + second-step kernel (the product) | "
              "Triton split-K, best | the product's group step (one kernel) | units from exact: it / the path before / "
              "outputs equal | split-K config | configs |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for name, (outs, ranks, k) in GROUPS.items():
        torch.manual_seed(0)
        width = sum(outs)
        n = width + sum(ranks)
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        second = block_second(outs, ranks, device)
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        mb = n * k * 2 / 1e6  # MB of the stacked weight: MB per us is TB/s
        cublas = timed(lambda x, w: torch.nn.functional.linear(x, w), weights, x)
        product = timed(lambda x, w, second=second: product_step(x, w, second, SCALE), weights, x)
        expected = product_step(x, weights[0], second, SCALE).clone()
        tried = []
        for c in configs(rows, n, k, sms) if sweep else []:
            call = Skinny(rows, n, k, device, **c)
            try:
                us = timed(call, weights, x)
                err = units(call(x, weights[0]).clone(), x, weights[0])
            except Exception as error:  # noqa: BLE001 (a config Triton cannot build: out of shared memory, say)
                tried.append({**c, "error": f"{type(error).__name__}: {str(error)[:200]}"})
                continue
            tried.append({**c, "us": us, "tb_per_s": mb / us, "units": err})
            print(f"{name} {call.label()}: {us:.1f} us, {err:.2f} units", flush=True)
        ok = sorted((t for t in tried if "us" in t), key=lambda t: t["us"])
        fused = timed(lambda x, w, second=second, outs=tuple(outs), ranks=tuple(ranks):
                      fused_step(x, w, second, SCALE, outs, ranks), weights, x)
        got = fused_step(x, weights[0], second, SCALE, tuple(outs), tuple(ranks)).clone()
        distances = {"fused": lora_units(got, x, weights[0], second, width),
                     "product": lora_units(expected, x, weights[0], second, width),
                     "equal": float((got == expected).float().mean())}
        print(f"{name} fused: {fused:.1f} us, {distances}", flush=True)
        best = ok[0] if ok else {"us": float("nan"), "block_n": "-", "block_k": "-", "splits": "-", "stages": "-",
                                 "warps": "-"}
        result["groups"][name] = {"outs": outs, "ranks": ranks, "k": k, "cublas_us": cublas, "product_us": product,
                                  "tried": tried, "best": best, "fused_us": fused, "units": distances}
        label = f"n{best['block_n']} k{best['block_k']} s{best['splits']} st{best['stages']} w{best['warps']}"
        fused_cells = (f"{fused:.1f} | {distances['fused']:.2f} / {distances['product']:.2f} / "
                       f"{100 * distances['equal']:.2f}%")
        lines.append(f"| {name} | {n} x {k} | {cublas:.1f} ({mb / cublas:.2f}) | {product:.1f} | "
                     f"{best['us']:.1f} ({mb / best['us']:.2f}) | {fused_cells} | {label} | {len(ok)} |")
        print(lines[-1], flush=True)
        (out / "skinny_gemm.json").write_text(json.dumps(result, indent=2))
        (out / "skinny_gemm.md").write_text("\n".join(lines) + "\n")


def lora_units(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, second: torch.Tensor, width: int) -> float:
    """`units` for a group step: the distance from base + SCALE * (x A^T) B^T in float64."""
    exact = x.double() @ weight[:width].double().T + SCALE * ((x.double() @ weight[width:].double().T)
                                                              @ second.double().T)
    scale = (x.double().abs() @ weight[:width].double().abs().T) * 2.0**-12
    unit = torch.maximum(torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7), scale)
    return float(((out.double() - exact).abs() / unit).max())


def check() -> tuple[float, float]:
    """The kernels at small shapes, one split and several: the split-K matmul against float64 sums (its largest
    distance in units), and the product's group step against the path before (how much farther from the exact
    result it is, in units)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    worst = worst_fused = 0.0
    for rows, n, k, splits in ((5, 70, 256, 1), (5, 70, 256, 2), (16, 64, 512, 4), (32, 130, 384, 3)):
        torch.manual_seed(rows + n)
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        call = Skinny(rows, n, k, device, block_n=64, block_k=64, splits=splits, stages=2, warps=4)
        for _ in range(2):  # the second launch finds the counters the first set back to zero
            worst = max(worst, units(call(x, w), x, w))
        if int(call.counters.abs().sum()):
            raise AssertionError("the split counters were not set back to zero")
    for outs, ranks in (([64, 32, 32], [4, 4, 4]), ([128], [8]), ([64, 128], [8, 8])):
        k = 384
        torch.manual_seed(len(outs))
        weight = torch.randn(sum(outs) + sum(ranks), k, device=device, dtype=torch.bfloat16) * 0.1
        second = block_second(outs, ranks, device)
        x = torch.randn(6, k, device=device, dtype=torch.bfloat16)
        expected = product_step(x, weight, second, SCALE)
        worst_fused = max(worst_fused, lora_units(fused_step(x, weight, second, SCALE, tuple(outs), tuple(ranks)),
                                                  x, weight, second, sum(outs))
                          - lora_units(expected, x, weight, second, sum(outs)))
    return worst, worst_fused


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        distance, fused_distance = check()
        limit = 0.6 if torch.cuda.is_available() else 1.05  # rounding to nearest, or the interpreter's truncation
        print(f"split-K matmul: largest distance from the float64 product {distance:.3f} bf16 units (limit {limit}); "
              f"group step: at most {fused_distance:.2f} units farther from the exact result than the path before (limit 1)")
        sys.exit(0 if distance <= limit and fused_distance <= 1 else 1)
    args = [a for a in sys.argv[1:] if a != "--no-sweep"]
    main(Path(args[0]), int(args[1]) if len(args) > 1 else 32, sweep="--no-sweep" not in sys.argv)
