"""The multi-GPU record's rows (benchmarks/gpu_scaling.py) from bench records made by the bench's own `summarize`:
efficiency against the one-GPU DDP row, the communication share of the worst rank, the preflight beside the
measured peak, a failed configuration kept as a row, and the evaluation check."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

from vlmrl.bench import BenchSettings, load_shapes, summarize
from vlmrl.config.schema import load_config
from vlmrl.preflight.memory import estimate_memory

_spec = importlib.util.spec_from_file_location(
    "gpu_scaling", Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_scaling.py")
gpu_scaling = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_scaling)
add_efficiency, add_prediction, compare_records, configuration_row, markdown = (
    gpu_scaling.add_efficiency, gpu_scaling.add_prediction, gpu_scaling.compare_records, gpu_scaling.configuration_row,
    gpu_scaling.markdown)


def _bench(gpus: int, step: float, peaks: list[float], comm: list[dict] | None = None) -> dict:
    raw = {"path": "vlmrl", "error": None, "fast_generation": None, "peak_memory_gib": max(peaks),
           "peak_reserved_gib": max(peaks), "world_size": gpus, "peak_memory_gib_per_rank": peaks,
           "communication_per_rank": comm,
           "steps": [{"seconds": 90.0, "generate_seconds": 80.0}, {"seconds": step, "generate_seconds": step / 2}]}
    return summarize(BenchSettings(steps=2, paths=["vlmrl"]), load_shapes("qwen3_vl_8b"),
                     {"matmul_tflops": 800, "copy_bandwidth_tbs": 4.0}, [raw], prompt_tokens=310)


def _job(name: str, strategy: str, gpus: int, **meta) -> dict:
    return {"job": name, "strategy": strategy, "gpus": gpus, "shapes": "qwen3_vl_8b", "load_in_4bit": False,
            "completion": 1024, "memory_cap_gib": None, "rc": 0, "commit": "abc", "source_digest": "d1"} | meta


def test_rows_efficiency_communication_and_prediction():
    comm = [{"comm_seconds": 0.5, "exposed_seconds": 0.1}, {"comm_seconds": 1.0, "exposed_seconds": 0.3}]
    rows = [configuration_row(_job("ddp_bf16_g1", "ddp", 1), _bench(1, 10.0, [23.0])),
            configuration_row(_job("ddp_bf16_g4", "ddp", 4), _bench(4, 10.5, [23.2] * 4, comm[:1] * 4)),
            configuration_row(_job("fsdp_bf16_g4", "fsdp", 4), _bench(4, 20.0, [14.0, 14.1, 14.0, 13.9], comm)),
            configuration_row(_job("ddp_4bit_g2", "ddp", 2, load_in_4bit=True), _bench(2, 30.0, [14.0] * 2))]
    rows = add_prediction(add_efficiency(rows))
    one, ddp4, fsdp4, four_bit = rows
    assert one["efficiency"] == 1.0 and math.isclose(one["samples_per_second"], 32 / 10)
    assert math.isclose(ddp4["efficiency"], (4 * 32 / 10.5) / (4 * 32 / 10))  # 10 s / 10.5 s
    assert math.isclose(fsdp4["efficiency"], 0.5)
    assert four_bit["efficiency"] is None  # no one-GPU 4-bit row to compare with
    # the worst rank: 1.0 s of NCCL kernels over a 20 s step, 0.3 s of it not overlapped
    assert (fsdp4["comm_share"], fsdp4["exposed_share"]) == (0.05, 0.015)
    assert "comm_share" not in one
    predicted = estimate_memory(load_config("seed", ["model.load_in_4bit=false", "train.max_completion_length=1024",
                                                     "train.optim=adamw_torch"]), load_shapes("qwen3_vl_8b"),
                                prompt_tokens=310, fast_generation=True, gpus=4, strategy="fsdp").peak_gib
    assert math.isclose(fsdp4["predicted_peak_gib"], predicted)
    assert math.isclose(fsdp4["measured_over_predicted"], 14.1 / predicted)
    table = markdown(rows, None, {"commit": "abc", "source_digest": "d1", "device": "NVIDIA H200"})
    assert "Measured at commit abc (source digest d1) on NVIDIA H200" in table
    assert "| fsdp qwen3_vl_8b bf16 1024 tok | 4 | 6.40 | 0.50 | 20.0 | 10.0 | 14.0, 14.1, 14.0, 13.9 |" in table
    assert "5.0% (1.5%)" in table


def test_a_failed_configuration_is_a_row_with_its_error():
    failed = summarize(BenchSettings(steps=2, paths=["vlmrl"]), load_shapes("qwen3_vl_8b"),
                       {"matmul_tflops": 800, "copy_bandwidth_tbs": 4.0},
                       [{"path": "vlmrl", "error": "OutOfMemoryError: CUDA out of memory", "fast_generation": None,
                         "peak_memory_gib": 0, "peak_reserved_gib": 0, "steps": []}], prompt_tokens=310)
    rows = [configuration_row(_job("fsdp_32b_g2", "fsdp", 2), failed),
            configuration_row(_job("zero2_bf16_g2", "zero2", 2, rc=1, error="deepspeed is not installed"), None)]
    assert rows[0]["error"] == "OutOfMemoryError: CUDA out of memory"
    assert rows[1]["error"] == "deepspeed is not installed"
    table = markdown(add_efficiency(rows), None, {"not_run": ["zero2_bf16_g2"]})
    assert "| fsdp qwen3_vl_8b bf16 1024 tok | 2 | failed: OutOfMemoryError" in table
    assert "Not run: zero2_bf16_g2." in table


def test_evaluation_records_compared_per_id():
    one = [{"id": "a", "completion": "4", "pred": "4", "correct": True, "format_ok": True},
           {"id": "b", "completion": "7", "pred": "7", "correct": False, "format_ok": True}]
    same = compare_records(one, list(reversed(one)))  # the order of the file does not matter, the ids do
    assert same == {"records_one_gpu": 2, "records_n_gpus": 2, "ids_equal": True, "identical": 2, "differing_ids": []}
    other = compare_records(one, [one[0] | {"completion": "4 "}, {"id": "c"}])
    assert (other["ids_equal"], other["identical"], other["differing_ids"]) == (False, 0, ["a", "b", "c"])
    table = markdown([], same | {"gpus": 8}, {})
    assert "2 records on 1 GPU, 2 on 8 GPUs, ids equal: True, identical (completion, extraction, grade, format): " \
           "2 of 2." in table


def test_the_plan_for_eight_gpus_runs_each_configuration_once():
    jobs = gpu_scaling.plan(8)
    names = [j["job"] for j in jobs]
    assert len(names) == len(set(names)) and names[0] == "eval_prep"
    assert {"ddp_bf16_g1", "ddp_bf16_g8", "fsdp_bf16_g8", "zero2_bf16_g8", "fsdp_32b_g2_cap80", "eval_g8"} <= set(names)
    assert all(j["command"].endswith('--out "$JOB_OUT"') for j in jobs if j["kind"] == "bench")
