"""Jobs on the GPUs of one host, detached from the command that starts them: a plan of jobs (each a bash command
that needs some GPUs, maybe after other jobs), started in order as soon as their GPUs are free, each job's record,
exit status and log kept in a state folder that later commands read, and packed for the trip back.

What `benchmarks/gpu_scaling.py` runs its plan with (the device tool gives a command 10 minutes, a machine 30);
unlike `gpu_parallel.sh`'s one queue per GPU, a job here may take several GPUs at once. Lab tooling: no tests with
the product. Left out: estimating durations to let a later, smaller job jump the queue.
"""

from __future__ import annotations

import contextlib
import fnmatch
import io
import json
import os
import shutil
import signal
import subprocess
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Multicast over NVLink stays off on the lent hosts (it can take the host's GPUs out of service); kept in every
# job's environment, also where a launcher builds its own.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass
class Job:
    name: str
    gpus: int
    tier: int  # 1: what issue 41's "done when" needs; 2: 4-bit; 3: the counts in between
    command: str  # bash, from the repository root; $JOB_OUT is the job's result folder
    minutes: float  # estimated, for the plan's schedule (no measurement yet)
    after: list[str] = field(default_factory=list)  # jobs that must have ended with exit 0 first
    meta: dict = field(default_factory=dict)  # what vlmrl.bench.scaling reads: strategy, shapes, precision, ...
    needs: str | None = None  # a module that must import here (deepspeed)
    timeout_minutes: float = 20.0


def order(jobs: list[Job], total: int) -> list[Job]:
    """Tier by tier, waves that fill the host: each wave takes, in list order, the jobs that fit the GPUs left and
    whose dependencies ran in an earlier wave. The scheduler then starts jobs strictly in this order."""
    out: list[Job] = []
    for tier in sorted({j.tier for j in jobs}):
        left = [j for j in jobs if j.tier == tier]
        while left:
            free, wave = total, []
            for job in list(left):
                if job.gpus <= free and set(job.after) <= {j.name for j in out}:
                    wave.append(job)
                    free -= job.gpus
                    left.remove(job)
            if not wave:
                raise ValueError(f"cannot schedule {[j.name for j in left]} on {total} GPUs")
            out += wave
    return out


def matches(name: str, patterns: str | None) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in (patterns or "").split(",") if p)


def state_dir() -> Path:
    return Path(os.environ.get("VLMRL_SCALING_STATE", "/tmp/vlmrl-scaling"))


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    tmp.replace(path)


def schedule(state: Path, total: int) -> None:
    """Run plan.json's jobs: each as soon as the GPUs it needs are free and every job before it has started."""
    queue = [Job(**j) for j in json.loads((state / "plan.json").read_text())]
    free, running = list(range(total)), {}
    while queue or running:
        for name, (proc, ids, record, deadline) in list(running.items()):
            if proc.poll() is None and time.time() > deadline:
                # SIGTERM first: torchrun's agent then stops its workers, which run in sessions of their own and
                # would outlive a SIGKILL of this group, holding their GPUs; SIGKILL half a minute later
                late = "error" in record
                record.setdefault("error", f"timed out after {(deadline - record['started']) / 60:.0f} minutes")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL if late else signal.SIGTERM)
                running[name] = (proc, ids, record, time.time() + 30)
            if proc.poll() is not None:
                record.update(status="ended", rc=proc.returncode, ended=time.time())
                write_json(state / "jobs" / f"{name}.json", record)
                free = sorted(free + ids)
                del running[name]
        while queue:
            job = queue[0]
            record = {"job": job.name, **job.meta, "gpus": job.gpus, "status": "queued"}
            # a dependency is earlier in the queue, so it has started by now, or it ran in an earlier start
            deps = {n: job_record(state, n) for n in job.after}
            failed = [n for n, r in deps.items()
                      if r.get("status") != "running" and not (r.get("status") == "ended" and r.get("rc") == 0)]
            missing = job.needs and not _importable(job.needs)
            if failed or missing:
                why = f"needs {', '.join(failed)}, which did not end well" if failed else f"{job.needs} is not installed"
                write_json(state / "jobs" / f"{job.name}.json", record | {"status": "skipped", "error": why})
                queue.pop(0)
                continue
            if len(free) < job.gpus or any(r.get("status") == "running" for r in deps.values()):
                break
            ids, free = free[:job.gpus], free[job.gpus:]
            out = state / "out" / job.name
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            env = {**os.environ, **SAFE_ENV, "CUDA_VISIBLE_DEVICES": ",".join(map(str, ids)), "JOB_OUT": str(out),
                   "VLMRL_SCALING_STATE": str(state), "PYTHONUNBUFFERED": "1"}
            with open(state / "logs" / f"{job.name}.log", "w") as log:
                proc = subprocess.Popen(["bash", "-c", job.command], cwd=ROOT, env=env, stdout=log,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            record.update(status="running", started=time.time(), gpu_ids=ids, command=job.command)
            write_json(state / "jobs" / f"{job.name}.json", record)
            running[job.name] = (proc, ids, record, time.time() + 60 * job.timeout_minutes)
            queue.pop(0)
        time.sleep(1)


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def select(jobs: list[Job], state: Path, only: str | None, skip: str | None) -> list[Job]:
    """The jobs `only` names (all when None) less those `skip` names, with the dependencies they need, less the
    jobs that already ended well in `state` (this machine)."""
    chosen = {j.name for j in jobs if (not only or matches(j.name, only)) and not matches(j.name, skip)}
    chosen |= {d for j in jobs if j.name in chosen for d in j.after}  # a job's dependencies run first
    return [j for j in jobs if j.name in chosen and job_record(state, j.name).get("rc") != 0]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def job_record(state: Path, name: str) -> dict:
    path = state / "jobs" / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def table(state: Path) -> tuple[str, bool]:
    rows, pending = ["job                      gpus  state     rc    minutes  error"], False
    for path in sorted((state / "jobs").glob("*.json"), key=lambda p: p.stat().st_mtime):
        r = json.loads(path.read_text())
        pending |= r["status"] in ("queued", "running")
        end = r.get("ended") or time.time()
        minutes = f"{(end - r['started']) / 60:.1f}" if r.get("started") else "-"
        rows.append(f"{r['job']:<24} {r['gpus']:<5} {r['status']:<9} {r.get('rc', '-')!s:<5} {minutes:<8} "
                    f"{r.get('error') or ''}")
    return "\n".join(rows), not pending


def tail(path: Path, lines: int) -> list[str]:
    return path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []


def pack(state: Path, target: Path) -> None:
    """Every job's record, its result files under 4 MB, its log's last 400 lines, and meta.json."""
    with tarfile.open(target, "w:gz") as tar:
        for path in [state / "meta.json", *sorted((state / "jobs").glob("*.json")), *sorted((state / "out").rglob("*"))]:
            if path.is_file() and path.stat().st_size < 4 << 20:
                tar.add(path, arcname=str(path.relative_to(state)))
        for log in sorted((state / "logs").glob("*.log")):
            data = "\n".join(tail(log, 400)).encode()
            info = tarfile.TarInfo(f"logs/{log.name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
