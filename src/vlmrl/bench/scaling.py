"""The multi-GPU record: one row per configuration (strategy, GPUs, precision, shapes) from the bench records of
`benchmarks/gpu_scaling.sh`, and whether evaluation sharded over N GPUs wrote one GPU's records.

Per row: samples/s, scaling efficiency (samples/s over N times the one-GPU DDP row of the same shapes, precision
and completion length), step seconds, peak memory of every GPU beside the preflight's prediction for one GPU of
that configuration (`vlmrl.run.preflight.estimate_memory`), and the communication share from the profiled step
(`vlmrl.bench.comm`: NCCL kernel time over the steady step, and the part no other kernel overlaps), the largest
over the ranks. Pure bookkeeping over JSON, tested on the CPU; left out: running anything (the plan script).
"""

from __future__ import annotations

import math

from vlmrl.bench.comm import comm_share

EVAL_KEYS = ("completion", "pred", "correct", "format_ok")  # what must match between the two evaluations


def configuration_row(job: dict, bench: dict | None) -> dict:
    """One configuration's figures from its job record and its bench.json (None when the bench wrote none)."""
    row = {key: job.get(key) for key in ("job", "strategy", "gpus", "shapes", "load_in_4bit", "completion",
                                         "memory_cap_gib", "rc", "commit", "source_digest", "beside")}
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
    from vlmrl.run.preflight import estimate_memory, load_shapes

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


def beside(job: dict, jobs: list[dict]) -> list[str]:
    """The other jobs whose run overlapped this one's (they shared the host, not its GPUs).

    >>> jobs = [{"job": "a", "started": 0, "ended": 10}, {"job": "b", "started": 5, "ended": 20},
    ...         {"job": "c", "started": 10, "ended": 12}]
    >>> beside(jobs[0], jobs), beside(jobs[2], jobs)
    (['b'], ['b'])
    """
    if job.get("started") is None or job.get("ended") is None:
        return []
    return [j["job"] for j in jobs if j is not job and j.get("started") is not None and j.get("ended") is not None
            and j["started"] < job["ended"] and job["started"] < j["ended"]]


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
              "| predicted GiB (measured / predicted) | comm share (exposed) | ran beside |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        label = (f"{r['strategy']} {r['shapes']} {'4-bit' if r['load_in_4bit'] else 'bf16'} {r['completion']} tok"
                 + (f", cap {r['memory_cap_gib']:g} GiB" if r.get("memory_cap_gib") else ""))
        if "samples_per_second" not in r:
            lines.append(f"| {label} | {r['gpus']} | failed: {str(r['error'])[:160]} | | | | | | | |")
            continue
        peaks = ", ".join(f"{p:.1f}" for p in r["peak_gib_per_gpu"])
        comm = (f"{r['comm_share']:.1%} ({r['exposed_share']:.1%})" if r.get("comm_share") is not None else "")
        predicted = (f"{r['predicted_peak_gib']:.1f} ({r['measured_over_predicted']:.2f}x)"
                     if r.get("predicted_peak_gib") else "")
        lines.append(
            f"| {label} | {r['gpus']} | {r['samples_per_second']:.2f} | {_fmt(r.get('efficiency'), '.2f')} | "
            f"{r['step_seconds']:.1f} | {r['generate_seconds']:.1f} | {peaks} | {predicted} | {comm} | "
            f"{', '.join(r.get('beside') or []) or 'alone'} |")
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
