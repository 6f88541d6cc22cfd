"""A 4-bit token step's projections at Qwen3-VL-8B's language shapes: bitsandbytes' `Linear4bit` forward, its
dequantize + matmul, and vlmrl's nf4 kernels (the first design, `nf4_matmul_v1` in benchmarks/variants/nf4_v1.py,
"nf4 kernel", and the product's, `vlmrl.engine.rollout.nf4.nf4_matmul`, "nf4 kernel v2"), beside the weight-read
floor.

For each batch of rows (1, 8, 32: token rows of a decode step) and dtype, one token step is the 36 layers x 7
projections (q, k, v, o, gate, up, down) over random nf4 weights (double quantisation, blocksize 64), each call
reading its own weights from memory. Timed with CUDA events after warm-up, eagerly (host launch overhead
included) and replayed as one CUDA graph (GPU time, as a compiled decode step runs), with the dense bf16 matmul
for scale. The floor: the packed weights and their absmax codes over the measured device copy bandwidth.
Numerics: each projection's kernel output against dequantize + matmul, in units of the last place; the exit
status is 1 when one is over a unit (as tests/test_nf4.py counts them) or a kernel fell back.
The sweep times each kernel's tile settings per distinct shape (CUDA graph of 36 calls over the 36 layers'
weights), to choose `nf4_v1._config`'s and `nf4_settings.config`'s defaults; each kernel's compiles are bounded by
`--sweep-seconds`; then the whole token step runs with each shape's best setting, beside the defaults timed again,
with those settings' numerics (a tuned table's worth, less the sweep's best-of-many noise). `--kernels v2`
measures the second design alone.

    python benchmarks/nf4_matmul.py OUTDIR     (one CUDA GPU, bitsandbytes installed; ~10 minutes, two sweeps)
    TRITON_INTERPRET=1 python benchmarks/nf4_matmul.py OUTDIR --hidden 128 --intermediate 256 --layers 2 \\
        --heads 2 --kv-heads 1 --head-dim 64 --rows 1,4 --no-dense --sweep-seconds 20     (the code paths, CPU)

Writes OUTDIR/nf4_matmul.json and OUTDIR/nf4_matmul.md.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
SHAPES = json.loads((ROOT / "src/vlmrl/preflight/shapes/qwen3_vl_8b.json").read_text())["text_config"]


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", type=Path, help="output folder (nf4_matmul.json, nf4_matmul.md)")
    p.add_argument("--rows", default="1,8,32", help="token rows per step, comma-separated")
    p.add_argument("--dtypes", default="bfloat16,float16", help="activation dtypes, comma-separated")
    p.add_argument("--layers", type=int, default=SHAPES["num_hidden_layers"])
    p.add_argument("--hidden", type=int, default=SHAPES["hidden_size"])
    p.add_argument("--intermediate", type=int, default=SHAPES["intermediate_size"])
    p.add_argument("--heads", type=int, default=SHAPES["num_attention_heads"])
    p.add_argument("--kv-heads", type=int, default=SHAPES["num_key_value_heads"])
    p.add_argument("--head-dim", type=int, default=SHAPES["head_dim"])
    p.add_argument("--replays", type=int, default=10, help="timed repeats of a token step")
    p.add_argument("--no-dense", action="store_true", help="skip the dense bf16 matmul (saves 2 bytes per weight)")
    p.add_argument("--sweep-seconds", type=float, default=240.0, help="time for each kernel's tile sweep (0: none)")
    p.add_argument("--kernels", default="v1,v2", help="vlmrl's nf4 kernels to measure (v1: the first "
                   "design, nf4_v1.nf4_matmul_v1; v2: the product's, nf4.nf4_matmul; pairs: the product's with one "
                   "table lookup a byte, nf4_pairs.nf4_matmul_pairs; loads: the product's with its lookups as table "
                   "loads, nf4_loads.nf4_matmul_loads; shuffle: the product's with its warp shuffles forced on, "
                   "unchecked, nf4_loads.nf4_matmul_shuffle; bytes: the product's loop before it read 32-bit "
                   "words, a byte at a time, nf4_bytes.nf4_matmul_bytes), comma-separated")
    p.add_argument("--lora", type=int, default=0, help="a LoRA branch of this rank on every projection (0: none): "
                   "the product's kernel then also runs with the branch as PEFT's ops, folded into its last "
                   "pass, and with only its scale and sum there (benchmarks/variants/nf4_lora.py)")
    return p.parse_args(argv)


def projections(a: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(name, out, in) of one layer's projections."""
    q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
    return [("q", q, a.hidden), ("k", kv, a.hidden), ("v", kv, a.hidden), ("o", a.hidden, q),
            ("gate", a.intermediate, a.hidden), ("up", a.intermediate, a.hidden), ("down", a.hidden, a.intermediate)]


def timed_ms(step: Callable[[], object], replays: int, graph: bool) -> float:
    """ms per call of `step`: after warm-up, `replays` calls (or replays of one CUDA graph of it) between events."""
    if not torch.cuda.is_available():
        step()
        start = time.perf_counter()
        for _ in range(replays):
            step()
        return (time.perf_counter() - start) * 1e3 / replays
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    run = step
    if graph:
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            step()
        run = cuda_graph.replay
        run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second a device-to-device copy moves (read + write)."""
    n = (1 << 30) if device.type == "cuda" else (1 << 26)
    src, dst = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    ms = timed_ms(lambda: dst.copy_(src), 10, graph=False)
    return 2 * n / (ms / 1e3)


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between a and b in representable values of their 16-bit dtype."""
    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return int((ordered(a) - ordered(b)).abs().max())


def units(got: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor) -> float:
    """Largest |got - expected| in units in the last place at max(|expected|, 2^-12 * scale), `scale` each output's
    sum of |x * w|: below that, the fp32 sum's own rounding, in any order, can pass a unit (tests/test_nf4.py)."""
    mantissa = {torch.bfloat16: 7, torch.float16: 10}[got.dtype]
    at = torch.maximum(expected.float().abs(), scale * 2.0 ** -12)
    unit = torch.ldexp(torch.ones_like(at), torch.frexp(at).exponent - 1 - mantissa)
    unit = unit.clamp(min=torch.finfo(got.dtype).smallest_normal * 2.0 ** -mantissa)
    return float(((got.float() - expected.float()).abs() / unit).max())


def build(a: argparse.Namespace, device: torch.device, bnb: object) -> list[tuple[str, torch.nn.Module]]:
    """The layers' nf4 `Linear4bit`s, quantized from random bf16 weights on the device (as the loader does)."""
    layers = []
    for layer in range(a.layers):
        for name, n, k in projections(a):
            torch.manual_seed(1000 * layer + len(layers))
            module = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                                       compress_statistics=True)
            weight = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
            module.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4",
                                              compress_statistics=True, blocksize=64)
            module = module.to(device)
            module.support_avx512bf16_for_cpu = False  # keep bitsandbytes' layout on a CPU
            layers.append((name, module.eval()))
    return layers


def weight_bytes(module: torch.nn.Module) -> int:
    qs = module.weight.quant_state
    return (module.weight.numel() * module.weight.element_size() + qs.absmax.numel() * qs.absmax.element_size()
            + qs.state2.absmax.numel() * 4)


# per kernel: its label, module, function and config chooser ("module:name"); all but the first design's take the
# product's settings for the shape
SETTINGS = "vlmrl.engine.rollout.nf4_settings:config"
KERNELS = {"v1": ("nf4 kernel", "variants.nf4_v1", "nf4_matmul_v1", "variants.nf4_v1:_config"),
           "v2": ("nf4 kernel v2", "vlmrl.engine.rollout.nf4", "nf4_matmul", SETTINGS),
           "pairs": ("nf4 kernel, one lookup a byte", "variants.nf4_pairs", "nf4_matmul_pairs", SETTINGS),
           "loads": ("nf4 kernel v2, lookups by table loads", "variants.nf4_loads", "nf4_matmul_loads", SETTINGS),
           "shuffle": ("nf4 kernel, lookups by warp shuffle", "variants.nf4_loads", "nf4_matmul_shuffle", SETTINGS),
           "bytes": ("nf4 kernel, a byte decoded at a time", "variants.nf4_bytes", "nf4_matmul_bytes", SETTINGS)}


def _column(kernel: str) -> str:
    """The numerics' key prefix of a KERNELS entry ("kernel" for the first design, as its records have it)."""
    return "kernel" if kernel == "v1" else f"kernel_{kernel}"


# per kernel: packed bytes per weight row per step, and pipeline stages (1: Triton's pipeliner off, which
# otherwise stages every table lookup through shared memory, 4 bytes a copy: nf4_settings.rule_config)
SWEEP = {"v1": {"tiles": (64, 128), "stages": (1, 2, 3)}, "v2": {"tiles": (32, 64, 128), "stages": (1, 3)},
         "pairs": {"tiles": (32, 64, 128), "stages": (1, 3)},
         "loads": {"tiles": (32, 64, 128), "stages": (1, 3)}, "shuffle": {"tiles": (32, 64, 128), "stages": (1, 3)},
         "bytes": {"tiles": (32, 64, 128), "stages": (1, 3)}}


LORA_SCALE = 1.0  # lora_alpha / r of the seed recipe (r = alpha = 16)


def step_methods(layers: list, inputs: dict[int, torch.Tensor], dense: list | None, bnb: object,
                 nf4: object, kernels: list[str] = ("v1",), branches: list | None = None,
                 ) -> dict[str, Callable[[], object]]:
    """One token step (every projection once) per method; with `branches` ((A, B) per layer), the product's kernel
    with that LoRA branch too."""
    def deq(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        w = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
        return F.linear(x, w.to(x.dtype))

    def kernel(matmul: Callable) -> Callable[[], object]:
        return lambda: [matmul(inputs[m.in_features], m.weight) for _, m in layers]

    methods = {
        "Linear4bit forward": lambda: [m(inputs[m.in_features]) for _, m in layers],
        "dequantize + matmul": lambda: [deq(m, inputs[m.in_features]) for _, m in layers],
    }
    for name in kernels:
        methods[KERNELS[name][0]] = kernel(_kernel(name)[0])
    if branches:
        from variants.nf4_lora import nf4_lora_matmul, nf4_summed_matmul

        # PEFT's branch as a compiled decode step runs it: two matmuls, then the scale and sum in one kernel
        add = torch.compile(lambda base, lora: base + lora * LORA_SCALE) if torch.cuda.is_available() else (
            lambda base, lora: base + lora * LORA_SCALE)
        methods["nf4 kernel v2 + LoRA, PEFT's ops"] = lambda: [
            add(nf4.nf4_matmul(inputs[m.in_features], m.weight),
                F.linear(F.linear(inputs[m.in_features], a), b)) for (_, m), (a, b) in zip(layers, branches)]
        methods["nf4 kernel v2 + LoRA folded"] = lambda: [
            nf4_lora_matmul(inputs[m.in_features], m.weight, None, F.linear(inputs[m.in_features], a), b, LORA_SCALE)
            for (_, m), (a, b) in zip(layers, branches)]
        methods["nf4 kernel v2 + LoRA, sum in the split pass"] = lambda: [
            nf4_summed_matmul(inputs[m.in_features], m.weight, None, F.linear(F.linear(inputs[m.in_features], a), b),
                              LORA_SCALE) for (_, m), (a, b) in zip(layers, branches)]
    if dense is not None:
        methods["dense bf16 matmul"] = lambda: [F.linear(inputs[w.shape[1]].to(w.dtype), w) for w in dense]
    return methods


def sweep(a: argparse.Namespace, layers: list, rows_list: list[int], dtype: torch.dtype, bandwidth: float,
          nf4: object, device: torch.device, kernel: str = "v1") -> list[dict]:
    """Per distinct (out, in) and rows: the kernel's time for each tile setting, 36 calls over distinct weights."""
    if a.sweep_seconds <= 0:
        return []
    matmul, chooser = _kernel(kernel)
    deadline = time.monotonic() + a.sweep_seconds
    by_shape: dict[tuple[int, int], list] = {}
    for _, m in layers:
        by_shape.setdefault((m.out_features, m.in_features), []).append(m)
    results = []
    cells = [(n, k, rows) for (n, k) in by_shape for rows in rows_list]
    for index, (n, k, rows) in enumerate(cells):
        modules = by_shape[(n, k)][: a.layers]
        bytes_ = sum(weight_bytes(m) for m in modules)
        # each (shape, rows) gets an equal share of the time left; settings nearest the default go first (one
        # field changed, then two, ...), so a short sweep still answers "does one stage / other warps help"
        cell_deadline = time.monotonic() + (deadline - time.monotonic()) / (len(cells) - index)
        x = torch.randn(rows, k, device=device).to(dtype)
        default = chooser(rows, n, k, 64, device)
        # four times the splits too: the tile kernel sums its splits itself now, so more of them cost no launches
        splits = sorted({max(1, default[4] // 2), default[4], default[4] * 2, default[4] * 4})
        grid = [[block_n, tile, warps, stages, split] for block_n in (32, 64, 128)
                for tile in SWEEP[kernel]["tiles"] for warps in (4, 8)
                for stages in SWEEP[kernel]["stages"] for split in splits]
        grid = sorted((c for c in grid if c != default),
                      key=lambda c: sum(v != d for v, d in zip(c, default, strict=True)))
        tried = []
        for config in grid:
            if time.monotonic() > cell_deadline:
                break
            tried.append(_time_config(modules, x, config, a.replays, nf4, matmul) | {"config": config})
        timed = [t for t in tried if "ms" in t]
        default_ms = _time_config(modules, x, default, a.replays, nf4, matmul).get("ms")
        best = min(timed, key=lambda t: t["ms"]) if timed else None
        calls = len(modules)
        results.append({
            "kernel": kernel, "out": n, "in": k, "rows": rows, "calls": calls, "default": default,
            "default_us": None if default_ms is None else 1e3 * default_ms / calls,
            "best": best and best["config"], "best_us": best and 1e3 * best["ms"] / calls,
            "floor_us": 1e6 * bytes_ / len(modules) / bandwidth, "tried": len(tried),
            "failed": [t for t in tried if "error" in t][:3]})
    return results


@contextlib.contextmanager
def fp32_reductions() -> Iterator[None]:
    """cuBLAS's reduced-precision split-K reductions off within: dequantize + matmul then sums in fp32."""
    flags = torch.backends.cuda.matmul
    saved = flags.allow_bf16_reduced_precision_reduction, flags.allow_fp16_reduced_precision_reduction
    flags.allow_bf16_reduced_precision_reduction = flags.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        flags.allow_bf16_reduced_precision_reduction, flags.allow_fp16_reduced_precision_reduction = saved


def reference(m: torch.nn.Module, x: torch.Tensor, dtype: torch.dtype, bnb: object) -> tuple[torch.Tensor, ...]:
    """(the dequantized weight in `dtype`, dequantize + matmul of x, each output's sum of |x w|: the unit's scale)."""
    weight = bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state).to(dtype)
    return weight, F.linear(x, weight), x.float().abs() @ weight.float().abs().T


def tuned(a: argparse.Namespace, layers: list, swept: list[dict], dtype: torch.dtype, bnb: object, nf4: object,
          device: torch.device) -> list[dict]:
    """The whole token step with each shape's best setting from the sweep, beside the defaults timed again in the
    same stretch (the sweep's per-call bests, summed, carry its noise: the best of many draws), and those settings'
    numerics over one layer: what a tuned table of settings would be worth, and whether it stays within a unit."""
    rows_done = []
    for kernel in dict.fromkeys(entry["kernel"] for entry in swept):
        matmul, _ = _kernel(kernel)
        for rows in dict.fromkeys(entry["rows"] for entry in swept if entry["kernel"] == kernel):
            best = {(e["out"], e["in"]): e["best"] for e in swept
                    if e["kernel"] == kernel and e["rows"] == rows and e["best"]
                    and e["best_us"] is not None and e["default_us"] is not None and e["best_us"] < e["default_us"]}
            inputs = {k: torch.randn(rows, k, device=device).to(dtype) for k in {m.in_features for _, m in layers}}

            def step(configs: dict, pick: list = layers, matmul: Callable = matmul, inputs: dict = inputs) -> list:
                return [matmul(inputs[m.in_features], m.weight, config=configs.get((m.out_features, m.in_features)))
                        for _, m in pick]

            entry = {"kernel": kernel, "rows": rows, "dtype": str(dtype).removeprefix("torch."),
                     "configs": {f"{n} x {k}": c for (n, k), c in best.items()}}
            _fallbacks(nf4).clear()
            for name, configs in (("default_ms", {}), ("tuned_ms", best), ("default_again_ms", {})):
                entry[name] = timed_ms(lambda configs=configs: step(configs), a.replays, graph=device.type == "cuda")
            entry["fell_back"] = bool(_fallbacks(nf4))
            with fp32_reductions():
                entry["tuned_units"] = max(
                    units(got, *reference(m, inputs[m.in_features], dtype, bnb)[1:])
                    for (_, m), got in zip(layers[:7], step(best, layers[:7]), strict=True))
            rows_done.append(entry)
            print(json.dumps(entry), flush=True)
    return rows_done


class _fallbacks:
    """The fallbacks the product's kernel recorded (`nf4._failed`) and the variants' (`variants.nf4_launch._failed`:
    the first design's, the LoRA branch's), as one record to read and clear."""

    def __init__(self, nf4: object):
        from variants import nf4_launch

        self.records = (nf4._failed, nf4_launch._failed)

    def clear(self) -> None:
        for record in self.records:
            record.clear()

    def items(self) -> list:
        return [item for record in self.records for item in record.items()]

    def values(self) -> list:
        return [why for _, why in self.items()]

    def __bool__(self) -> bool:
        return any(self.records)


def _kernel(name: str) -> tuple[Callable, Callable]:
    """A kernel's (matmul, config chooser), by KERNELS' name."""
    _, module, function, chooser = KERNELS[name]
    settings, setting = chooser.split(":")
    return getattr(importlib.import_module(module), function), getattr(importlib.import_module(settings), setting)


def _time_config(modules: list, x: torch.Tensor, config: list[int], replays: int, nf4: object,
                 matmul: Callable) -> dict:
    _fallbacks(nf4).clear()
    try:
        ms = timed_ms(lambda: [matmul(x, m.weight, config=config) for m in modules], replays,
                      graph=x.is_cuda)
    except Exception as error:  # noqa: BLE001 (a setting Triton cannot build: recorded, the sweep goes on)
        return {"error": f"{type(error).__name__}: {str(error)[:200]}"}
    if _fallbacks(nf4):  # the op fell back to torch: not the kernel's time
        return {"error": next(iter(_fallbacks(nf4).values()))[:200]}
    return {"ms": ms}


def main(argv: list[str]) -> int:
    a = parse(argv)
    import bitsandbytes as bnb

    from vlmrl.engine.rollout import nf4

    a.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows_list = [int(r) for r in a.rows.split(",")]
    dtypes = [getattr(torch, d) for d in a.dtypes.split(",")]
    kernels = [name for name in a.kernels.split(",") if name]
    unknown = sorted(set(kernels) - set(KERNELS))
    if unknown:
        raise SystemExit(f"unknown kernel(s) {', '.join(unknown)}: choose from {', '.join(KERNELS)}")
    import triton

    result: dict = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "interpreted": nf4.interpreted(), "torch": torch.__version__, "triton": triton.__version__,
        "bitsandbytes": bnb.__version__, "kernels": kernels, "layers": a.layers,
        "projections": [p[0] for p in projections(a)],
        "unsupported": None, "steps": [], "numerics": []}
    bandwidth = copy_bandwidth(device)
    result["copy_tb_per_s"] = bandwidth / 1e12
    layers = build(a, device, bnb)
    weight_total = sum(weight_bytes(m) for _, m in layers)
    result["nf4_bytes"] = weight_total
    result["floor_ms"] = 1e3 * weight_total / bandwidth
    result["unsupported"] = nf4.unsupported_reason(torch.nn.ModuleList([m for _, m in layers]))
    dense = None
    if not a.no_dense:
        dense = [torch.randn(m.out_features, m.in_features, device=device, dtype=torch.bfloat16) for _, m in layers]
        result["bf16_floor_ms"] = 1e3 * sum(w.numel() * 2 for w in dense) / bandwidth
    with torch.no_grad():
        for dtype in dtypes:
            for _, m in layers:  # the weights as if loaded in this dtype: bitsandbytes dequantizes to it
                m.weight.quant_state.dtype = m.compute_dtype = dtype
            torch.manual_seed(7)
            branches = [((torch.randn(a.lora, m.in_features, device=device) * m.in_features ** -0.5).to(dtype),
                         (torch.randn(m.out_features, a.lora, device=device) * 0.02).to(dtype))
                        for _, m in layers] if a.lora else None
            for rows in rows_list:
                inputs = {k: torch.randn(rows, k, device=device).to(dtype) for k in {a.hidden, a.intermediate,
                                                                                     a.heads * a.head_dim}}
                for method, step in step_methods(layers, inputs, dense, bnb, nf4, kernels, branches).items():
                    entry = {"dtype": str(dtype).removeprefix("torch."), "rows": rows, "method": method}
                    for mode in ("eager", "graph"):
                        try:
                            entry[f"{mode}_ms"] = timed_ms(step, a.replays, graph=mode == "graph")
                        except Exception as error:  # noqa: BLE001 (recorded: a method a CUDA graph cannot hold)
                            entry[f"{mode}_error"] = f"{type(error).__name__}: {str(error)[:200]}"
                    result["steps"].append(entry)
                    print(json.dumps(entry), flush=True)
                result["numerics"].append(numerics(layers[:7], inputs, dtype, rows, bnb, nf4, kernels,
                                                   branches and branches[:7]))
            result["fallbacks"] = {str(where): why for where, why in _fallbacks(nf4).items()}  # JSON keys
        result["sweep"] = [entry for kernel in kernels
                           for entry in sweep(a, layers, rows_list, dtypes[0], bandwidth, nf4, device, kernel)]
        result["tuned"] = tuned(a, layers, result["sweep"], dtypes[0], bnb, nf4, device)
    (a.out / "nf4_matmul.json").write_text(json.dumps(result, indent=1, default=str))
    (a.out / "nf4_matmul.md").write_text(markdown(result))
    print(markdown(result))
    worst = max((value for n in result["numerics"] for key, value in n.items()
                 if key.startswith("kernel") and key.endswith("_units")), default=0.0)
    worst = max([worst] + [n[key] for n in result["numerics"] for key in ("folded_units", "summed_units") if key in n]
                + [t["tuned_units"] for t in result["tuned"]])
    return 0 if worst <= 1 and not result["fallbacks"] else 1


def numerics(layers: list, inputs: dict, dtype: torch.dtype, rows: int, bnb: object, nf4: object,
             kernels: list[str] = ("v1",), branches: list | None = None) -> dict:
    """Largest ulps over one layer's projections: the kernels ("kernel": v1, "kernel_v2"), and `Linear4bit` itself,
    against dequantize + matmul (summed in fp32: cuBLAS's reduced-precision split-K reductions off); with
    `branches`, the folded LoRA branch ("folded") and the one summed in the split pass ("summed") against PEFT's
    eager sum over dequantize + matmul, its unit taken at the larger term too (as the CPU tests of the fold did,
    tests/test_nf4_lora.py in git history)."""
    names = {k: _column(k) for k in KERNELS}
    found = {f"{names[k]}_{what}": zero for k in kernels for what, zero in (("ulps", 0), ("units", 0.0))}
    found |= {"linear4bit_ulps": 0, "linear4bit_units": 0.0}
    with fp32_reductions():
        for i, (_, m) in enumerate(layers):
            found = _numerics_of(found, m, inputs[m.in_features], dtype, bnb, kernels, names,
                                 branches[i] if branches else None)
    return {"dtype": str(dtype).removeprefix("torch."), "rows": rows} | found


def _numerics_of(found: dict, m: torch.nn.Module, x: torch.Tensor, dtype: torch.dtype, bnb: object,
                 kernels: list[str], names: dict, branch: tuple | None) -> dict:
    """`found` with one projection's distances folded in (the largest so far of each)."""
    weight, expected, scale = reference(m, x, dtype, bnb)
    outputs = [(names[k], _kernel(k)[0](x, m.weight)) for k in kernels]
    for name, got in [*outputs, ("linear4bit", m(x))]:
        found[f"{name}_ulps"] = max(found[f"{name}_ulps"], ulps(got, expected))
        found[f"{name}_units"] = max(found[f"{name}_units"], units(got, expected, scale))
    # each side's own distance from the exact product (float64 sums of the same rounded weights): two sums a unit
    # from it each can be two units apart, so this says whose rounding a gap over one unit is
    exact = F.linear(x.double(), weight.double())
    for name, got in [*outputs, ("dequantize", expected)]:
        found[f"{name}_exact_units"] = max(found.get(f"{name}_exact_units", 0.0), units(got, exact, scale))
    if branch:
        from variants.nf4_lora import nf4_lora_matmul, nf4_summed_matmul

        first, second = branch
        xa = F.linear(x, first)
        lora = F.linear(xa, second) * LORA_SCALE
        terms = torch.maximum(expected.float().abs(), lora.float().abs())
        for name, got in (("folded", nf4_lora_matmul(x, m.weight, None, xa, second, LORA_SCALE)),
                          ("summed", nf4_summed_matmul(x, m.weight, None, F.linear(xa, second), LORA_SCALE))):
            found[f"{name}_ulps"] = max(found.get(f"{name}_ulps", 0), ulps(got, expected + lora))
            found[f"{name}_units"] = max(found.get(f"{name}_units", 0.0),
                                         units(got, expected + lora, torch.maximum(scale, terms * 2 ** 12)))
    return found


def _num(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def markdown(r: dict) -> str:
    floor = r["floor_ms"]
    bf16 = f" (bf16: {r['bf16_floor_ms']:.2f} ms)" if "bf16_floor_ms" in r else ""
    setup = (f"{r['device']}; torch {r['torch']}, triton {r['triton']}, bitsandbytes {r['bitsandbytes']}"
             f"{' (Triton interpreter)' if r['interpreted'] else ''}. Copy bandwidth {r['copy_tb_per_s']:.2f} TB/s; "
             f"nf4 weights {r['nf4_bytes'] / 2**30:.2f} GiB, floor **{floor:.2f} ms** per token step{bf16}.")
    lines = [f"# nf4 token step: {r['layers']} layers x {len(r['projections'])} projections", "", setup, "",
             "| dtype | rows | method | graph ms | eager ms | x floor (graph) |", "|---|---|---|---|---|---|"]
    for s in r["steps"]:
        graph = s.get("graph_ms")
        shown = _num(graph) if graph is not None else s.get("graph_error", "")[:60]
        lines.append(f"| {s['dtype']} | {s['rows']} | {s['method']} | {shown} | {_num(s.get('eager_ms'))} | "
                     f"{_num(graph and graph / floor, 1)} |")
    about = ("Numerics against dequantize + matmul over one layer's projections: the largest distance in "
             "representable values (ulps), and in units at max(|output|, 2^-12 sum |x w|) (units):")
    labels = [(_column(k), label) for k, (label, *_) in KERNELS.items()]
    shown = [(name, label) for name, label in (*labels, ("linear4bit", "Linear4bit forward"),
                                               ("folded", "v2 + LoRA folded, against PEFT's sum"),
                                               ("summed", "v2 + LoRA summed in the split pass, against PEFT's sum"))
             if any(f"{name}_ulps" in n for n in r["numerics"])]
    lines += ["", about, "", "| dtype | rows | " + " | ".join(f"{label} ulps | units" for _, label in shown) + " |",
              "|---|---|" + "---|---|" * len(shown)]
    lines += [f"| {n['dtype']} | {n['rows']} | "
              + " | ".join(f"{n.get(f'{name}_ulps', '')} | {_num(n.get(f'{name}_units'))}" for name, _ in shown)
              + " |" for n in r["numerics"]]
    exact = [(name, label) for name, label in (*labels, ("dequantize", "dequantize + matmul"))
             if any(f"{name}_exact_units" in n for n in r["numerics"])]
    if exact:
        lines += ["", ("Each one's own distance from the exact product (float64 sums of the same rounded weights), "
                       "in the same units:"), "", "| dtype | rows | " + " | ".join(label for _, label in exact) + " |",
                  "|---|---|" + "---|" * len(exact)]
        lines += [f"| {n['dtype']} | {n['rows']} | "
                  + " | ".join(_num(n.get(f"{name}_exact_units")) for name, _ in exact) + " |" for n in r["numerics"]]
    if r.get("fallbacks"):
        lines += ["", f"Kernel fallbacks: {r['fallbacks']}"]
    if r.get("unsupported"):
        lines += ["", f"`unsupported_reason`: {r['unsupported']}"]
    if r.get("sweep"):
        about = ("Tile sweep ([block_n, packed bytes per step (v1: tile_pairs, v2: block_kh), warps, stages, split]; "
                 "us per call over distinct weights):")
        lines += ["", about, "", "| kernel | out x in | rows | default | us | best | us | floor us | tried |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {s.get('kernel', 'v1')} | {s['out']} x {s['in']} | {s['rows']} | {s['default']} | "
                  f"{_num(s['default_us'], 1)} | {s['best']} | {_num(s['best_us'], 1)} | {s['floor_us']:.1f} | "
                  f"{s['tried']} |" for s in r["sweep"]]
    if r.get("tuned"):
        lines += ["", ("The whole token step with each shape's best setting from the sweep (shapes whose best beat "
                       "their default), the defaults timed before and after it, ms (graph on a GPU):"), "",
                  "| kernel | dtype | rows | defaults | tuned | defaults again | tuned units | settings |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {t['kernel']} | {t['dtype']} | {t['rows']} | {_num(t['default_ms'])} | {_num(t['tuned_ms'])} | "
                  f"{_num(t['default_again_ms'])} | {_num(t['tuned_units'])}{' (fell back)' if t['fell_back'] else ''} "
                  f"| {'; '.join(f'{shape}: {c}' for shape, c in t['configs'].items())} |" for t in r["tuned"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
