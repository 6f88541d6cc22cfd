"""One token step of a bench rollout, kernel by kernel, with Nsight Compute: each kernel's time, the DRAM bytes it
moved, and how far it sits from the time those bytes need at the device's copy bandwidth measured in the same run.

Runs `vlmrl bench`'s vlmrl path (its settings: bf16, or --load-in-4bit with a memory cap; forced or ragged
completions) under `ncu --profile-from-start off --graph-profiling node`. In rollout R (--rollout, the first by
default), a logits processor that runs after every other one starts the profiler at token step K and stops it at
K+1: exactly one cycle is captured, the sampling of step K, then the forward of step K+1 (a CUDA-graph replay, each
of its nodes profiled as a kernel) and its logits processors. The run then stops: under ncu every token step takes
about 15x its time even outside the window, so the rest of the bench would only cost device time. By token step K
the rollout replays the graphs it recorded at its first steps; a later rollout replays the same kernels (it
records them again where the adapter copies moved).

Writes OUT/token_step_ncu.csv (ncu's own), OUT/token_step_window.json (the bench's settings, device, versions and
the copy bandwidth it measured) and OUT/token_step_profile.json + .md: per kernel, in launch order, its time, bytes read + written, achieved
bandwidth and "x bytes" = its time / (its bytes / bandwidth); per kind (matmul, nf4 weights, attention, norm,
sampling, Triton elementwise, other) and per kernel name (with its count: per layer, per step) the same totals;
the step's kernel time against all its bytes at the bandwidth. ncu runs each kernel alone, its caches flushed first
(`--cache-control all`) at the application's clocks (`--clock-control none`): the kernel times add up to the step
without launch gaps or overlap.

Usage (CUDA; ncu on PATH or in /usr/local/cuda/bin):
    python benchmarks/token_step_ncu.py OUT [--load-in-4bit --memory-cap-gib 24] [--completion 1024]
        [--ragged-median 600] [--token-step 256] [--rollout 1]
    python benchmarks/token_step_ncu.py OUT --parse          # the tables again from OUT/token_step_ncu.csv
    python benchmarks/token_step_ncu.py A.json --against B.json   # two profiles side by side, per kind and kernel
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WINDOW = "token_step_window.json"  # what the run measured besides ncu, written when its window closed
METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum")
# ncu 2025.3 prints durations in "ns" even with --print-units base; older releases spell them out
UNITS = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3,
         "second": 1, "ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1}
# First match wins: nf4 before matmul (its kernels are GEMMs too), norm before Triton (inductor names its fused
# RMSNorm after its ops: mean, rsqrt).
KINDS = (("nf4 weights", ("nf4", "4bit", "dequantize", "kgemm_4bit")),
         ("attention", ("attention", "flash", "fmha", "sdpa", "partial", "combine")),
         ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk", "gemv", "second_step")),
         ("norm", ("rsqrt", "norm")),
         ("sampling", ("softmax", "multinomial", "sort", "topk", "argmax", "exponential", "cumsum", "logsumexp",
                       "scatter", "gather")),
         ("triton elementwise", ("triton",)))


def kind(name: str) -> str:
    lowered = name.lower()
    return next((k for k, keys in KINDS if any(key in lowered for key in keys)), "other")


def csv_rows(text: str, first: str = "ID", what: str = "ncu CSV header") -> csv.DictReader:
    """The rows of one of ncu's CSV tables, from its header (the line starting with `"first",`): the lines before
    it (ncu's own messages) are skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(f'"{first}",')), None)
    if start is None:
        raise ValueError(f'no {what} (a line starting with "{first}",) found')
    return csv.DictReader(lines[start:])


def read_ncu_csv(text: str) -> list[dict]:
    """Kernels of ncu's `--csv` details page (one row per kernel and metric), in launch order: name, seconds,
    bytes read and written."""
    kernels: dict[str, dict] = {}
    for row in csv_rows(text):
        metric = row.get("Metric Name")
        if metric not in METRICS:
            continue
        entry = kernels.setdefault(row["ID"], {"id": int(row["ID"]), "name": row["Kernel Name"]})
        unit = row.get("Metric Unit") or ""
        if unit not in UNITS:
            raise ValueError(f"{metric}: unit {unit!r} is not one this reader knows")
        value = float(row["Metric Value"].replace(",", "")) * UNITS[unit]
        entry[metric] = value
    missing = [k["id"] for k in kernels.values() if any(m not in k for m in METRICS)]
    if missing:
        raise ValueError(f"kernels {missing[:5]} lack some of {', '.join(METRICS)}")
    return [{"id": k["id"], "name": k["name"], "seconds": k[METRICS[0]], "bytes_read": k[METRICS[1]],
             "bytes_written": k[METRICS[2]]} for k in sorted(kernels.values(), key=lambda k: k["id"])]


def profile(kernels: list[dict], bandwidth: float) -> dict:
    """Per kernel and per kind: time, bytes, achieved bandwidth, time / (bytes / `bandwidth` in bytes/s)."""
    if not kernels:
        raise ValueError("ncu profiled no kernel: did the token step run inside the profiler's window?")

    def figures(seconds: float, moved: float) -> dict:
        return {"us": seconds * 1e6, "bytes": moved, "achieved_tbs": moved / seconds / 1e12 if seconds else None,
                "x_bytes": seconds / (moved / bandwidth) if moved else None}

    rows = []
    for k in kernels:
        moved = k["bytes_read"] + k["bytes_written"]
        rows.append({"id": k["id"], "name": k["name"], "kind": kind(k["name"]), **figures(k["seconds"], moved)})
    def grouped(key: str) -> dict:
        groups: dict[str, dict] = {}
        for r in rows:
            total = groups.setdefault(r[key], {"kind": r["kind"], "kernels": 0, "seconds": 0.0, "bytes": 0.0})
            total["kernels"] += 1
            total["seconds"] += r["us"] / 1e6
            total["bytes"] += r["bytes"]
        return {name: {"kernels": t["kernels"], **({"kind": t["kind"]} if key == "name" else {}),
                       **figures(t["seconds"], t["bytes"])}
                for name, t in sorted(groups.items(), key=lambda kv: -kv[1]["seconds"])}

    seconds, moved = sum(r["us"] for r in rows) / 1e6, sum(r["bytes"] for r in rows)
    return {"bandwidth_tbs": bandwidth / 1e12, "kernels": len(rows), "step": figures(seconds, moved),
            "by_kind": grouped("kind"), "by_name": grouped("name"), "per_kernel": rows}


def markdown(result: dict, top: int = 25) -> str:
    def line(label: str, f: dict, count: int | str = "") -> str:
        tbs = f"{f['achieved_tbs']:.2f}" if f["achieved_tbs"] is not None else ""
        x = f"{f['x_bytes']:.1f}" if f["x_bytes"] is not None else "no DRAM bytes"
        return f"| {label} | {count} | {f['us']:.1f} | {f['bytes'] / 1e6:.2f} | {tbs} | {x} |"

    s = result["step"]
    head = (f"One token step: {result['kernels']} kernels, {s['us']:.0f} us of kernel time, {s['bytes'] / 1e9:.3f} "
            f"GB moved; at the measured {result['bandwidth_tbs']:.2f} TB/s those bytes need "
            f"{s['bytes'] / (result['bandwidth_tbs'] * 1e12) * 1e6:.0f} us ({s['x_bytes']:.2f}x).")
    lines = [head, "",
             "| kind | kernels | us | MB | TB/s | x bytes |", "|---|---|---|---|---|---|"]
    lines += [line(name, f, f["kernels"]) for name, f in result["by_kind"].items()]
    lines += ["", (f"The {top} kernels (by name) that take the most time, with how many times the step ran each (a "
                   "per-layer kernel runs once per layer):"), "", "| kernel | kind, calls | us | MB | TB/s | x bytes |",
              "|---|---|---|---|---|---|"]
    lines += [line(f"`{name[:80]}`", f, f"{f['kind']}, {f['kernels']}")
              for name, f in list(result["by_name"].items())[:top]]
    return "\n".join(lines) + "\n"


def against(a: dict, b: dict, top: int = 25) -> str:
    """Two profiles (`profile`'s results) side by side: per kind and per kernel name, the calls and microseconds of
    each and the difference (b - a), largest differences first."""
    def rows(key: str) -> list[tuple[str, dict | None, dict | None]]:
        names = set(a[key]) | set(b[key])
        both = [(name, a[key].get(name), b[key].get(name)) for name in names]
        return sorted(both, key=lambda r: -abs((r[2] or {"us": 0})["us"] - (r[1] or {"us": 0})["us"]))

    def line(name: str, x: dict | None, y: dict | None) -> str:
        cx, ux = (x["kernels"], x["us"]) if x else (0, 0.0)
        cy, uy = (y["kernels"], y["us"]) if y else (0, 0.0)
        return f"| {name} | {cx} | {ux:.1f} | {cy} | {uy:.1f} | {uy - ux:+.1f} |"

    head = "| {} | A calls | A us | B calls | B us | B - A us |\n|---|---|---|---|---|---|"
    summary = (f"A: {a['kernels']} kernels, {a['step']['us']:.0f} us; B: {b['kernels']} kernels, "
               f"{b['step']['us']:.0f} us ({b['step']['us'] - a['step']['us']:+.0f} us).")
    lines = [summary, "", head.format("kind")]
    lines += [line(name, x, y) for name, x, y in rows("by_kind")]
    lines += ["", f"The {top} kernel names whose time differs most:", "", head.format("kernel")]
    lines += [line(f"`{name[:80]}`", x, y) for name, x, y in rows("by_name")[:top]]
    return "\n".join(lines) + "\n"


def write(out: Path) -> dict:
    """The tables from OUT/token_step_ncu.csv and the bandwidth the bench measured (OUT/token_step_window.json;
    OUT/bench/bench.json in profiles made before the run stopped at its window)."""
    meta = out / WINDOW
    bench = json.loads((meta if meta.exists() else out / "bench" / "bench.json").read_text())
    result = profile(read_ncu_csv((out / "token_step_ncu.csv").read_text()),
                     bench["ceilings"]["copy_bandwidth_tbs"] * 1e12)
    command = out / "token_step_command.json"
    result |= {"settings": bench["settings"], "device": bench["device"], "versions": bench["versions"],
               "rollout": bench.get("rollout", 2), "git_commit": bench.get("git_commit"),
               **(json.loads(command.read_text()) if command.exists() else {})}
    (out / "token_step_profile.json").write_text(json.dumps(result, indent=2))
    (out / "token_step_profile.md").write_text(markdown(result))
    return result


class WindowClosed(BaseException):
    """Raised by the window's processor once the profiled cycle is over: it unwinds the bench (a BaseException, so
    no handler for errors takes it) and ends the run."""


_STARTED = time.perf_counter()


def say(what: str) -> None:
    """Where the run is, in the log: under ncu each phase takes many times its own time."""
    print(f"[{Path(sys.argv[0]).stem} {time.perf_counter() - _STARTED:7.1f} s] {what}", flush=True)


def run_until_window(args: argparse.Namespace, window: object) -> dict:
    """Run the bench's `args.path` (`vlmrl`, or a bench variant's name from benchmarks/variants) at `args`'s
    settings, with the logits processor `window` appended after every other one in rollout `args.rollout`, until
    `window` raises WindowClosed. Returns what the run measured besides the window (settings, device, versions,
    commit, the ceilings, the rollout); SystemExit where the rollout ended before the window closed."""
    from dataclasses import asdict

    import torch

    from vlmrl import bench
    from vlmrl.bench import run as bench_run
    from vlmrl.bench.summary import versions
    from vlmrl.common.provenance import git_commit
    from vlmrl.engine.rollout.sampling import appended_processor

    if args.path != "vlmrl":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import variants

        variants.register()
    measured: dict = {}
    measure_ceilings = bench_run.measure_ceilings

    def ceilings(*a, **k):
        measured.update(measure_ceilings(*a, **k))
        say(f"copy bandwidth {measured['copy_bandwidth_tbs']:.2f} TB/s")
        return measured

    bench_run.measure_ceilings = ceilings
    wrap = bench.StepClock.wrap_generation
    state = {"rollouts": 0}

    def wrap_generation(self, trainer):
        wrap(self, trainer)
        timed = trainer._generate_single_turn

        def generate(*a, **k):
            state["rollouts"] += 1
            say(f"rollout {state['rollouts']}")
            if state["rollouts"] != args.rollout:
                return timed(*a, **k)
            model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
            # entered before the inner wrappers', so its processor is appended after every other one
            with appended_processor(model, lambda ga, gk: window):
                return timed(*a, **k)

        trainer._generate_single_turn = generate

    bench.StepClock.wrap_generation = wrap_generation
    settings = bench.BenchSettings(paths=[args.path], steps=max(2, args.rollout), completion=args.completion,
                                   load_in_4bit=args.load_in_4bit, memory_cap_gib=args.memory_cap_gib,
                                   ragged_median=args.ragged_median)
    try:
        with tempfile.TemporaryDirectory() as work:
            bench.run_bench(settings, args.out / "bench", Path(work))
    except WindowClosed:
        say("window closed")
        return {"settings": asdict(settings), "device": torch.cuda.get_device_name(0), "versions": versions(),
                "git_commit": os.environ.get("VLMRL_RECORD_COMMIT") or git_commit(),
                "ceilings": measured, "rollout": args.rollout}
    raise SystemExit(f"rollout {args.rollout} never closed the window: nothing was profiled")


def child(args: argparse.Namespace) -> None:
    """The bench under ncu, the profiler's window around token step `args.token_step` of rollout `args.rollout`;
    the run stops when the window closes."""
    import torch

    class Window:
        def __init__(self, step: int):
            self.step, self.calls = step, 0

        def __call__(self, input_ids, scores):
            self.calls += 1
            if self.calls in (self.step, self.step + 1):
                torch.cuda.synchronize()
                if self.calls == self.step:
                    say(f"profiler on at token step {self.step}")
                    torch.cuda.profiler.start()
                else:
                    torch.cuda.profiler.stop()
                    say("profiler off")
                    raise WindowClosed
            return scores

    record = run_until_window(args, Window(args.token_step))
    (args.out / WINDOW).write_text(json.dumps(record, indent=2))


def ncu_path() -> str:
    return shutil.which("ncu") or "/usr/local/cuda/bin/ncu"


def run_with_src(command: list[str]) -> int:
    """`command`'s exit status, run with this checkout's src/ first on PYTHONPATH (the profiled child imports vlmrl)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(command, env=env, check=False).returncode


def bench_arguments(description: str) -> argparse.ArgumentParser:
    """The options `run_until_window` reads (OUT, the bench path and its settings, the rollout)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("out", type=Path)
    parser.add_argument("--path", default="vlmrl", help="the bench path: vlmrl, or a variant's (engine_variants.py)")
    parser.add_argument("--load-in-4bit", action="store_true")
    parser.add_argument("--memory-cap-gib", type=float)
    parser.add_argument("--completion", type=int, default=1024)
    parser.add_argument("--ragged-median", type=int)
    parser.add_argument("--rollout", type=_from_one, default=1, help="the rollout profiled (1 = the first)")
    return parser


def _from_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: 1 or later")
    return value


def main() -> int:
    parser = bench_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--token-step", type=int, default=256, help="the profiled cycle starts at this step (1 = the first)")
    parser.add_argument("--parse", action="store_true", help="only rebuild the tables from OUT's CSV")
    parser.add_argument("--against", type=Path, help="OUT is a token_step_profile.json: print it (A) beside this one (B)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    if args.against:
        print(against(json.loads(args.out.read_text()), json.loads(args.against.read_text())))
        return 0
    if not args.parse:
        if not 1 <= args.token_step < args.completion:
            parser.error(f"--token-step {args.token_step}: from 1 to below --completion ({args.completion})")
        ncu = ncu_path()
        args.out.mkdir(parents=True, exist_ok=True)
        forwarded = [f"--completion={args.completion}", f"--token-step={args.token_step}", f"--rollout={args.rollout}",
                     *([f"--path={args.path}"] if args.path != "vlmrl" else []),
                     *(["--load-in-4bit"] if args.load_in_4bit else []),
                     *([f"--memory-cap-gib={args.memory_cap_gib}"] if args.memory_cap_gib else []),
                     *([f"--ragged-median={args.ragged_median}"] if args.ragged_median else [])]
        command = [ncu, "--profile-from-start", "off", "--graph-profiling", "node", "--clock-control", "none",
                   "--cache-control", "all", "--metrics", ",".join(METRICS), "--csv", "--print-units", "base",
                   "--log-file", str(args.out / "token_step_ncu.csv"),
                   sys.executable, str(Path(__file__).resolve()), str(args.out), "--child", *forwarded]
        print(" ".join(command), flush=True)
        (args.out / "token_step_command.json").write_text(json.dumps(
            {"command": "python benchmarks/token_step_ncu.py OUT " + " ".join(forwarded), "ncu": command[:14],
             "token_step": args.token_step}, indent=2))
        if run_with_src(command):
            return 1
    result = write(args.out)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
