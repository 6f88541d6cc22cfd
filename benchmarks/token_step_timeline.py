"""A few token steps of a bench rollout as a timeline (torch.profiler with CUPTI): the wall time per token step
against the GPU's busy time in it, and what the host spent it on. Diagnostic, CUDA only.

Nsight Compute (`token_step_ncu.py`) replays every kernel alone, so its times add up without launch gaps: it
cannot see a token step that is slower than its kernels. This one runs the bench (`--path`: `vlmrl`, or a bench
variant's name from benchmarks/variants) at normal speed and, in rollout R (`--rollout`), records token steps K to
K+N (`--token-step`, `--steps`) with torch.profiler (and times steps K-N to K without it, as the profiler's own
cost on the host shows), then stops the run as `token_step_ncu.py` does.

Writes OUT/token_step_timeline.json and .md, per token step: the wall time (host clock, between the logits
processor's calls at K and K+N, the GPU synchronized at both ends); the GPU's busy time (the union of its
kernels', copies' and memsets' intervals), their summed time and count; the idle time (wall - busy) and the
gaps between GPU work longer than 20 us; the CUDA runtime calls (graph launches, kernel launches, copies,
synchronizations) by count and host time; the host ops with the most self time.

Usage (CUDA): python benchmarks/token_step_timeline.py OUT [--path vlmrl-4bit-stacked] [--load-in-4bit
    --memory-cap-gib 24] [--completion 1024] [--token-step 64] [--steps 8] [--rollout 1]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections import defaultdict
from itertools import pairwise
from pathlib import Path

from token_step_ncu import WindowClosed, bench_arguments, run_until_window, say

from vlmrl.bench.comm import union

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
GAP_US = 20.0


def summarize(trace: dict, wall_s: float, steps: int, top_ops: list[dict]) -> dict:
    """Per token step figures from a chrome trace (torch.profiler's `export_chrome_trace`) of `steps` token steps
    that took `wall_s` on the host clock."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    if not gpu:
        raise ValueError("the trace holds no GPU event: was CUPTI on (ProfilerActivity.CUDA)?")
    intervals = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in gpu]
    spans = union(intervals)
    gaps = [start - end for (_, end), (start, _) in pairwise(spans) if start - end > GAP_US]
    runtime: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            runtime[e["name"]][0] += 1
            runtime[e["name"]][1] += float(e.get("dur", 0))
    wall_ms = wall_s * 1e3 / steps
    busy_ms = sum(stop - start for start, stop in spans) / 1e3 / steps
    return {
        "steps": steps,
        "wall_ms": wall_ms,
        "gpu_busy_ms": busy_ms,
        "gpu_summed_ms": sum(stop - start for start, stop in intervals) / 1e3 / steps,
        "gpu_events": len(gpu) / steps,
        "idle_ms": wall_ms - busy_ms,
        "gaps_over_20us": len(gaps) / steps,
        "gaps_over_20us_ms": sum(gaps) / 1e3 / steps,
        "largest_gaps_us": sorted(gaps, reverse=True)[:10],
        "runtime": sorted(({"name": name, "calls": calls / steps, "host_ms": us / 1e3 / steps}
                           for name, (calls, us) in runtime.items()), key=lambda r: -r["host_ms"]),
        "top_host_ops": top_ops,
    }


def markdown(result: dict) -> str:
    s = result["timeline"]
    head = (f"`{result['path']}`, {s['steps']} token steps from step {result['token_step']} of rollout "
            f"{result['rollout']} ({result['device']}):")
    lines = [head, "",
             "| per token step | ms |", "|---|---|",
             f"| wall, the same number of token steps just before, unprofiled | {result['unprofiled_wall_ms']:.2f} |",
             f"| wall (host clock), profiled | {s['wall_ms']:.2f} |",
             f"| GPU busy (union of its work) | {s['gpu_busy_ms']:.2f} |",
             f"| GPU work summed ({s['gpu_events']:.0f} kernels, copies, memsets) | {s['gpu_summed_ms']:.2f} |",
             f"| GPU idle (wall - busy) | {s['idle_ms']:.2f} |",
             f"| of which gaps over 20 us ({s['gaps_over_20us']:.1f} a step) | {s['gaps_over_20us_ms']:.2f} |",
             "", "| CUDA runtime call | calls per step | host ms per step |", "|---|---|---|"]
    lines += [f"| `{r['name']}` | {r['calls']:.1f} | {r['host_ms']:.3f} |" for r in s["runtime"][:12]]
    lines += ["", "| host op (self time) | calls per step | ms per step |", "|---|---|---|"]
    lines += [f"| `{r['name'][:80]}` | {r['calls']:.1f} | {r['ms']:.3f} |" for r in s["top_host_ops"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = bench_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--token-step", type=int, default=64, help="the first recorded step (1 = the first)")
    parser.add_argument("--steps", type=int, default=8, help="how many token steps are recorded")
    args = parser.parse_args()
    if args.steps < 1 or not args.steps < args.token_step < args.token_step + args.steps < args.completion:
        parser.error(f"--token-step {args.token_step} --steps {args.steps}: the window must start after --steps "
                     f"token steps (the same number run unprofiled first) and end below --completion "
                     f"({args.completion})")
    import torch
    from torch.profiler import ProfilerActivity, profile

    class Window:
        def __init__(self) -> None:
            self.calls, self.profiler, self.started, self.wall_s, self.plain_s = 0, None, 0.0, 0.0, 0.0

        def __call__(self, input_ids, scores):
            self.calls += 1
            if self.calls == args.token_step - args.steps:
                torch.cuda.synchronize()
                self.started = time.perf_counter()
            elif self.calls == args.token_step:
                torch.cuda.synchronize()
                self.plain_s = time.perf_counter() - self.started
                say(f"recording from token step {args.token_step}")
                self.profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                self.profiler.start()
                self.started = time.perf_counter()
            elif self.calls == args.token_step + args.steps:
                torch.cuda.synchronize()
                self.wall_s = time.perf_counter() - self.started
                self.profiler.stop()
                say(f"recorded {args.steps} token steps, {self.wall_s * 1e3 / args.steps:.2f} ms each")
                raise WindowClosed
            return scores

    args.out.mkdir(parents=True, exist_ok=True)
    window = Window()
    record = run_until_window(args, window)
    with tempfile.TemporaryDirectory() as tmp:
        trace_path = Path(tmp) / "trace.json"
        window.profiler.export_chrome_trace(str(trace_path))
        trace = json.loads(trace_path.read_text())
    averages = sorted((e for e in window.profiler.key_averages()
                       if e.device_type == torch.autograd.DeviceType.CPU),
                      key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    top_ops = [{"name": e.key, "calls": e.count / args.steps, "ms": e.self_cpu_time_total / 1e3 / args.steps}
               for e in averages]
    result = {**record, "path": args.path, "token_step": args.token_step,
              "command": "python benchmarks/token_step_timeline.py OUT " + " ".join(sys.argv[2:]),
              "timeline": summarize(trace, window.wall_s, args.steps, top_ops),
              "unprofiled_wall_ms": window.plain_s * 1e3 / args.steps}
    (args.out / "token_step_timeline.json").write_text(json.dumps(result, indent=2))
    (args.out / "token_step_timeline.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
