"""The nf4 token-step kernel's machine code for sm_90, built offline (no GPU): instructions per weight in its loop.

Triton compiles `vlmrl.engine.rollout.nf4_triton`'s `nf4_tiles` for an H100/H200 target with the product's tile
settings (`nf4_settings.tile_shape`, `nf4_settings.block_rows`) and the integer specialisation a real launch gets
(pointers and sizes divisible by 16); the cubin is disassembled with the `nvdisasm` Triton ships, and the loop over K (the
instructions between the loop's label and its backward branch) is counted by opcode. One pass of the loop decodes
block_n x tile packed bytes over `warps` x 32 threads, so instructions per weight = loop instructions / (that
many weights a thread). Also: registers per thread and spills, from `cuobjdump -res-usage`.

This is where a design's cost can be read without a GPU: the loop's count bounds its speed from below (an H200
issues 4 warp instructions a clock per SM). It says nothing of latency or memory stalls, which only a GPU run
shows (benchmarks/nf4_matmul.py).

    python benchmarks/nf4_sass.py [--rows 32] [--blocksize 64] [--dtype bfloat16] [--top 12] [--json FILE]
    python benchmarks/nf4_sass.py --tuned [--json FILE]    each tile of nf4_settings.TUNED_SM90, a table row each
    python benchmarks/nf4_sass.py --tuned --kernel pairs    the same tiles of the variant with one lookup a byte
    python benchmarks/nf4_sass.py --tuned --kernel loads    ... of the product's with table loads, not shuffles
    python benchmarks/nf4_sass.py --tuned --kernel bytes    ... of the product's loop before it read words

Needs Triton with its NVIDIA backend (the CPU wheel carries ptxas and nvdisasm); exits 2 with one line without.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[0-9T]+\s+)?([A-Z][A-Za-z0-9_.]*)")


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcodes between the label the last predicated backward branch jumps to and that branch (the K loop)."""
    lines = sass.splitlines()
    branches = [i for i, line in enumerate(lines) if re.search(r"@!?P\d+\s+BRA\s+`?\(?(\.L_x_\d+)", line)]
    for end in reversed(branches):
        label = re.search(r"(\.L_x_\d+)", lines[end]).group(1)
        start = next((i for i, line in enumerate(lines) if line.startswith(label + ":")), None)
        if start is not None and start < end:  # a backward branch: the loop
            return collections.Counter(m.group(1) for line in lines[start:end + 1] if (m := OPCODE.search(line)))
    raise SystemExit("no loop found in the disassembly")


SPLIT_SUM_STEPS = (("stores", re.compile(r"st\.global\.")), ("barrier", re.compile(r"bar\.sync")),
                   ("count (acquire, release)", re.compile(r"atom\.global\.gpu\.acq_rel\.add")),
                   ("shares read through L2", re.compile(r"ld\.global\.cg")),
                   ("counter reset", re.compile(r"atom\.global\.gpu\.relaxed\.exch")))


def split_sum_order(ptx: str) -> list[str]:
    """The split sum's memory steps in the order the PTX has them, each run of one kind once (`SPLIT_SUM_STEPS`):
    what the last split to finish reads is ordered by these (a split's shares stored, a barrier, the count, a
    barrier, the shares read)."""
    order: list[str] = []
    for line in ptx.splitlines():
        kind = next((name for name, pattern in SPLIT_SUM_STEPS if pattern.search(line)), None)
        if kind is not None and (not order or order[-1] != kind):
            order.append(kind)
    return order


def build(rows: int, blocksize: int, dtype: str, shape: tuple[int, int, int] | None = None,
          design: str = "v2", splits: int = 0) -> dict:
    """The loop's counts for the rule's tile at `rows` (`nf4_settings.tile_shape`), or `shape` = (block_n, packed
    bytes a step, warps) given (one of `nf4_settings.TUNED_SM90`'s); `design` "v2": the product's kernel as it runs on
    a GPU (its lookups by warp shuffle); "loads": the same with table loads (benchmarks/variants/nf4_loads.py);
    "pairs": the variant with one table lookup a byte (nf4_pairs); "bytes": the product's loop before it read words
    (nf4_bytes); "byte-loads": that loop with table loads. `splits` > 1 (v2, loads): K split that many ways, summed by
    the last split to finish (`nf4_triton.sum_if_last`), as the product launches a split K; else no split sum
    built."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as error:
        print(f"nf4_sass: Triton with its NVIDIA backend is needed ({error})", file=sys.stderr)
        raise SystemExit(2) from error
    from variants import nf4_lookups  # beside this script, on sys.path as it runs

    from vlmrl.engine.rollout import nf4_settings, nf4_triton

    if nf4_lookups.runs_byte_loop(design):
        tiles, lookup = nf4_lookups.byte_loop(False), nf4_lookups.LOOKUPS[design]
    else:
        tiles, lookup = nf4_triton.kernels(False)[0], {"SHUFFLE": design == "v2"}
    block_n, tile, warps = shape or nf4_settings.tile_shape(rows, blocksize)
    xt = {"bfloat16": "bf16", "float16": "fp16"}[dtype]
    signature = {"X": f"*{xt}", "Packed": "*u8", "Absmax": "*u8", "Code2": "*fp32", "Absmax2": "*fp32",
                 "Offset": "*fp32", "Lut": "*fp32", "Bias": f"*{xt}", "Out": "*fp32", "M": "i32", "N": "i32",
                 "K": "i32", "stride_x": "i32", "per_split": "i32"}
    constants = {"BLOCKSIZE2": 256, "HALF": blocksize // 2, "NB": tile // (blocksize // 2), "BLOCK_N": block_n,
                 "BLOCK_M": nf4_settings.block_rows(rows), "NESTED": True, "HAS_BIAS": False, "PARTIAL": True,
                 "WQ": 1, "XQ": 1 if dtype == "bfloat16" else 2, "EXACT": False, "EVEN": True} | lookup
    product = design in ("v2", "loads")  # the product's kernel, whose split sum may be built in
    if splits > 1 and product:
        signature |= {"Final": f"*{xt}", "Counters": "*i32"}
        constants |= {"SPLITS": splits, "HAS_BIAS": True}
    elif product:
        constants |= {"Final": None, "Counters": None, "SPLITS": 0}  # (defaults left out fail to build)
    if product:  # without the LoRA branch (nf4_branch), as a plain projection's token step runs
        constants |= {"First": None, "Second": None, "SharesA": None, "R": 0, "lora_scale": 1.0, "RP": 16,
                      "LORA": False}
    signature |= dict.fromkeys(constants, "constexpr")
    index = tiles.arg_names.index
    divisible = [name for name in signature if name not in constants and name != "Offset"]
    source = ASTSource(fn=tiles, signature=signature, constexprs={(index(k),): v for k, v in constants.items()},
                       attrs={(index(name),): [["tt.divisibility", 16]] for name in divisible})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": 1, "enable_fp_fusion": False})
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "nf4_tiles.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([str(tools / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
    opcodes = loop_opcodes(sass)
    weights_per_thread = block_n * tile * 2 // (warps * 32)
    total = sum(opcodes.values())
    return {"kernel": design, "rows": rows, "blocksize": blocksize, "dtype": dtype, "triton": triton.__version__,
            "splits_summed_in_kernel": constants.get("SPLITS", 0),
            "split_sum_order": split_sum_order(kernel.asm["ptx"]) if constants.get("SPLITS") else [],
            "tile": {"block_n": block_n, "packed_bytes": tile, "warps": warps, "block_m": constants["BLOCK_M"]},
            "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "spill_bytes": int(re.search(r"LOCAL:(\d+)", usage).group(1)),
            "loop_instructions": total, "weights_per_thread": weights_per_thread,
            "instructions_per_weight": total / weights_per_thread, "opcodes": dict(opcodes.most_common())}


# Qwen3-VL-8B's stacked groups at a token step: each member's outputs, and the group's in_features (LoRA rank 16)
GROUPS = {"q/k/v": ([4096, 1024, 1024], 4096), "o": ([4096], 4096), "gate/up": ([12288, 12288], 4096),
          "down": ([4096], 12288)}
SMS = 132  # an H100 SXM's or an H200's


def group_step_build(rows: int = 32) -> list[dict]:
    """`vlmrl.engine.rollout.group_step`'s kernel as the product launches it for each group of `GROUPS` at `rows`
    rows (its K splits by `group_step.splits_for` on `SMS` SMs, its rank window by `rank_windows`), built for sm_90:
    registers, spilled bytes, whether its dots are Hopper's warpgroup MMA, and the split sum's memory order."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as error:
        print(f"nf4_sass: Triton with its NVIDIA backend is needed ({error})", file=sys.stderr)
        raise SystemExit(2) from error
    from vlmrl.engine.rollout import group_step

    kernel = group_step._kernel(False)
    index = kernel.arg_names.index
    block_m = max(16, 1 << (rows - 1).bit_length())
    results = []
    for name, (outs, k) in GROUPS.items():
        width, ranks = sum(outs), [16] * len(outs)
        splits = group_step.splits_for(-(-width // group_step.BLOCK_N), k, SMS)
        rp = group_step.rank_windows(outs, ranks, "cpu")[1]
        split = "*fp32" if splits > 1 else "*bf16"  # a single split takes the output in the buffers' places
        signature = {"X": "*bf16", "W": "*bf16", "A": "*bf16", "Second": "*bf16", "Scales": "*bf16",
                     "Bias": "*bf16", "Out": "*bf16", "Partial": split, "Shares": split,
                     "Counters": "*i32" if splits > 1 else "*bf16", "Starts": "*i32", "M": "i32", "N": "i32",
                     "K": "i32", "R": "i32", "sxm": "i32", "swn": "i32", "per_split": "i32", "scale": "fp32"}
        constants = {"BLOCK_N": group_step.BLOCK_N, "BLOCK_M": block_m, "BLOCK_K": group_step.BLOCK_K, "RP": rp,
                     "SPLITS": splits, "PER_COLUMN": False, "HAS_BIAS": False, "DOT_F32": False}
        divisible = [n for n in signature if n not in ("M", "R", "scale")]
        signature |= dict.fromkeys(constants, "constexpr")
        source = ASTSource(fn=kernel, signature=signature, constexprs={(index(c),): v for c, v in constants.items()},
                           attrs={(index(n),): [["tt.divisibility", 16]] for n in divisible})
        built = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": group_step.WARPS, "num_stages": group_step.STAGES})
        tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
        with tempfile.TemporaryDirectory() as tmp:
            cubin = Path(tmp) / "group_step.cubin"
            cubin.write_bytes(built.asm["cubin"])
            usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True,
                                   text=True, check=True).stdout
        ptx = built.asm["ptx"]
        results.append({"group": name, "rows": rows, "splits": splits, "rank_rows": rp, "triton": triton.__version__,
                        "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
                        "spill_bytes": int(re.search(r"LOCAL:(\d+)", usage).group(1)),
                        "shared_bytes": built.metadata.shared, "warpgroup_mma": ptx.count("wgmma.mma_async"),
                        "split_sum_order": split_sum_order(ptx) if splits > 1 else []})
    return results


def tuned(design: str = "v2") -> list[dict]:
    """Each distinct tile of `nf4_settings.TUNED_SM90` (the measured settings the product takes on sm_90), built in
    bf16, with the projections that take it."""
    from vlmrl.engine.rollout import nf4_settings

    tiles: dict[tuple, list[str]] = {}
    for (n, k, blocksize, rows), (block_n, tile, warps, _, split) in nf4_settings.TUNED_SM90.items():
        tiles.setdefault((rows, blocksize, block_n, tile, warps, split), []).append(f"{n} x {k}")
    return [build(rows, blocksize, "bfloat16", (block_n, tile, warps), design, split) | {"shapes": shapes}
            for (rows, blocksize, block_n, tile, warps, split), shapes in tiles.items()]


def _table(results: list[dict], json_path: Path | None, header: str, row) -> int:
    """Print `results` as a markdown table (`row` makes a line of one), and write them to `json_path` if given."""
    print(header + "\n" + "|---" * header.count(" | ") + "|---|")
    for r in results:
        print(row(r))
    if json_path:
        json_path.write_text(json.dumps(results, indent=1) + "\n")
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--blocksize", type=int, default=64)
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--top", type=int, default=12, help="opcodes to print")
    p.add_argument("--json", type=Path, help="write the counts here too")
    p.add_argument("--tuned", action="store_true", help="build each tile of nf4_settings.TUNED_SM90 instead (bf16), a line each")
    p.add_argument("--kernel", choices=("v2", "loads", "pairs", "bytes", "byte-loads"), default="v2",
                   help="the product's tile kernel (lookups by warp shuffle), or a variant: lookups by table loads, "
                   "one table lookup a byte, or the loop before it read words (a byte at a time; byte-loads: and before the "
                   "shuffles)")
    p.add_argument("--group-step", action="store_true",
                   help="build the bf16 group-step kernel (vlmrl.engine.rollout.group_step) at each Qwen3-VL-8B group "
                   "instead, --rows rows, a line each")
    args = p.parse_args(argv)
    if args.group_step:
        return _table(group_step_build(args.rows), args.json,
                      "| group | rows | K splits | rank rows | registers | spilled bytes | shared bytes "
                      "| warpgroup MMAs | split sum's order |",
                      lambda r: f"| {r['group']} | {r['rows']} | {r['splits']} | {r['rank_rows']} | "
                      f"{r['registers']} | {r['spill_bytes']} | {r['shared_bytes']} | {r['warpgroup_mma']} | "
                      f"{', '.join(r['split_sum_order']) or '-'} |")
    if args.tuned:
        return _table(tuned(args.kernel), args.json,
                      "| rows | blocksize | tile (block_n, packed bytes, warps) | projections | registers "
                      "| spilled bytes | instructions per weight |",
                      lambda r: f"| {r['rows']} | {r['blocksize']} | {r['tile']['block_n']}, "
                      f"{r['tile']['packed_bytes']}, {r['tile']['warps']} | {', '.join(r['shapes'])} | "
                      f"{r['registers']} | {r['spill_bytes']} | {r['instructions_per_weight']:.1f} |")
    result = build(args.rows, args.blocksize, args.dtype, design=args.kernel)
    print(f"nf4_tiles for sm_90 (Triton {result['triton']}), {args.rows} rows, blocksize {args.blocksize}, "
          f"{args.dtype}: tile {result['tile']}, {result['registers']} registers, {result['spill_bytes']} bytes "
          f"spilled; loop {result['loop_instructions']} instructions for {result['weights_per_thread']} weights a "
          f"thread = {result['instructions_per_weight']:.1f} per weight")
    for opcode, count in list(result["opcodes"].items())[:args.top]:
        print(f"  {count:5d}  {opcode}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
