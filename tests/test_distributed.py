"""Several processes, one run: `vlmrl train|eval --gpus 2` keep the bookkeeping of a one-process run.

On this CPU-only machine `--gpus 2` starts two gloo processes through the same `accelerate launch` command a
GPU host runs (the shipped ddp.yaml), so what is checked here is the bookkeeping, not speed: evaluation gives
exactly one record per held-out id, equal (greedy) to a one-process evaluation; training writes one metrics row
per step (none duplicated by rank 1), the rollouts of both ranks once, checkpoints with each rank's RNG state
that a re-run resumes from, and a final adapter that the two-process evaluation then loads; shards left by a
killed run are merged first.
A random tiny model earns no reward, which is fine for bookkeeping.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.helpers import copy_run, quick_config
from vlmrl.cli.app import app
from vlmrl.common import distributed
from vlmrl.common.io import read_json, read_jsonl, write_jsonl_atomic
from vlmrl.config.schema import Config, dump_config, load_config
from vlmrl.evaluate.stage import evaluate, merge_shards
from vlmrl.pipeline import prepare_with_budget

HOLDOUT, EVAL_BATCH, STEPS, PER_DEVICE, PROCESSES = 7, 2, 2, 4, 2  # 7 items: four batches, the last one short
OVERRIDES = [
    "model.name=tiny:qwen3_vl", "data.num_synthetic=40", f"data.holdout_size={HOLDOUT}", "eval.max_new_tokens=8",
    "eval.do_sample=false", f"eval.batch_size={EVAL_BATCH}", "train.max_completion_length=8",
    f"train.max_steps={STEPS}", f"train.per_device_train_batch_size={PER_DEVICE}", "train.num_generations=4",
    "train.save_steps=1",
]  # fmt: skip
runner = CliRunner()


def vlmrl(*args: str) -> str:
    """`vlmrl ARGS` in a subprocess (VLMRL_CACHE comes from the conftest fixture); returns its output."""
    done = subprocess.run([sys.executable, "-m", "vlmrl.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "200"}, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    return output


def same_generations(two: list[dict], one: list[dict]) -> None:
    assert [r["id"] for r in two] == [r["id"] for r in one]
    for a, b in zip(two, one):
        assert (a["completion"], a["pred"], a["generated_tokens"]) == (b["completion"], b["pred"], b["generated_tokens"])


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Config, Path]:
    """A prepared run and the YAML file of its config (what a user passes to `vlmrl ... --gpus 2`)."""
    out = tmp_path_factory.mktemp("distributed")
    config = quick_config(out, base=OVERRIDES)
    prepare_with_budget(config, config.run_dir)
    path = out / "quick.yaml"
    path.write_text(dump_config(config))
    return config, path


# --- no processes launched -------------------------------------------------------------------------------------


def test_batches_are_dealt_round_robin_whole():
    starts = [0, 2, 4, 6]  # batch starts of 7 items in batches of 2
    assert distributed.my_share(starts, rank_=0, world=2) == [0, 4]
    assert distributed.my_share(starts, rank_=1, world=2) == [2, 6]
    assert distributed.my_share(starts, rank_=4, world=5) == []  # more ranks than batches: nothing to do
    assert distributed.my_share(starts) == starts  # one process (no WORLD_SIZE): everything


def test_every_strategy_ships_a_valid_accelerate_config():
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    expected = {"ddp": DistributedType.MULTI_GPU, "fsdp": DistributedType.FSDP,
                "zero2": DistributedType.DEEPSPEED, "zero3": DistributedType.DEEPSPEED}
    for strategy, kind in expected.items():
        loaded = load_config_from_file(str(distributed.accelerate_config(strategy)))
        assert loaded.distributed_type == kind and loaded.num_machines == 1, strategy
    assert load_config_from_file(str(distributed.accelerate_config("zero2"))).deepspeed_config["zero_stage"] == 2
    assert load_config_from_file(str(distributed.accelerate_config("zero3"))).deepspeed_config["zero_stage"] == 3
    # ddp also runs on the CPU: precision is left to the training arguments, not forced to bf16
    assert load_config_from_file(str(distributed.accelerate_config("ddp"))).mixed_precision == "no"


def test_launch_command_runs_the_same_vlmrl_command_through_accelerate():
    command = distributed.launch_command(["train", "c.yaml", "--set", "a.b=1"], gpus=4, strategy="fsdp")
    assert command[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    assert command[command.index("--config_file") + 1].endswith("vlmrl/config/accelerate/fsdp.yaml")
    assert command[command.index("--num_processes") + 1] == "4"
    assert command[-6:] == ["--module", "vlmrl.cli", "train", "c.yaml", "--set", "a.b=1"]


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="deepspeed is installed")
def test_deepspeed_strategy_without_deepspeed_is_refused_before_launching(prepared):
    _, path = prepared
    with pytest.raises(distributed.LaunchError, match="pip install deepspeed"):
        distributed.check_launch(2, "zero3")
    result = runner.invoke(app, ["train", str(path), "--gpus", "2", "--strategy", "zero2"], terminal_width=200)
    assert result.exit_code == 2 and "needs DeepSpeed" in result.output and "launching" not in result.output


def test_bad_launch_options_exit_2_without_launching(prepared):
    _, path = prepared
    for args, message in ((["--strategy", "fsdp"], "needs --gpus N"), (["--gpus", "2", "--strategy", "tp"], "is not one of")):
        result = runner.invoke(app, ["eval", str(path), *args], terminal_width=200)
        assert result.exit_code == 2 and message in result.output, result.output
    if not torch.cuda.is_available():
        with pytest.raises(distributed.LaunchError, match="needs CUDA GPUs"):
            distributed.check_launch(2, "fsdp")


def test_one_process_commands_refuse_to_run_under_a_launcher(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")  # what accelerate launch / torchrun set in every process
    for command in (["run"], ["prepare"], ["export"]):
        result = runner.invoke(app, [*command, "--set", f"run.output_dir={tmp_path}"], terminal_width=200)
        assert result.exit_code == 2 and "runs as one process" in result.output, result.output
    assert not any(tmp_path.iterdir())


def test_merge_keeps_one_record_per_id_in_holdout_order_and_removes_shards(tmp_path):
    records = tmp_path / "after_records.jsonl"
    write_jsonl_atomic(records, [{"id": "c", "v": 0}])
    write_jsonl_atomic(tmp_path / "after_records.rank0.jsonl", [{"id": "a", "v": 1}, {"id": "c", "v": 9}])
    write_jsonl_atomic(tmp_path / "after_records.rank1.jsonl", [{"id": "b", "v": 2}])
    shards = sorted(tmp_path.glob("after_records.rank*.jsonl"))
    merge_shards(records, shards, ["a", "b", "c"])
    assert read_jsonl(records) == [{"id": "a", "v": 1}, {"id": "b", "v": 2}, {"id": "c", "v": 0}]  # first written wins
    assert not any(tmp_path.glob("after_records.rank*.jsonl"))


def test_shards_left_by_a_killed_run_are_merged_before_resuming(prepared, tmp_path):
    config, _ = prepared
    run = copy_run(config.run_dir, tmp_path)
    local = quick_config(tmp_path, base=OVERRIDES)
    reference = read_jsonl(evaluate(local, run, "baseline").records_path)
    # a two-process run killed mid-way: rank 0 finished batch 0 and tore a line of batch 2, rank 1 did batch 1
    (run / "baseline_records.jsonl").unlink()
    write_jsonl_atomic(run / "baseline_records.rank0.jsonl", reference[0:2])
    with open(run / "baseline_records.rank0.jsonl", "a") as handle:
        handle.write('{"id": "torn')
    write_jsonl_atomic(run / "baseline_records.rank1.jsonl", reference[2:4])
    result = evaluate(local, run, "baseline")
    records = read_jsonl(result.records_path)
    same_generations(records, reference)
    assert records[:4] == reference[:4]  # kept as written (timings included), not generated again
    assert result.summary["n"] == HOLDOUT and not any(run.glob("baseline_records.rank*.jsonl"))


# --- two processes ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_two_process_eval_gives_one_record_per_id_equal_to_one_process(prepared, tmp_path, sampled):
    config, path = prepared
    sets = ["eval.do_sample=true", "eval.num_samples=2"] if sampled else []  # sampled: seeded per batch
    two_run = copy_run(config.run_dir, tmp_path / "two")
    one_run = copy_run(config.run_dir, tmp_path / "one")
    output = vlmrl("eval", str(path), "--run-dir", str(two_run), *[a for s in sets for a in ("--set", s)],
                   "--stage", "baseline", "--gpus", str(PROCESSES))
    assert "launching: " in output and f"--num_processes {PROCESSES}" in output and "--module vlmrl.cli eval" in output

    holdout = [r["id"] for r in read_jsonl(two_run / "data" / "holdout.jsonl")]
    two = read_jsonl(two_run / "baseline_records.jsonl")
    assert [r["id"] for r in two] == holdout and len(holdout) == HOLDOUT  # one per id, holdout order
    assert not any(two_run.glob("baseline_records.rank*.jsonl"))
    assert read_json(two_run / "baseline_summary.json")["n"] == HOLDOUT
    one_config = load_config("demo", [f"run.output_dir={tmp_path / 'one'}", *OVERRIDES, *sets])
    one = read_jsonl(evaluate(one_config, one_run, "baseline").records_path)
    same_generations(two, one)
    if sampled:
        assert [[s["completion"] for s in r["samples"]] for r in two] == [[s["completion"] for s in r["samples"]] for r in one]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_process_training_records_each_step_once_resumes_and_its_adapter_evaluates(prepared, tmp_path):
    config, path = prepared
    run = config.run_dir
    vlmrl("train", str(path), "--gpus", str(PROCESSES))

    train_dir = run / "train"
    metrics = read_jsonl(train_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics if "train_runtime" not in r] == list(range(1, STEPS + 1))
    assert sum("train_runtime" in r for r in metrics) == 1
    assert [r["step"] for r in read_jsonl(train_dir / "health.jsonl")] == list(range(1, STEPS + 1))
    # each step's generation batch is both ranks' completions, written once: PROCESSES x per-device batch
    rollouts = Counter(r["step"] for r in read_jsonl(train_dir / "rollouts.jsonl"))
    assert rollouts == {step: PROCESSES * PER_DEVICE for step in range(1, STEPS + 1)}
    summary = read_json(train_dir / "summary.json")
    assert summary["steps"] == STEPS
    assert (train_dir / "final" / "adapter_model.safetensors").is_file()
    assert (train_dir / "final" / "vlmrl_base.json").is_file()
    last = train_dir / "checkpoints" / f"checkpoint-{STEPS}"
    assert {p.name for p in last.glob("rng_state_*.pth")} == {f"rng_state_{k}.pth" for k in range(PROCESSES)}

    # resume across ranks: as if killed after checkpoint 1, the re-run continues from it and records step 2 once
    shutil.rmtree(last)
    shutil.rmtree(train_dir / "final")
    (train_dir / "summary.json").unlink()
    vlmrl("train", str(path), "--gpus", str(PROCESSES))
    assert read_json(train_dir / "summary.json")["resumed_from_step"] == STEPS - 1
    metrics = read_jsonl(train_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics if "train_runtime" not in r] == list(range(1, STEPS + 1))
    assert Counter(r["step"] for r in read_jsonl(train_dir / "rollouts.jsonl")) == rollouts

    reference_run = copy_run(run, tmp_path)  # the trained run, evaluated by one process below
    vlmrl("eval", str(path), "--stage", "after", "--gpus", str(PROCESSES))
    two = read_jsonl(run / "after_records.jsonl")
    assert [r["id"] for r in two] == [r["id"] for r in read_jsonl(run / "data" / "holdout.jsonl")]
    assert not any(run.glob("after_records.rank*.jsonl"))
    one = read_jsonl(evaluate(quick_config(tmp_path, base=OVERRIDES), reference_run, "after").records_path)
    same_generations(two, one)
