"""The CPU demo's result under other arithmetic: `vlmrl run demo` on several seeds and several CPU kernel
settings, each run building its demo policy anew (a cache of its own), as on a fresh machine.

    PYTHONPATH=src python benchmarks/demo_cpu_spread.py OUTDIR [--runs pinned:0 pinned:1 native:0 ...]

A run is KERNELS:SEED. KERNELS is one of KERNEL_SETTINGS: `pinned` is `make run` as it is (the kernels vlmrl pins,
2 threads); the others change only the arithmetic (the host's own AVX-512 kernels; MKL's SSE2 code path), which
is what another CPU model changes too. Writes OUTDIR/cpu_demo_spread.json: the host (CPU model, flags that pick
kernels), versions, and per run its settings, the printed table, accuracy before/after with its interval and
McNemar p, format compliance before/after, wall time. Runs one at a time (the demo uses 2 threads).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

KERNEL_SETTINGS = {
    "pinned": {},
    "native": {"VLMRL_CPU_KERNELS": "native"},
    "mkl-sse2": {"MKL_CBWR": "COMPATIBLE"},
}
DEFAULT_RUNS = ["pinned:0", "pinned:1", "pinned:2", "native:0", "mkl-sse2:0"]


def run_one(spec: str, work: Path, out: Path) -> dict:
    kernels, seed = spec.split(":")
    name = f"{kernels}-seed{seed}"
    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "vlmrl.cli", "run", "demo", "--set", f"run.seed={seed}",
               "--set", f"run.output_dir={folder}", "--set", "run.name=demo"]
    # this process imported vlmrl, which pinned its own environment: the child starts from none of those settings
    # and pins itself, unless the run's settings say otherwise
    from vlmrl.common.cpu_numerics import PINNED

    env = {k: v for k, v in os.environ.items() if k not in ("VLMRL_CPU_KERNELS", *PINNED)}
    env.update(KERNEL_SETTINGS[kernels], VLMRL_CACHE=str(folder / "cache"), COLUMNS="200", PYTHONUNBUFFERED="1")
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=folder, check=False)
    (out / f"{name}.log").write_text(done.stdout + done.stderr)
    entry = {"kernels": kernels, "settings": KERNEL_SETTINGS[kernels], "seed": int(seed),
             "exit_status": done.returncode, "wall_s": round(time.perf_counter() - started, 1)}
    comparison = folder / "demo" / "comparison.json"
    if done.returncode == 0 and comparison.exists():
        compared = json.loads(comparison.read_text())
        accuracy, fmt = compared["metrics"]["accuracy"], compared["metrics"]["format_compliance"]
        entry.update(
            n_heldout=compared["n_paired"],
            accuracy={"before": accuracy["before"], "after": accuracy["after"], "delta": accuracy["delta"],
                      "ci": accuracy["delta_ci95"], "mcnemar_p": accuracy["mcnemar_p"]},
            format_compliance={"before": fmt["before"], "after": fmt["after"]},
            table=printed_table(done.stdout))
    return entry


def printed_table(stdout: str) -> str:
    """The before/after table and its flips line, as `vlmrl run` printed them."""
    match = re.search(r"^[^\n]*before -> after \(.*?^wrong to right:[^\n]*", stdout, re.DOTALL | re.MULTILINE)
    return match.group(0) if match else ""


def host() -> dict:
    """The CPU, as far as it picks kernels: vendor, model, and the vector extensions present."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    return {"cpu": info.get("model name", platform.processor()), "vendor": info.get("vendor_id"),
            "family": info.get("cpu family"), "model": info.get("model"), "cores": os.cpu_count(),
            "vector_flags": sorted(f for f in flags if f.startswith(("avx", "fma", "amx")))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, help="KERNELS:SEED, KERNELS one of "
                        + ", ".join(KERNEL_SETTINGS))
    parser.add_argument("--work", type=Path, default=Path("/tmp/vlmrl-demo-cpu-spread"))
    args = parser.parse_args()
    for spec in args.runs:
        if spec.partition(":")[0] not in KERNEL_SETTINGS or not spec.partition(":")[2].isdigit():
            parser.error(f"--runs {spec}: expected KERNELS:SEED with KERNELS one of {', '.join(KERNEL_SETTINGS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    from vlmrl.common.provenance import git_commit, package_version

    entries = []
    for spec in args.runs:
        entries.append(run_one(spec, args.work, args.out))
        e = entries[-1]
        print(f"{spec}: exit {e['exit_status']}, {e['wall_s']} s; accuracy {e.get('accuracy')}", flush=True)
    record = {
        "what": "vlmrl run demo on several seeds and CPU kernel settings, each building its demo policy anew",
        "command": "PYTHONPATH=src python benchmarks/demo_cpu_spread.py OUT --runs " + " ".join(args.runs),
        "git_commit": os.environ.get("VLMRL_RECORD_COMMIT") or git_commit(),
        "python": platform.python_version(), "host": host(), "shared_host": False,
        "versions": {name: package_version(name) for name in ("torch", "transformers", "trl", "peft", "numpy")},
        "runs": entries,
        "significant_on_every_run": all(e.get("accuracy", {}).get("mcnemar_p", 1.0) < 0.05 for e in entries),
    }
    (args.out / "cpu_demo_spread.json").write_text(json.dumps(record, indent=2) + "\n")
    return 0 if all(e["exit_status"] == 0 for e in entries) else 1


if __name__ == "__main__":
    sys.exit(main())
