"""Where the nf4 token-step kernel waits: one launch of `vlmrl.engine.rollout.nf4`'s kernel per projection shape of
Qwen3-VL-8B, profiled whole by Nsight Compute (`--set full` with its source counters), so the warp-state table says
why the loop stalls (table lookups, the tensor-core step, the weight loads) and the SASS view at which instructions.

The instruction count (`benchmarks/nf4_sass.py`) bounds the loop's time from below; this is the measurement that
says what it waits on, before a new design is written.

For each shape (q/o 4096 x 4096, k/v 1024 x 4096, gate/up 12288 x 4096, down 4096 x 12288, stacked as in the
rollouts where that applies) and a batch of rows (32 by default: a rollout's token step), random weights
quantised by bitsandbytes (nf4, blocksize 64, double quantisation), the kernel launched a few times to compile,
then once inside the profiler's window.

Writes OUT/nf4_stalls.ncu-rep (open it in Nsight Compute), OUT/nf4_stalls_details.csv (every section's metrics per
kernel), OUT/nf4_stalls_source_<i>.csv (per SASS instruction: its stall samples, where ncu's version prints them)
and OUT/nf4_stalls.json + .md: per kernel, its time, DRAM read throughput, occupancy, issue-slot use, the warp stall
reasons that take most of its cycles and the opcodes its warps were found at.

Usage (CUDA, bitsandbytes; ncu on PATH or in /usr/local/cuda/bin):
    python benchmarks/nf4_stalls.py OUT [--rows 32] [--shapes 4096x4096,12288x4096]
    python benchmarks/nf4_stalls.py OUT --parse     # the tables again from OUT's CSV
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from token_step_ncu import csv_rows, ncu_path, run_with_src

SHAPES = "4096x4096,1024x4096,12288x4096,4096x12288"  # (out, in) of q/o, k/v, gate/up, down
# cycles warps spend stalled for each reason, per issued instruction (ncu 2025's raw names)
STALL, PER_ISSUE = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
SUMMARY = {"gpu__time_duration.sum": "us", "dram__bytes_read.sum.pct_of_peak_sustained_elapsed": "dram read %",
           "launch__grid_size": "programs", "launch__registers_per_thread": "registers",
           "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy %",
           "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue %",
           "smsp__inst_executed.sum": "warp instructions"}


def read_raw(text: str) -> list[dict]:
    """ncu's `--page raw --csv --print-units base`: one row per kernel, a column per metric (a units row after the
    header). The stall reasons are raw metrics, not a details-page row."""
    kernels = []
    for row in csv_rows(text):
        if not row.get("ID", "").strip().isdigit():
            continue  # the units row
        metrics = {}
        for name, value in row.items():
            try:
                metrics[name] = float((value or "").replace(",", ""))
            except ValueError:
                continue
        kernels.append({"id": int(row["ID"]), "name": row.get("Kernel Name", ""), "metrics": metrics})
    return kernels


def stalls(metrics: dict, top: int = 6) -> list[tuple[str, float]]:
    """The stall reasons with the most cycles per issued instruction, largest first ("selected" is the issue
    itself: one cycle per instruction)."""
    found = {name[len(STALL):-len(PER_ISSUE)]: value for name, value in metrics.items()
             if name.startswith(STALL) and name.endswith(PER_ISSUE) and isinstance(value, float)}
    return sorted(found.items(), key=lambda kv: -kv[1])[:top]


def labels(names: list[str], shapes: list[str]) -> list[str]:
    """Each launch's shape: the tile kernels take the shapes in order, a splits' sum the shape before it."""
    out, shape = [], iter(shapes)
    for name in names:
        if "splits" in name and out:
            out.append(f"{out[-1]} (sum of K splits)")
        else:
            out.append(next(shape, name))
    return out


def read_source(text: str) -> dict[str, dict[str, float]]:
    """ncu's `--page source --print-source sass --csv` for one kernel: per opcode (its first dotted part), the share
    of the warp-state samples that found a warp at it and the share of instructions executed."""
    samples: dict[str, float] = {}
    executed: dict[str, float] = {}
    for row in csv_rows(text, "Address", "SASS source table"):
        words = (row.get("Source") or "").split()
        words = words[1:] if words and words[0].startswith("@") else words  # a predicate
        if not words:
            continue
        op = words[0].split(".")[0]
        samples[op] = samples.get(op, 0) + float((row["Warp Stall Sampling (All Samples)"] or "0").replace(",", ""))
        executed[op] = executed.get(op, 0) + float((row["Instructions Executed"] or "0").replace(",", ""))
    total_s, total_e = sum(samples.values()) or 1.0, sum(executed.values()) or 1.0
    return {op: {"samples": samples[op] / total_s, "instructions": executed[op] / total_e}
            for op in sorted(samples, key=lambda o: -samples[o])}


def tables(raw: list[dict], shapes: list[str], sources: list[dict] | None = None) -> dict:
    """Per launch: its shape, the SUMMARY figures, its top stall reasons and (where `sources` has its SASS table)
    the 8 opcodes its warps were found at most."""
    kernels = []
    sources = sources or [{}] * len(raw)
    for k, label, opcodes in zip(raw, labels([k["name"] for k in raw], shapes), sources, strict=True):
        m = k["metrics"]
        entry = {"label": label, "name": k["name"],
                 **{short: m.get(metric) for metric, short in SUMMARY.items()}}
        if entry["us"] is not None:
            entry["us"] = entry["us"] / 1e3  # ncu's base unit for durations is the nanosecond
        entry["stalls"] = stalls(m)
        if opcodes:
            entry["opcodes"] = dict(list(opcodes.items())[:8])
        kernels.append(entry)
    return {"kernels": kernels}


def markdown(result: dict) -> str:
    def num(v: object) -> str:
        return f"{v:.1f}" if isinstance(v, float) else "" if v is None else str(v)

    lines = [f"| shape | {' | '.join(SUMMARY.values())} | stall reasons (cycles per issued instruction) |",
             "|---|" + "---|" * (len(SUMMARY) + 1)]
    for k in result["kernels"]:
        reasons = ", ".join(f"{name} {value:.1f}" for name, value in k["stalls"])
        lines.append(f"| {k['label']} | {' | '.join(num(k[s]) for s in SUMMARY.values())} | {reasons} |")
    lines += ["", ("Where the warps were found (share of warp-state samples, share of instructions executed), "
                   "per opcode:"), ""]
    lines += [f"- {k['label']}: " + ", ".join(f"{op} {f['samples']:.0%} / {f['instructions']:.0%}"
                                             for op, f in k["opcodes"].items())
              for k in result["kernels"] if k.get("opcodes")]
    return "\n".join(lines) + "\n"


def write(out: Path) -> dict:
    command = json.loads((out / "nf4_stalls_command.json").read_text())
    raw = read_raw((out / "nf4_stalls_raw.csv").read_text())
    sources = [read_source(path.read_text()) if (path := out / f"nf4_stalls_source_{i}.csv").exists() else {}
               for i in range(len(raw))]
    result = tables(raw, command["shapes"], sources) | command
    (out / "nf4_stalls.json").write_text(json.dumps(result, indent=2))
    (out / "nf4_stalls.md").write_text(markdown(result))
    return result


def child(args: argparse.Namespace) -> None:
    """Each shape's kernel: compiled and warmed outside the window, then launched once inside it."""
    import bitsandbytes as bnb
    import torch

    from vlmrl.engine.rollout import nf4

    torch.manual_seed(0)
    device = torch.device("cuda")
    for shape in args.shapes.split(","):
        n, k = (int(s) for s in shape.split("x"))
        weight = bnb.nn.Params4bit((torch.randn(n, k) / k**0.5).to(torch.bfloat16), requires_grad=False,
                                   quant_type="nf4", compress_statistics=True, blocksize=64).to(device)
        x = torch.randn(args.rows, k, device=device, dtype=torch.bfloat16)
        for _ in range(3):
            nf4.nf4_matmul(x, weight)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        nf4.nf4_matmul(x, weight)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--shapes", default=SHAPES, help="out x in, comma-separated")
    parser.add_argument("--parse", action="store_true", help="only rebuild the tables from OUT's CSV")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    if not args.parse:
        ncu = ncu_path()
        args.out.mkdir(parents=True, exist_ok=True)
        report = args.out / "nf4_stalls.ncu-rep"
        command = [ncu, "--profile-from-start", "off", "--set", "full", "--import-source", "no",
                   "--kernel-name", "regex:nf4", "--force-overwrite", "--export", str(report),
                   sys.executable, str(Path(__file__).resolve()), str(args.out), "--child",
                   f"--rows={args.rows}", f"--shapes={args.shapes}"]
        print(" ".join(command), flush=True)
        # a shape whose K is split runs the tile kernel then the splits' sum: both are profiled, in launch order
        (args.out / "nf4_stalls_command.json").write_text(json.dumps(
            {"command": f"python benchmarks/nf4_stalls.py OUT --rows {args.rows} --shapes {args.shapes}",
             "rows": args.rows, "shapes": args.shapes.split(",")}, indent=2))
        if run_with_src(command):
            return 1
        pages = {}
        for page, name in (("raw", "nf4_stalls_raw.csv"), ("details", "nf4_stalls_details.csv")):
            pages[page] = subprocess.run([ncu, "--import", str(report), "--page", page, "--csv", "--print-units",
                                          "base"], capture_output=True, text=True, check=False).stdout
            (args.out / name).write_text(pages[page])
        for i in range(len(read_raw(pages["raw"]))):
            text = subprocess.run([ncu, "--import", str(report), "--page", "source", "--csv", "--print-source",
                                   "sass", "--launch-skip", str(i), "--launch-count", "1"],
                                  capture_output=True, text=True, check=False)
            (args.out / f"nf4_stalls_source_{i}.csv").write_text(text.stdout + text.stderr)
    result = write(args.out)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
