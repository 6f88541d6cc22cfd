"""The communication share of a training step on several GPUs: NCCL kernel time, and the part of it no other
kernel overlaps, from torch.profiler over one whole optimizer step.

Why kernels and not a step timed with and without gradient sync: DDP overlaps its all-reduce with the backward,
ZeRO-2 cannot skip its reduce-scatter, and FSDP's all-gathers run in rollouts too, so "without sync" is a different
step for each strategy. The GPU's own timeline answers for all three: `comm_seconds` is the time at least one
NCCL kernel runs (an upper bound on what communication costs), `exposed_seconds` the time an NCCL kernel runs
while no other kernel or copy does (what the step would lose if communication were free). An NCCL kernel also
waits for the slowest rank, so rank imbalance shows here as communication.

The profiled step is one more optimizer step after the measured ones and is left out of the step times (the
profiler slows kernel launches); the shares divide by the unprofiled steady step (`benchmarks/gpu_scaling.py`).
Left out: NVTX ranges, CPU-side time in torch.distributed, and FSDP's copy-in/copy-out kernels (not NCCL).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)

COLLECTIVES = ("AllReduce", "AllGather", "ReduceScatter", "Broadcast", "SendRecv", "Reduce")


def is_comm(name: str) -> bool:
    """An NCCL kernel (`ncclDevKernel_AllReduce_Sum_f32_RING_LL(...)`, `ncclKernel_AllGather_...`).

    >>> is_comm("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"), is_comm("sm90_gemm")
    (True, False)
    """
    return name.lower().startswith("nccl")


def collective(name: str) -> str:
    """The collective an NCCL kernel runs, from its name ("other" when the name does not say).

    >>> collective("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL"), collective("ncclDevKernel_Generic_1")
    ('ReduceScatter', 'other')
    """
    return next((c for c in COLLECTIVES if c in name), "other")


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping or touching intervals merged, sorted.

    >>> union([(5, 7), (0, 2), (1, 3), (3, 4)])
    [(0, 4), (5, 7)]
    """
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def covered(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by the intervals, overlaps counted once."""
    return sum(end - start for start, end in union(intervals))


def uncovered(inner: Iterable[tuple[float, float]], outer: Iterable[tuple[float, float]]) -> float:
    """Length of the union of `inner` that no interval of `outer` covers.

    >>> uncovered([(0, 10)], [(2, 3), (5, 12)])  # 10 less 1 less 5
    4.0
    """
    others = union(outer)
    total = 0.0
    for start, end in union(inner):
        length = end - start
        for o_start, o_end in others:
            if o_end <= start or o_start >= end:
                continue
            length -= min(end, o_end) - max(start, o_start)
        total += length
    return total


def comm_figures(kernels: list[tuple[str, float, float]]) -> dict:
    """Seconds of communication in one profiled step from its GPU activities (name, start, end in seconds)."""
    comm = [(s, e) for name, s, e in kernels if is_comm(name)]
    other = [(s, e) for name, s, e in kernels if not is_comm(name)]
    by_collective: dict[str, float] = {}
    for name, s, e in kernels:
        if is_comm(name):
            kind = collective(name)
            by_collective[kind] = by_collective.get(kind, 0.0) + (e - s)
    span = (max(e for _, _, e in kernels) - min(s for _, s, _ in kernels)) if kernels else 0.0
    return {
        "comm_seconds": covered(comm),
        "exposed_seconds": uncovered(comm, other),
        "busy_seconds": covered([(s, e) for _, s, e in kernels]),
        "span_seconds": span,
        "comm_kernels": len(comm),
        "seconds_by_collective": dict(sorted(by_collective.items())),
    }


def comm_share(figures: dict, step_seconds: float) -> dict:
    """`comm_figures` as shares of a steady (unprofiled) step.

    >>> comm_share({"comm_seconds": 2.0, "exposed_seconds": 0.5}, 10.0)
    {'comm_share': 0.2, 'exposed_share': 0.05}
    """
    return {"comm_share": figures["comm_seconds"] / step_seconds,
            "exposed_share": figures["exposed_seconds"] / step_seconds}


class CommProfile:
    """Profiles optimizer step `step` (0-based) with torch.profiler, CUDA activities only, and keeps its
    `comm_figures` (None until that step has run; an empty dict where it could not be profiled)."""

    def __init__(self, step: int):
        self.step = step
        self.figures: dict | None = None
        self._profiler: Any = None

    def callback(self) -> Any:
        from transformers import TrainerCallback

        profile = self

        class Profile(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step == profile.step:
                    profile.start()

            def on_step_end(self, args, state, control, **kwargs):
                profile.stop()

        return Profile()

    def start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        if not torch.cuda.is_available():
            self.figures = {}
            return
        self._profiler = profile(activities=[ProfilerActivity.CUDA])
        self._profiler.__enter__()

    def stop(self) -> None:
        if self._profiler is None:
            return
        import torch

        torch.cuda.synchronize()
        self._profiler.__exit__(None, None, None)
        try:
            self.figures = comm_figures(gpu_activities(self._profiler))
        except Exception as exc:  # noqa: BLE001  (a profiler that cannot be read must not fail the bench)
            log.warning("communication profile unreadable: %s", exc)
            self.figures = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        self._profiler = None


def gpu_activities(profiler: Any) -> list[tuple[str, float, float]]:
    """(name, start s, end s) of every CUDA-side event of a finished torch.profiler run (kernels, copies, sets;
    not the synchronisation records, which are waits, not work), read from kineto's results directly: a whole
    step has hundreds of thousands of them."""
    import torch

    cuda = torch.autograd.DeviceType.CUDA
    return [(e.name(), e.start_ns() / 1e9, (e.start_ns() + e.duration_ns()) / 1e9)
            for e in profiler.profiler.kineto_results.events()
            if e.device_type() == cuda and not e.name().endswith("Sync")]
