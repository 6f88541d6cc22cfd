"""vlmrl's training step on 1, 2, 4 and 8 GPUs of one host (DDP, FSDP2, ZeRO-2), the Qwen3-VL-32B shapes under FSDP,
and evaluation sharded over N GPUs against one GPU; then the multi-GPU record from what ran.

    python benchmarks/gpu_scaling.py plan [--gpus N]          the configurations for a host of N GPUs, in run order
    python benchmarks/gpu_scaling.py run OUT [--gpus N] [--only P]   run them one after the other into OUT/<job>/
                                                              (P: comma-separated name patterns), then the record
    python benchmarks/gpu_scaling.py combine OUT --out PREFIX  PREFIX.{json,md} from OUT/<job>/ folders

Each configuration is `vlmrl bench --paths vlmrl` (the seed recipe: 8 prompts x 4 generations per GPU, LoRA r=16,
GSPO) under `accelerate launch` with the shipped config of its strategy; with several GPUs one more step is
profiled for the NCCL kernel time (`--comm-profile`, vlmrl.bench.comm). ZeRO-2 needs DeepSpeed installed (its jobs
are skipped, and say so, without it). Per configuration the record has samples/s, the scaling efficiency against
one GPU, step seconds, the peak of every GPU beside the preflight's prediction, and the communication share.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import importlib.util
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
              cap: float | None = None, python: str = "python3") -> dict:
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
    env = "DS_ACCELERATOR=cuda " if strategy.startswith("zero") else ""
    return {"job": name, "kind": "bench", "tier": tier, "command": f'{env}{shlex.join(argv)} --out "$JOB_OUT"',
            "strategy": strategy, "gpus": gpus, "shapes": shapes, "load_in_4bit": four_bit, "completion": completion,
            "steps": steps, "memory_cap_gib": cap, "needs": "deepspeed" if strategy.startswith("zero") else None}


def plan(total: int, python: str = "python3") -> list[dict]:
    """Every configuration for a host of `total` GPUs, in run order: tier 1 (DDP bf16 at every count, FSDP and
    ZeRO-2 at the largest, the 32B rows, the evaluation), then 4-bit, then the counts in between."""
    counts = [c for c in COUNTS if c <= total]
    top = counts[-1]
    me = "benchmarks/gpu_scaling.py"
    jobs = [{"job": "eval_prep", "kind": "eval_prep", "tier": 1, "gpus": 1, "command": f"{python} {me} eval-prep"}]
    jobs += [bench_job("ddp", n, 1, python=python) for n in counts]
    if top > 1:
        jobs += [bench_job("fsdp", top, 1, python=python), bench_job("zero2", top, 1, python=python),
                 bench_job("fsdp", 2, 1, shapes="qwen3_vl_32b", cap=CAP_32B, python=python)]
    jobs.append(bench_job("ddp", 1, 1, shapes="qwen3_vl_32b", python=python))  # fits one H200 (141 GB)
    jobs += [{"job": f"eval_g{n}", "kind": "eval", "tier": 1, "gpus": n, "command": f"{python} {me} eval --gpus {n}"}
             for n in sorted({1, top})]
    jobs += [bench_job("ddp", n, 2, four_bit=True, python=python) for n in sorted({1, top})]
    for n in counts[1:-1]:
        jobs += [bench_job("fsdp", n, 3, python=python), bench_job("zero2", n, 3, python=python),
                 bench_job("ddp", n, 3, four_bit=True, python=python)]
    return jobs


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def source_digest() -> str:
    """A short hash of src/vlmrl's files: names the code a record ran, also where no git is."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "src" / "vlmrl").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def commit() -> str | None:
    if os.environ.get("VLMRL_COMMIT"):
        return os.environ["VLMRL_COMMIT"]
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    return done.stdout.strip() or None


def run(out: Path, total: int, only: str | None) -> int:
    """Every configuration (or those matching `only`), one after the other, each into out/<job>/; then the record."""
    from vlmrl.bench.summary import versions

    jobs = plan(total)
    if only:
        patterns = only.split(",")
        jobs = [j for j in jobs if j["kind"] == "eval_prep" or any(fnmatch.fnmatch(j["job"], p) for p in patterns)]
    out.mkdir(parents=True, exist_ok=True)
    device = None
    try:
        import torch

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:
        pass
    (out / "meta.json").write_text(json.dumps({"commit": commit(), "source_digest": source_digest(), "gpus": total,
                                               "device": device, "versions": versions()}, indent=2))
    for job in jobs:
        folder = out / job["job"]
        folder.mkdir(exist_ok=True)
        if job.get("needs") and importlib.util.find_spec(job["needs"]) is None:
            record = job | {"rc": None, "error": f"{job['needs']} is not installed"}
        else:
            print(f"+ {job['job']}: {job['command']}", flush=True)
            with open(folder / "log.txt", "w") as log:
                rc = subprocess.run(job["command"], shell=True, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "JOB_OUT": str(folder)}, check=False).returncode
            record = job | {"rc": rc}
        (folder / "job.json").write_text(json.dumps(record, indent=2))
    combine(out, out / "h200_multi_gpu")
    return 0


def combine(out: Path, prefix: Path) -> dict:
    """The record from out/<job>/{job.json, bench.json, records.jsonl}: one row per bench job, the evaluation
    check, what did not run."""
    from vlmrl.common.io import read_jsonl

    meta = json.loads((out / "meta.json").read_text()) if (out / "meta.json").exists() else {}
    records = [json.loads(p.read_text()) | {"commit": meta.get("commit"), "source_digest": meta.get("source_digest")}
               for p in sorted(out.glob("*/job.json"))]
    rows = []
    for record in records:
        if record.get("kind") == "bench":
            bench = out / record["job"] / "bench.json"
            rows.append(configuration_row(record, json.loads(bench.read_text()) if bench.exists() else None))
    strategies = ("ddp", "fsdp", "zero2", "zero3")
    rows.sort(key=lambda r: (r["shapes"], bool(r["load_in_4bit"]), strategies.index(r["strategy"]), r["gpus"]))
    rows = add_prediction(add_efficiency(rows))
    evaluation = None
    evals = sorted((r for r in records if r.get("kind") == "eval" and r.get("rc") == 0), key=lambda r: r["gpus"])
    if len(evals) >= 2 and evals[0]["gpus"] == 1:
        one, many = (read_jsonl(out / r["job"] / "records.jsonl") for r in (evals[0], evals[-1]))
        evaluation = compare_records(list(one), list(many)) | {"gpus": evals[-1]["gpus"]}
    meta["not_run"] = sorted(r["job"] for r in records if r.get("rc") != 0)
    result = {"meta": meta, "rows": rows, "evaluation": evaluation, "jobs": records}
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(result, indent=2, default=str))
    prefix.with_suffix(".md").write_text(markdown(rows, evaluation, meta))
    return result


# --- the evaluation jobs ----------------------------------------------------------------------------------------------

def _work() -> Path:
    return Path(os.environ.get("VLMRL_SCALING_WORK", "/tmp/vlmrl-scaling"))


def eval_settings(model: str, work: Path, name: str) -> list[str]:
    return [*shlex.split(EVAL), "--set", f"model.name={model}", "--set", f"run.output_dir={work / 'runs'}",
            "--set", f"run.name={name}"]


def eval_prep() -> int:
    """The random-weight Qwen3-VL-8B model (or $MODEL), a prepared run, and a copy of it for the N-GPU evaluation."""
    work = _work() / "eval"
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
    work = _work() / "eval"
    folder = work / "runs" / ("one" if gpus == 1 else "many")
    # the copy keeps the prepared run's config (run.name one) and is named by --run-dir
    _vlmrl(["eval", "demo", *eval_settings((work / "model").read_text(), work, "one"), "--run-dir", str(folder),
            *(["--gpus", str(gpus)] if gpus > 1 else [])])
    found = sorted(folder.rglob("baseline_records.jsonl"))
    shutil.copy(found[0], Path(os.environ["JOB_OUT"]) / "records.jsonl")
    return 0


def _vlmrl(args: list[str]) -> None:
    print("+ vlmrl " + shlex.join(args), flush=True)
    subprocess.run([sys.executable, "-m", "vlmrl.cli", *args], cwd=ROOT, check=True)


# --- the record -------------------------------------------------------------------------------------------------------

EVAL_KEYS = ("completion", "pred", "correct", "format_ok")  # what must match between the two evaluations


def configuration_row(job: dict, bench: dict | None) -> dict:
    """One configuration's figures from its job record and its bench.json (None when the bench wrote none)."""
    from vlmrl.bench.comm import comm_share

    row = {key: job.get(key) for key in ("job", "strategy", "gpus", "shapes", "load_in_4bit", "completion",
                                         "memory_cap_gib", "rc", "commit", "source_digest")}
    path = (bench or {}).get("paths", {}).get("vlmrl", {})
    if "step_seconds" not in path:
        row["error"] = path.get("error") or job.get("error") or f"no bench record (exit {job.get('rc')})"
        return row
    peaks = path["peak_memory_gib_per_rank"]
    row.update({
        "error": path.get("error"),
        "world_size": path["world_size"],
        "samples_per_second": path["samples_per_second"],
        "step_seconds": path["step_seconds"],
        "generate_seconds": path["generate_seconds"],
        "steps_measured": path["steps_measured"],
        "peak_gib_per_gpu": peaks,
        "peak_gib_max": max(peaks),
        "prompt_tokens": bench.get("prompt_tokens"),
        "versions": bench.get("versions"),
    })
    ranks = [r for r in path.get("communication_per_rank") or [] if r and "comm_seconds" in r]
    if ranks:
        shares = [comm_share(r, path["step_seconds"]) for r in ranks]
        row["comm_share"] = max(s["comm_share"] for s in shares)
        row["exposed_share"] = max(s["exposed_share"] for s in shares)
        row["comm_seconds_by_collective"] = ranks[0].get("seconds_by_collective")
    return row


def add_efficiency(rows: list[dict]) -> list[dict]:
    """Scaling efficiency of every row against the one-GPU DDP row of the same shapes, precision and completion:
    samples/s / (N x one GPU's samples/s). A row without such a reference gets None.

    >>> rows = [{"strategy": "ddp", "gpus": 1, "shapes": "s", "load_in_4bit": False, "completion": 8,
    ...          "samples_per_second": 2.0},
    ...         {"strategy": "fsdp", "gpus": 4, "shapes": "s", "load_in_4bit": False, "completion": 8,
    ...          "samples_per_second": 7.0}]
    >>> [r["efficiency"] for r in add_efficiency(rows)]
    [1.0, 0.875]
    """
    def key(row: dict) -> tuple:
        return row.get("shapes"), bool(row.get("load_in_4bit")), row.get("completion")

    one = {key(r): r["samples_per_second"] for r in rows
           if r.get("strategy") == "ddp" and r.get("gpus") == 1 and r.get("samples_per_second")}
    for r in rows:
        reference = one.get(key(r))
        r["efficiency"] = (r["samples_per_second"] / (r["gpus"] * reference)
                           if reference and r.get("samples_per_second") else None)
    return rows


def add_prediction(rows: list[dict]) -> list[dict]:
    """The preflight's per-GPU peak for each row's configuration (the seed recipe as the bench runs it: bf16 with
    AdamW, 4-bit with 8-bit Adam) and the measured peak's ratio to it."""
    from vlmrl.bench.shaped import seed_overrides
    from vlmrl.config.schema import load_config
    from vlmrl.preflight.memory import estimate_memory, load_shapes

    for r in rows:
        if not r.get("peak_gib_max") or not r.get("prompt_tokens"):
            continue
        overrides = seed_overrides({"load_in_4bit": r["load_in_4bit"], "completion": r["completion"]})
        estimate = estimate_memory(load_config("seed", overrides), load_shapes(r["shapes"]),
                                   prompt_tokens=r["prompt_tokens"], fast_generation=True, gpus=r["gpus"],
                                   strategy=r["strategy"])
        r["predicted_peak_gib"] = estimate.peak_gib
        r["measured_over_predicted"] = r["peak_gib_max"] / estimate.peak_gib
    return rows


def compare_records(one: list[dict], many: list[dict]) -> dict:
    """One GPU's evaluation records against N GPUs': the same ids, and completion, extracted answer, grade and
    format verdict equal per id.

    >>> compare_records([{"id": "a", "completion": "x"}], [{"id": "a", "completion": "x"}])["identical"]
    1
    """
    a, b = {r["id"]: r for r in one}, {r["id"]: r for r in many}
    same = [i for i in a if i in b and all(a[i].get(k) == b[i].get(k) for k in EVAL_KEYS)]
    return {"records_one_gpu": len(a), "records_n_gpus": len(b), "ids_equal": sorted(a) == sorted(b),
            "identical": len(same), "differing_ids": sorted((set(a) ^ set(b)) | (set(a) & set(b)) - set(same))}


def markdown(rows: list[dict], evaluation: dict | None, meta: dict) -> str:
    """The record's table: one line per configuration, then the evaluation check and what did not run."""
    lines = [(f"Measured at commit {meta.get('commit')} (source digest {meta.get('source_digest')}) on "
              f"{meta.get('device')}; versions {meta.get('versions')}."), "",
             ("| configuration | GPUs | samples/s | efficiency | step s | generate s | peak GiB per GPU "
              "| predicted GiB (measured / predicted) | comm share (exposed) |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        label = (f"{r['strategy']} {r['shapes']} {'4-bit' if r['load_in_4bit'] else 'bf16'} {r['completion']} tok"
                 + (f", cap {r['memory_cap_gib']:g} GiB" if r.get("memory_cap_gib") else ""))
        if "samples_per_second" not in r:
            lines.append(f"| {label} | {r['gpus']} | failed: {str(r['error'])[:160]} | | | | | | |")
            continue
        peaks = ", ".join(f"{p:.1f}" for p in r["peak_gib_per_gpu"])
        comm = (f"{r['comm_share']:.1%} ({r['exposed_share']:.1%})" if r.get("comm_share") is not None else "")
        predicted = (f"{r['predicted_peak_gib']:.1f} ({r['measured_over_predicted']:.2f}x)"
                     if r.get("predicted_peak_gib") else "")
        lines.append(
            f"| {label} | {r['gpus']} | {r['samples_per_second']:.2f} | {_fmt(r.get('efficiency'), '.2f')} | "
            f"{r['step_seconds']:.1f} | {r['generate_seconds']:.1f} | {peaks} | {predicted} | {comm} |")
    lines += ["", ("Efficiency: samples/s over N x the one-GPU DDP row of the same shapes, precision and completion. "
                   "Comm share: NCCL kernel time of the profiled step over the steady step (largest rank); in brackets "
                   "the part no other kernel overlapped.")]
    if evaluation:
        lines.append(f"Evaluation: {evaluation['records_one_gpu']} records on 1 GPU, {evaluation['records_n_gpus']} on "
                     f"{evaluation.get('gpus', 'N')} GPUs, ids equal: {evaluation['ids_equal']}, identical "
                     f"(completion, extraction, grade, format): {evaluation['identical']} of "
                     f"{evaluation['records_one_gpu']}.")
    if meta.get("not_run"):
        lines.append(f"Not run: {', '.join(meta['not_run'])}.")
    return "\n".join(lines) + "\n"


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--gpus", type=int)
    p = sub.add_parser("run")
    p.add_argument("out", type=Path)
    p.add_argument("--gpus", type=int)
    p.add_argument("--only")
    p = sub.add_parser("combine")
    p.add_argument("out", type=Path)
    p.add_argument("--out", dest="prefix", type=Path, required=True)
    sub.add_parser("eval-prep")
    sub.add_parser("eval").add_argument("--gpus", type=int, required=True)
    args = parser.parse_args(argv)
    if args.command == "plan":
        for job in plan(args.gpus or gpu_count() or 1):
            print(f"{job['job']:<24} tier {job['tier']}  {job['command']}")
        return 0
    if args.command == "run":
        return run(args.out, args.gpus or gpu_count(), args.only)
    if args.command == "combine":
        combine(args.out, args.prefix)
        return 0
    if args.command == "eval-prep":
        return eval_prep()
    return evaluate(args.gpus)


if __name__ == "__main__":
    sys.exit(main())
