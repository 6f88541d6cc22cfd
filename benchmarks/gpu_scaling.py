"""Issue 41's plan: vlmrl's training step on 1, 2, 4 and 8 GPUs of one host (DDP, FSDP2, ZeRO-2), a model too big
for one 80 GB card under FSDP, and evaluation sharded over N GPUs against one GPU; run detached, packed, combined.

Entry point: benchmarks/gpu_scaling.sh (its header has the device calls). Subcommands:

  plan [--gpus N]                   the jobs for a host of N GPUs (default: the GPUs seen here), in start order
  start [--gpus N] [--only P] [--skip P]   start them detached (setsid): jobs run as soon as their GPUs are free,
                                    in order (a job never jumps the queue); P: comma-separated name patterns
  wait SECONDS OUT                  until every job ended or SECONDS passed; then the status table, OUT/scaling.tar.gz
                                    (every job's record, bench.json/md, eval records, log tails) and the record so far,
                                    OUT/h200_multi_gpu.{json,md}; exit 0 once every job has ended
  combine DIR... --out PREFIX       PREFIX.{json,md} from unpacked scaling.tar.gz folders (later folders win per job)
  rehearse OUT                      the whole plan on the CPU for a pretend 2-GPU host: the scheduler, the evaluation
                                    jobs for real (tiny model, 2 gloo processes), bench jobs replaced by a stand-in
                                    that writes a bench.json; then combine

What each configuration measures is `vlmrl bench --paths vlmrl` (the seed recipe: 8 prompts x 4 generations per
GPU, LoRA r=16, GSPO) under `accelerate launch` with the shipped config of its strategy; with several GPUs one more
step is profiled for the NCCL kernel time (`--comm-profile`, vlmrl.bench.comm). The figures and the record:
vlmrl.bench.scaling. State lives in $VLMRL_SCALING_STATE (default /tmp/vlmrl-scaling); the scheduler: gpu_jobs.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_jobs beside it, also when imported by a test
from gpu_jobs import ROOT, Job, alive, order, pack, schedule, select, state_dir, table, tail, write_json

COUNTS = (1, 2, 4, 8)
# Steps per configuration (the first compiles and is set apart; with several GPUs one more is profiled) and the
# completion length: the seed's 1024 tokens; the 32B rows 256, since FSDP gathers every block at every token step.
STEPS = {"ddp": 3, "fsdp": 2, "zero2": 2}
COMPLETION, COMPLETION_32B = 1024, 256
CAP_32B = 80  # GiB: an 80 GB card (H100 / A100 80GB), which the 32B's bf16 LoRA recipe does not fit alone
EVAL = ("--set model.backend=transformers --set model.dtype=auto --set model.max_seq_length=2048 "
        "--set data.image_size=512 --set data.num_synthetic=96 --set data.holdout_size=32 --set eval.batch_size=4 "
        "--set eval.max_new_tokens=64 --set eval.do_sample=false")


def bench_job(strategy: str, gpus: int, tier: int, *, shapes: str = "qwen3_vl_8b", four_bit: bool = False,
              cap: float | None = None, python: str = "python3") -> Job:
    from vlmrl.common.distributed import launch_command

    big = shapes != "qwen3_vl_8b"
    completion = COMPLETION_32B if big else COMPLETION
    steps = 2 if big else STEPS[strategy]  # the 32B's steps are long; one steady step each
    args = ["bench", "--shapes", shapes, "--paths", "vlmrl", "--steps", str(steps), "--warmup-steps", "1",
            "--completion", str(completion), *(["--load-in-4bit"] if four_bit else []),
            *(["--memory-cap-gib", str(cap)] if cap else []), *(["--comm-profile"] if gpus > 1 else [])]
    if gpus == 1:
        argv = [python, "-m", "vlmrl.cli", *args]
    else:
        argv = [python, *launch_command(args, gpus=gpus, strategy=strategy)[1:]]
    precision = "4bit" if four_bit else "bf16"
    name = f"{strategy}_{'32b' if big else precision}_g{gpus}" + (f"_cap{cap:g}" if cap else "")
    minutes = {"ddp": 3.5, "fsdp": 7.0, "zero2": 4.5}[strategy] + (1.5 if four_bit else 0) + (2 if big else 0)
    env = "DS_ACCELERATOR=cuda " if strategy.startswith("zero") else ""
    return Job(name, gpus, tier, f'{env}{shlex.join(argv)} --out "$JOB_OUT"', minutes,
               meta={"kind": "bench", "strategy": strategy, "gpus": gpus, "shapes": shapes, "load_in_4bit": four_bit,
                     "completion": completion, "steps": steps, "memory_cap_gib": cap},
               needs="deepspeed" if strategy.startswith("zero") else None,
               timeout_minutes=25 if strategy == "fsdp" else 15)


def plan(total: int, python: str = "python3") -> list[Job]:
    """Every job for a host of `total` GPUs, in start order (see `order`)."""
    counts = [c for c in COUNTS if c <= total]
    top = counts[-1]
    me = "benchmarks/gpu_scaling.py"
    jobs = [Job("eval_prep", 1, 1, f"{python} {me} eval-prep", 3.0, meta={"kind": "eval_prep"})]
    jobs += [bench_job("ddp", n, 1, python=python) for n in counts]
    if top > 1:
        jobs += [bench_job("fsdp", top, 1, python=python), bench_job("zero2", top, 1, python=python),
                 bench_job("fsdp", 2, 1, shapes="qwen3_vl_32b", cap=CAP_32B, python=python)]
    jobs.append(bench_job("ddp", 1, 1, shapes="qwen3_vl_32b", python=python))  # fits one H200 (141 GB)
    jobs += [Job(f"eval_g{n}", n, 1, f"{python} {me} eval --gpus {n}", 2.5, after=["eval_prep"],
                 meta={"kind": "eval", "gpus": n}) for n in sorted({1, top})]
    jobs += [bench_job("ddp", n, 2, four_bit=True, python=python) for n in sorted({1, top})]
    for n in counts[1:-1]:
        jobs += [bench_job("fsdp", n, 3, python=python), bench_job("zero2", n, 3, python=python),
                 bench_job("ddp", n, 3, four_bit=True, python=python)]
    return order(jobs, total)


def source_digest() -> str:
    """A short hash of src/vlmrl's files: names the code a record ran, also where no git is (the device)."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "src" / "vlmrl").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def commit() -> str:
    if os.environ.get("VLMRL_COMMIT"):
        return os.environ["VLMRL_COMMIT"]
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def start(total: int, only: str | None, skip: str | None, *, detach: bool = True) -> int:
    state = state_dir()
    pid = state / "scheduler.pid"
    if pid.exists() and alive(int(pid.read_text())):
        print(f"a scheduler is already running (pid {pid.read_text()}, state {state})", file=sys.stderr)
        return 2
    jobs = select(plan(total), state, only, skip)
    if not jobs:
        print(f"nothing to start (state {state})", file=sys.stderr)
        return 2
    for sub in ("jobs", "logs", "out"):
        (state / sub).mkdir(parents=True, exist_ok=True)
    for j in jobs:
        write_json(state / "jobs" / f"{j.name}.json", {"job": j.name, **j.meta, "gpus": j.gpus, "status": "queued"})
    write_json(state / "plan.json", [asdict(j) for j in jobs])  # type: ignore[arg-type]
    write_json(state / "meta.json", {"commit": commit(), "source_digest": source_digest(), "gpus": total,
                                     "device": _device(), "versions": _versions()})
    print(f"starting {len(jobs)} jobs on {total} GPUs (state {state}); estimated {sum(j.minutes for j in jobs):.0f} "
          "GPU-job minutes:")
    for j in jobs:
        print(f"  {j.name:<24} {j.gpus} GPU(s)  ~{j.minutes:.0f} min  tier {j.tier}")
    if not detach:
        schedule(state, total)
        return 0
    with open(state / "scheduler.log", "a") as log:
        proc = subprocess.Popen([sys.executable, __file__, "_schedule", str(total)], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, "VLMRL_SCALING_STATE": str(state)})
    pid.write_text(str(proc.pid))
    return 0


def _device() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:
        return None


def _versions() -> dict:
    from vlmrl.bench.summary import versions

    return {**versions(), "accelerate": _version("accelerate"), "deepspeed": _version("deepspeed")}


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


# --- wait and combine ------------------------------------------------------------------------------------------------

def wait(seconds: float, out: Path) -> int:
    """Until every job ended, SECONDS passed or the scheduler is gone; then the table, the pack, the record so far."""
    state = state_dir()
    pid = state / "scheduler.pid"
    end = time.time() + seconds
    while not table(state)[1] and time.time() < end:
        if pid.exists() and not alive(int(pid.read_text())):
            print(f"the scheduler (pid {pid.read_text()}) is gone: {state / 'scheduler.log'} says why")
            break
        time.sleep(5)
    text, finished = table(state)
    print(text)
    for path in (state / "jobs").glob("*.json"):
        r = json.loads(path.read_text())
        if r["status"] == "ended" and r.get("rc") != 0:
            log = state / "logs" / f"{r['job']}.log"
            print(f"--- {r['job']} (rc {r['rc']}), last lines:\n" + "\n".join(tail(log, 15)))
    out.mkdir(parents=True, exist_ok=True)
    pack(state, out / "scaling.tar.gz")
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(out / "scaling.tar.gz") as tar:
            tar.extractall(tmp, filter="data")
        try:  # the pack above comes back whatever happens here
            combine([Path(tmp)], out / "h200_multi_gpu")
        except Exception as exc:  # noqa: BLE001
            print(f"combine failed ({type(exc).__name__}: {exc}); the pack holds every job's files")
    return 0 if finished else 1


def combine(folders: list[Path], prefix: Path) -> dict:
    """The record from unpacked packs: one row per bench job, the evaluation check, what did not run."""
    from vlmrl.bench.scaling import (
        add_efficiency,
        add_prediction,
        beside,
        compare_records,
        configuration_row,
        markdown,
    )
    from vlmrl.common.io import read_jsonl

    jobs: dict[str, tuple[dict, Path]] = {}
    meta: dict = {}
    for folder in folders:
        meta = json.loads((folder / "meta.json").read_text()) if (folder / "meta.json").exists() else meta
        for path in sorted((folder / "jobs").glob("*.json")):
            record = json.loads(path.read_text()) | {"commit": meta.get("commit"),
                                                     "source_digest": meta.get("source_digest")}
            if record["job"] not in jobs or record.get("rc") == 0:
                jobs[record["job"]] = (record, folder / "out" / record["job"])
    records = [r for r, _ in jobs.values()]
    rows = []
    for record, out in jobs.values():
        if record.get("kind") != "bench":
            continue
        record["beside"] = beside(record, records)
        bench = json.loads((out / "bench.json").read_text()) if (out / "bench.json").exists() else None
        rows.append(configuration_row(record, bench))
    strategies = ("ddp", "fsdp", "zero2", "zero3")
    rows.sort(key=lambda r: (r["shapes"], bool(r["load_in_4bit"]), strategies.index(r["strategy"]), r["gpus"]))
    rows = add_prediction(add_efficiency(rows))
    evaluation = None
    evals = sorted((r for r in records if r.get("kind") == "eval" and r.get("rc") == 0), key=lambda r: r["gpus"])
    if len(evals) >= 2 and evals[0]["gpus"] == 1:
        one, many = (read_jsonl(jobs[r["job"]][1] / "records.jsonl") for r in (evals[0], evals[-1]))
        evaluation = compare_records(list(one), list(many)) | {"gpus": evals[-1]["gpus"]}
    meta["not_run"] = sorted(r["job"] for r in records if r.get("rc") != 0)
    result = {"meta": meta, "rows": rows, "evaluation": evaluation, "jobs": records}
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(result, indent=2, default=str))
    prefix.with_suffix(".md").write_text(markdown(rows, evaluation, meta))
    return result


# --- the evaluation jobs ----------------------------------------------------------------------------------------------

def eval_settings(model: str, work: Path, name: str) -> list[str]:
    return [*shlex.split(EVAL), "--set", f"model.name={model}", "--set", f"run.output_dir={work / 'runs'}",
            "--set", f"run.name={name}"]


def eval_prep() -> int:
    """The random-weight Qwen3-VL-8B model (or $MODEL), a prepared run, and a copy of it for the N-GPU evaluation."""
    work = state_dir() / "eval"
    model = os.environ.get("MODEL") or str(work / "shaped")
    if not os.environ.get("MODEL") and not (Path(model) / "config.json").exists():
        _vlmrl(["bench", "--save-model", model])
    _vlmrl(["prepare", "demo", *eval_settings(model, work, "one")])
    shutil.rmtree(work / "runs" / "many", ignore_errors=True)
    shutil.copytree(work / "runs" / "one", work / "runs" / "many", symlinks=True)
    (work / "model").write_text(model)
    return 0


def evaluate(gpus: int) -> int:
    """`vlmrl eval --stage baseline` on the prepared run (1 GPU) or its copy (N GPUs); the records to $JOB_OUT."""
    work = state_dir() / "eval"
    run = work / "runs" / ("one" if gpus == 1 else "many")
    # the copy keeps the prepared run's config (run.name one) and is named by --run-dir
    _vlmrl(["eval", "demo", *eval_settings((work / "model").read_text(), work, "one"), "--run-dir", str(run),
            *(["--gpus", str(gpus)] if gpus > 1 else [])])
    found = sorted(run.rglob("baseline_records.jsonl"))
    shutil.copy(found[0], Path(os.environ["JOB_OUT"]) / "records.jsonl")
    return 0


def _vlmrl(args: list[str]) -> None:
    print("+ vlmrl " + shlex.join(args), flush=True)
    subprocess.run([sys.executable, "-m", "vlmrl.cli", *args], cwd=ROOT, check=True)


# --- the CPU rehearsal ------------------------------------------------------------------------------------------------

def fake_bench(out: Path, gpus: int) -> int:
    """A stand-in for `vlmrl bench` on the CPU: a bench.json with made-up seconds in the bench's own format."""
    from vlmrl.bench import BenchSettings, load_shapes, summarize

    settings = BenchSettings(paths=["vlmrl"], steps=2)
    steps = [{"seconds": 60.0, "generate_seconds": 50.0}, {"seconds": 10.0 + gpus / 10, "generate_seconds": 6.0},
             {"seconds": 11.0, "generate_seconds": 6.0, "profiled": True}]
    comm = {"comm_seconds": 0.05 * gpus, "exposed_seconds": 0.01 * gpus, "seconds_by_collective": {"AllReduce": 0.1}}
    raw = {"path": "vlmrl", "error": None, "fast_generation": None, "peak_memory_gib": 20.0, "peak_reserved_gib": 21.0,
           "steps": steps, "world_size": gpus, "peak_memory_gib_per_rank": [20.0] * gpus,
           "communication_per_rank": [comm] * gpus if gpus > 1 else None}
    summary = summarize(settings, load_shapes("qwen3_vl_8b"), {"matmul_tflops": 800, "copy_bandwidth_tbs": 4.0}, [raw],
                        prompt_tokens=310)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(summary, indent=2, default=str))
    return 0


def rehearse(out: Path, total: int = 2) -> int:
    """The plan for a pretend host of `total` GPUs on the CPU: every job's command swapped for its CPU stand-in
    (evaluation: the tiny model, `--gpus N` as N gloo processes), run by the same scheduler, packed and combined."""
    state = state_dir()
    shutil.rmtree(state, ignore_errors=True)
    os.environ["MODEL"] = "tiny:qwen3_vl"  # vlmrl's built-in tiny Qwen3-VL, built offline
    jobs = plan(total, python=sys.executable)
    for j in jobs:
        j.needs = None
        if j.meta["kind"] == "bench":
            j.command = f'{shlex.quote(sys.executable)} {__file__} fake-bench "$JOB_OUT" {j.gpus}'
    for sub in ("jobs", "logs", "out"):
        (state / sub).mkdir(parents=True, exist_ok=True)
    write_json(state / "plan.json", [asdict(j) for j in jobs])  # type: ignore[arg-type]
    write_json(state / "meta.json", {"commit": commit(), "source_digest": source_digest(), "gpus": total,
                                     "device": "cpu (rehearsal)", "versions": _versions()})
    schedule(state, total)
    return wait(0, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("plan", "start"):
        p = sub.add_parser(name)
        p.add_argument("--gpus", type=int, default=None)
        if name == "start":
            p.add_argument("--only")
            p.add_argument("--skip")
    p = sub.add_parser("wait")
    p.add_argument("seconds", type=float)
    p.add_argument("out", type=Path)
    p = sub.add_parser("combine")
    p.add_argument("folders", type=Path, nargs="+")
    p.add_argument("--out", type=Path, required=True)
    sub.add_parser("rehearse").add_argument("out", type=Path)
    sub.add_parser("eval-prep")
    sub.add_parser("eval").add_argument("--gpus", type=int, required=True)
    p = sub.add_parser("fake-bench")
    p.add_argument("out", type=Path)
    p.add_argument("gpus", type=int)
    sub.add_parser("_schedule").add_argument("total", type=int)
    a = parser.parse_args(argv)
    if a.command in ("plan", "start"):
        total = a.gpus or gpu_count()
        if total < 1:
            print("no CUDA GPU here: give --gpus N (plan) or run on the GPU host", file=sys.stderr)
            return 2
        if a.command == "plan":
            for j in plan(total):
                print(f"{j.name:<24} gpus={j.gpus} tier={j.tier} ~{j.minutes:.0f} min  after={','.join(j.after) or '-'}\n"
                      f"    {j.command}")
            return 0
        return start(total, a.only, a.skip)
    if a.command == "wait":
        return wait(a.seconds, a.out)
    if a.command == "combine":
        combine(a.folders, a.out)
        return 0
    if a.command == "rehearse":
        return rehearse(a.out)
    if a.command == "eval-prep":
        return eval_prep()
    if a.command == "eval":
        return evaluate(a.gpus)
    if a.command == "fake-bench":
        return fake_bench(a.out, a.gpus)
    schedule(state_dir(), a.total)
    return 0


if __name__ == "__main__":
    sys.exit(main())
