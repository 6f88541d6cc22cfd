"""Where the rest of a steady bf16 step goes (everything but the rollout: the loss pass, the optimizer, TRL's
bookkeeping), for benchmarks/NOTES.md ("What limits the remaining gap"). Diagnostic, CUDA only.

Runs `vlmrl bench`'s vlmrl path (seed recipe, Qwen3-VL-8B shapes, random weights) for two steps and profiles the
second step from the end of its rollout to the end of the step with torch.profiler. Writes OUTDIR/step_profile.json:
the phase's wall time, GPU kernel time by kind (matmuls, attention, Triton/elementwise, copies, the rest), the
time inside TRL's `compute_loss` (forward) and `accelerator.backward`, and the top kernels and operators; and
OUTDIR/step_profile.txt, torch's own table. Usage: python benchmarks/step_profile.py OUTDIR [COMPLETION]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from vlmrl import bench

KINDS = [("matmul", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "splitk")),
         ("attention", ("flash", "fmha", "attention", "cudnn")),
         ("copy", ("memcpy", "memset", "copy_kernel", "catarraybatchedcopy")),
         ("triton / fused elementwise", ("triton",)),
         ("elementwise / reduction (aten)", ("elementwise", "reduce", "vectorized", "unrolled", "softmax", "norm"))]


def kind(name: str) -> str:
    lowered = name.lower()
    return next((k for k, keys in KINDS if any(key in lowered for key in keys)), "other")


def main(out: Path, completion: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    state: dict = {"calls": 0, "prof": None, "start": 0.0}
    wrap, make_callback = bench.StepClock.wrap_generation, bench.StepClock.callback

    def wrap_generation(self, trainer):
        wrap(self, trainer)
        timed = trainer._generate_single_turn
        compute_loss, backward = trainer.compute_loss, trainer.accelerator.backward

        def labelled_loss(*args, **kwargs):
            with record_function("vlmrl: compute_loss (forward)"):
                return compute_loss(*args, **kwargs)

        def labelled_backward(*args, **kwargs):
            with record_function("vlmrl: backward"):
                return backward(*args, **kwargs)

        def generate(*args, **kwargs):
            result = timed(*args, **kwargs)
            state["calls"] += 1
            if state["calls"] == 2:  # the steady step's rollout is over: profile the rest of the step
                torch.cuda.synchronize()
                state["prof"] = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                state["prof"].__enter__()
                state["start"] = time.perf_counter()
            return result

        trainer._generate_single_turn = generate
        trainer.compute_loss = labelled_loss
        trainer.accelerator.backward = labelled_backward

    def callback(self):
        clock = make_callback(self)
        step_end = clock.on_step_end

        def on_step_end(*args, **kwargs):
            result = step_end(*args, **kwargs)
            if state["prof"] is not None and "wall" not in state:
                torch.cuda.synchronize()
                state["wall"] = time.perf_counter() - state["start"]
                state["prof"].__exit__(None, None, None)
            return result

        clock.on_step_end = on_step_end
        return clock

    bench.StepClock.wrap_generation, bench.StepClock.callback = wrap_generation, callback
    settings = bench.BenchSettings(paths=["vlmrl"], steps=2, completion=completion)
    with tempfile.TemporaryDirectory() as work:
        summary = bench.run_bench(settings, out / "bench", Path(work))
    prof = state["prof"]
    if prof is None or "wall" not in state:
        raise SystemExit("the second step's rest was not profiled (did the run finish two steps?)")
    kernels, by_kind = Counter(), Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            us = event.time_range.end - event.time_range.start
            kernels[event.name] += us
            by_kind[kind(event.name)] += us
    ranges = {e.key: {"cpu_s": e.cpu_time_total / 1e6, "device_s": getattr(e, "device_time_total", 0) / 1e6,
                      "calls": e.count}
              for e in prof.key_averages() if e.key.startswith("vlmrl: ")}
    ops = sorted(((e.key, getattr(e, "self_device_time_total", 0) / 1e6, e.count) for e in prof.key_averages()
                  if not e.key.startswith("vlmrl: ")), key=lambda r: -r[1])[:30]
    result = {
        "rest_wall_s": state["wall"],
        "kernel_s": sum(kernels.values()) / 1e6,
        "kernel_s_by_kind": {k: v / 1e6 for k, v in by_kind.most_common()},
        "ranges": ranges,
        "top_kernels": [(name[:160], us / 1e6) for name, us in kernels.most_common(25)],
        "top_ops_self_device_s": ops,
        "bench_step": summary["paths"]["vlmrl"],
    }
    (out / "step_profile.json").write_text(json.dumps(result, indent=2, default=str))
    (out / "step_profile.txt").write_text(prof.key_averages().table(sort_by="self_device_time_total", row_limit=60))
    print(json.dumps({k: result[k] for k in ("rest_wall_s", "kernel_s", "kernel_s_by_kind", "ranges")}, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1024)
