"""The communication share of a step (vlmrl.bench.comm) and its place in the bench record: the interval arithmetic
over a GPU timeline, the profiled step left out of the step times, and `vlmrl bench --comm-profile / --shapes`."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from vlmrl.bench import BenchSettings, load_shapes, summarize
from vlmrl.bench.comm import CommProfile, comm_figures, comm_share, covered, uncovered, union
from vlmrl.cli.app import app

# A made-up GPU timeline, in seconds:
#   0 ---- 4            sm90_gemm (compute)
#        3 ------ 6     ncclDevKernel_AllReduce (overlaps the gemm from 3 to 4)
#                  7 -- 8     ncclDevKernel_AllGather
#                    7.5 ---- 9   Memcpy DtoD (overlaps the all-gather from 7.5 to 8)
TIMELINE = [("sm90_xmma_gemm_bf16", 0.0, 4.0),
            ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 3.0, 6.0),
            ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 7.0, 8.0),
            ("Memcpy DtoD (Device -> Device)", 7.5, 9.0)]


def test_interval_arithmetic():
    assert union([(3, 6), (0, 4), (7, 8)]) == [(0, 6), (7, 8)]
    assert covered([(0, 4), (3, 6), (7, 8)]) == 7
    # (3, 6) less (0, 4) leaves 2; (7, 8) less (7.5, 9) leaves 0.5
    assert uncovered([(3, 6), (7, 8)], [(0, 4), (7.5, 9)]) == 2.5
    assert uncovered([(0, 1)], []) == 1 and uncovered([], [(0, 1)]) == 0


def test_comm_figures_of_a_timeline():
    figures = comm_figures(TIMELINE)
    assert figures["comm_seconds"] == 4.0  # 3 s of all-reduce + 1 s of all-gather
    assert figures["exposed_seconds"] == 2.5  # what no gemm or copy overlaps
    assert figures["busy_seconds"] == 8.0  # (0, 6) and (7, 9)
    assert figures["span_seconds"] == 9.0
    assert figures["comm_kernels"] == 2
    assert figures["seconds_by_collective"] == {"AllGather": 1.0, "AllReduce": 3.0}
    assert comm_share(figures, 10.0) == {"comm_share": 0.4, "exposed_share": 0.25}
    assert comm_figures([])["comm_seconds"] == 0


def test_the_profile_starts_at_its_step_and_records_nothing_without_cuda():
    profile = CommProfile(step=2)
    callback = profile.callback()
    for step in (0, 1):
        callback.on_step_begin(None, SimpleNamespace(global_step=step), None)
        callback.on_step_end(None, SimpleNamespace(global_step=step + 1), None)
    assert profile.figures is None  # not its step yet
    callback.on_step_begin(None, SimpleNamespace(global_step=2), None)
    callback.on_step_end(None, SimpleNamespace(global_step=3), None)
    assert profile.figures == {}  # this machine has no CUDA: nothing to profile, nothing invented


def test_the_profiled_step_is_left_out_of_the_step_times_and_its_figures_kept():
    comm = {"comm_seconds": 1.0, "exposed_seconds": 0.2, "seconds_by_collective": {"AllReduce": 1.0}}
    raw = {"path": "vlmrl", "error": None, "fast_generation": None, "peak_memory_gib": 20.0,
           "peak_reserved_gib": 21.0, "world_size": 2, "peak_memory_gib_per_rank": [20.0, 19.5],
           "communication_per_rank": [comm, comm],
           "steps": [{"seconds": 90.0, "generate_seconds": 80.0}, {"seconds": 10.0, "generate_seconds": 6.0},
                     {"seconds": 30.0, "generate_seconds": 20.0, "profiled": True}]}
    s = summarize(BenchSettings(steps=2, paths=["vlmrl"]), load_shapes("qwen3_vl_8b"),
                  {"matmul_tflops": 800, "copy_bandwidth_tbs": 4.0}, [raw], prompt_tokens=310)
    path = s["paths"]["vlmrl"]
    assert (path["step_seconds"], path["steps_measured"], path["steps_set_apart"]) == (10.0, 1, 1)
    assert math.isclose(path["samples_per_second"], 64 / 10)
    assert path["communication_per_rank"] == [comm, comm]


runner = CliRunner()


@pytest.mark.parametrize("args, message", [
    (["--shapes", "qwen3_vl_99b"], "--shapes qwen3_vl_99b: choose one of qwen3_vl_32b, qwen3_vl_8b"),
    # every option is taken; the bench then stops at this machine's missing GPU
    (["--shapes", "qwen3_vl_32b", "--comm-profile", "--memory-cap-gib", "80"], "needs a CUDA GPU"),
    (["--micro-batch", "3"], "the micro-batch must divide the 32 completions"),
    (["--micro-batch", "2", "--steps-per-generation", "1"], "hold whole groups of 4"),
    # a micro-batch smaller than a group is TRL's rule too: only a rollout must hold whole groups
    (["--micro-batch", "2", "--steps-per-generation", "4", "--completion", "8192"], "needs a CUDA GPU"),
])
def test_bench_takes_the_32b_shapes_and_the_comm_profile(args, message):
    result = runner.invoke(app, ["bench", "--paths", "vlmrl", *args])
    assert result.exit_code == 2, result.output  # one line, no traceback
    assert message in " ".join(result.output.split())
