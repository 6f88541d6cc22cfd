"""Health monitors (vlmrl.train.callbacks): per-step rates with exact values, warnings against `config.health`,
NaN/Inf saving and stopping, the gibberish-streak stop, and the train stage turning a halt into a TrainError.

The end-to-end tests run the real train stage on a tiny random model. NaN is injected into the real loss
tensor (TRL's `compute_loss` multiplied by NaN): backward, clipping, logging, the monitor, the checkpoint
save, the stop and the error are all the production path. (A NaN *reward* would not do: TRL treats NaN
rewards as "unscorable" and drops them from the advantage.)
"""

from __future__ import annotations

import math
from collections import namedtuple
from types import SimpleNamespace

import pytest
from transformers import TrainerControl

from tests.helpers import quick_config
from vlmrl.common.io import read_jsonl
from vlmrl.config.schema import HealthConfig
from vlmrl.train.callbacks import HealthMonitor, RolloutRecorder, batch_health

WEIGHTS = [0.3, 1.0]


def rollout(fmt: float, cor: float, *, degenerate=False, length=10, truncated=False) -> dict:
    return {"rewards": {"format_reward": fmt, "correctness_reward": cor}, "degenerate": degenerate,
            "length": length, "truncated": truncated}


# Two groups of two completions (group_size=2), weights [0.3, 1.0]:
BATCH = [
    rollout(2.0, 2.0, length=10),  # total 0.3*2 + 2 = 2.6: format and answer right
    rollout(2.0, 0.0, length=8),  # total 0.6: format only
    rollout(-2.0, 0.0, degenerate=True, length=12, truncated=True),  # total -0.6: gibberish, cut off
    rollout(-2.0, 0.0, degenerate=True, length=None, truncated=True),  # total -0.6, length unknown
]


def test_batch_health_exact_values():
    h = batch_health(BATCH, group_size=2, weights=WEIGHTS)
    assert h["n"] == 4
    assert h["gibberish_rate"] == 0.5  # rows 3, 4
    assert h["format_rate"] == 0.5  # format_reward == 2.0: rows 1, 2
    assert h["truncation_rate"] == 0.5
    assert h["mean_length"] == 10.0  # (10 + 8 + 12) / 3: the unknown length is left out, not counted as 0
    assert h["zero_variance_groups"] == 0.5  # group 2: -0.6, -0.6
    assert h["reward_mean"] == pytest.approx(0.5)  # (2.6 + 0.6 - 0.6 - 0.6) / 4
    assert h["reward_std"] == pytest.approx(math.sqrt((2.1**2 + 0.1**2 + 1.1**2 + 1.1**2) / 4))  # population std


def test_batch_health_with_user_rewards_and_no_format_reward():
    """Configured rewards without format_reward: the format rate comes from the completions themselves, and
    a None reward (NaN in TRL's log) is left out of the total as TRL leaves it out."""
    good = "<REASONING>r</REASONING><SOLUTION>1</SOLUTION>"
    rows = [{"rewards": {"correctness_reward": 2.0, "shortness": math.nan}, "completion": good, "degenerate": False},
            {"rewards": {"correctness_reward": 0.0, "shortness": 0.5}, "completion": "1", "degenerate": False}]
    h = batch_health(rows, group_size=2, weights=[1.0, 2.0])
    assert h["format_rate"] == 0.5  # only the first completion has both tag pairs
    assert h["reward_mean"] == pytest.approx((2.0 + 1.0) / 2)  # totals 2.0 (NaN left out) and 0 + 2 * 0.5


def test_batch_health_default_weights_and_empty_batch():
    h = batch_health(BATCH[:2], group_size=2)  # weights 1, 1: totals 4.0 and 2.0
    assert h["reward_mean"] == 3.0 and h["reward_std"] == 1.0 and h["zero_variance_groups"] == 0.0
    assert batch_health([], group_size=4) == {"n": 0}


def test_batch_health_all_lengths_unknown():
    assert batch_health([rollout(0.0, 0.0, length=None)] * 2, group_size=2)["mean_length"] is None


# --- HealthMonitor.on_log with fake trainer objects -------------------------------------------------------

ARGS = SimpleNamespace(num_generations=2, reward_weights=WEIGHTS)


def monitor(tmp_path, batch, **health) -> tuple[HealthMonitor, list[str]]:
    console: list[str] = []
    mon = HealthMonitor(HealthConfig(**health), tmp_path / "health.jsonl", console=console.append)
    recorder = RolloutRecorder(tmp_path / "rollouts.jsonl")
    recorder.last_batch = batch
    mon.attach(recorder)
    return mon, console


def log_step(mon: HealthMonitor, step: int, logs: dict, *, main: bool = True) -> TrainerControl:
    state = SimpleNamespace(global_step=step, is_world_process_zero=main)
    return mon.on_log(ARGS, state, TrainerControl(), logs=logs)


HEALTHY = [rollout(2.0, 2.0), rollout(2.0, 0.0), rollout(2.0, 2.0), rollout(0.0, 0.0)]


def test_healthy_step_is_recorded_without_warnings(tmp_path):
    mon, console = monitor(tmp_path, HEALTHY)
    control = log_step(mon, 1, {"loss": 0.12, "grad_norm": 0.5, "reward": 1.0})
    (row,) = read_jsonl(tmp_path / "health.jsonl")
    assert row["step"] == 1 and row["warnings"] == [] and row["loss"] == 0.12 and row["grad_norm"] == 0.5
    assert row["n"] == 4 and row["format_rate"] == 0.75 and "halted" not in row
    assert console == [] and mon.warning_count == 0 and mon.halted is None
    assert not control.should_save and not control.should_training_stop


def test_each_threshold_warns_on_console_and_in_health_jsonl(tmp_path):
    # BATCH: gibberish 0.5 > 0.2, truncation 0.5 > 0.4, zero-variance 0.5 > 0.4, format 0.5 < 0.6
    mon, console = monitor(tmp_path, BATCH, max_gibberish_rate=0.2, max_truncation_rate=0.4,
                           max_zero_variance_groups=0.4, min_format_rate=0.6)
    control = log_step(mon, 7, {"loss": 0.1})
    (row,) = read_jsonl(tmp_path / "health.jsonl")
    assert row["warnings"] == [
        "gibberish rate 0.50 > 0.2",
        "format compliance 0.50 < 0.6",
        "truncation rate 0.50 > 0.4",
        "zero-variance groups 0.50 > 0.4",
    ]
    assert console == [f"[health] step 7: {w}" for w in row["warnings"]]
    assert mon.warning_count == 4
    assert not control.should_training_stop  # warnings do not stop a run


def test_thresholds_are_strict(tmp_path):
    # exactly at the limit is not over it
    mon, console = monitor(tmp_path, BATCH, max_gibberish_rate=0.5, max_truncation_rate=0.5,
                           max_zero_variance_groups=0.5, min_format_rate=0.5)
    log_step(mon, 1, {})
    assert read_jsonl(tmp_path / "health.jsonl")[0]["warnings"] == [] and console == []


@pytest.mark.parametrize("key,value", [("loss", float("nan")), ("grad_norm", float("inf")), ("loss", float("-inf"))])
def test_non_finite_loss_or_grad_norm_saves_and_stops(tmp_path, key, value):
    mon, console = monitor(tmp_path, HEALTHY)
    control = log_step(mon, 5, {"loss": 0.1, "grad_norm": 1.0, key: value})
    assert control.should_save and control.should_training_stop
    assert mon.halted.startswith(f"non-finite {key} ({value})")
    assert "train.learning_rate" in mon.halted  # says what to change
    (row,) = read_jsonl(tmp_path / "health.jsonl")  # the value itself is written null (strict JSON); the text names it
    assert row["halted"] == mon.halted and row["warnings"][0] == f"non-finite {key} ({value})"
    assert console[0] == f"[health] step 5: non-finite {key} ({value})"


def test_end_of_training_summary_log_is_not_a_step(tmp_path):
    mon, _ = monitor(tmp_path, BATCH)
    control = log_step(mon, 6, {"train_runtime": 12.0, "train_loss": float("nan")})
    assert not (tmp_path / "health.jsonl").exists() and not control.should_training_stop


def test_gibberish_streak_stops_after_n_steps_and_resets_on_a_clean_step(tmp_path):
    mon, _ = monitor(tmp_path, BATCH, max_gibberish_rate=0.2, stop_on_gibberish_steps=3)
    recorder = mon.recorder
    assert not log_step(mon, 1, {}).should_training_stop  # streak 1
    assert not log_step(mon, 2, {}).should_training_stop  # streak 2
    recorder.last_batch = HEALTHY
    assert not log_step(mon, 3, {}).should_training_stop  # reset
    recorder.last_batch = BATCH
    assert not log_step(mon, 4, {}).should_training_stop  # 1
    assert not log_step(mon, 5, {}).should_training_stop  # 2
    control = log_step(mon, 6, {})  # 3: stop
    assert control.should_training_stop and control.should_save
    assert mon.halted == "gibberish rate above 0.2 for 3 steps: the policy is collapsing"
    rows = read_jsonl(tmp_path / "health.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and [r.get("halted") for r in rows][-2:] == [None, mon.halted]


def test_gibberish_without_the_stop_rule_only_warns(tmp_path):
    mon, _ = monitor(tmp_path, BATCH, max_gibberish_rate=0.2)  # stop_on_gibberish_steps: None
    for step in range(1, 20):
        assert not log_step(mon, step, {}).should_training_stop
    assert mon.halted is None


def test_only_the_main_process_writes_but_every_process_stops(tmp_path):
    mon, console = monitor(tmp_path, HEALTHY)
    control = log_step(mon, 2, {"loss": float("nan")}, main=False)
    assert control.should_training_stop and mon.halted
    assert not (tmp_path / "health.jsonl").exists() and console == []


def test_step_without_rollouts_still_checks_the_loss(tmp_path):
    mon, _ = monitor(tmp_path, [])
    control = log_step(mon, 1, {"loss": float("nan")})
    assert control.should_training_stop
    assert read_jsonl(tmp_path / "health.jsonl")[0]["n"] == 0


# --- the real train stage ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A tiny run directory with prepared data (tiny random Qwen3-VL, 24 synthetic items)."""
    from vlmrl.pipeline import prepare_with_budget

    out = tmp_path_factory.mktemp("health_runs")
    config = _config(out, "prepared")
    prepare_with_budget(config, config.run_dir)
    return config


HEALTH_RUN = (
    "model.name=tiny:qwen3_vl", "data.num_synthetic=24", "data.holdout_size=8", "train.max_completion_length=8",
    "train.max_steps=3", "train.save_steps=50", "train.per_device_train_batch_size=4",
)


def _config(out, name: str, *extra: str):
    return quick_config(out, f"run.name={name}", *extra, base=HEALTH_RUN)


def _copy_run(prepared, name: str, *extra: str):
    import shutil

    config = _config(prepared.run.output_dir, name, *extra)
    shutil.copytree(prepared.run_dir, config.run_dir)
    return config


@pytest.mark.slow
def test_nan_loss_in_a_real_train_run_saves_a_checkpoint_and_raises_train_error(prepared, monkeypatch):
    from trl import GRPOTrainer

    from vlmrl.train.stage import TrainError, train

    real = GRPOTrainer.compute_loss

    def nan_loss(self, *args, **kwargs):
        return real(self, *args, **kwargs) * float("nan")

    monkeypatch.setattr(GRPOTrainer, "compute_loss", nan_loss)
    config = _copy_run(prepared, "nan")
    console: list[str] = []
    with pytest.raises(TrainError) as info:
        train(config, config.run_dir, console_callback=console.append)
    message = str(info.value)
    train_dir = config.run_dir / "train"
    assert message.startswith("training stopped at step 1: non-finite loss (nan)")
    assert "train.learning_rate" in message and str(train_dir / "health.jsonl") in message
    assert (train_dir / "checkpoints" / "checkpoint-1" / "trainer_state.json").is_file()  # saved for inspection
    assert not (train_dir / "final").exists() and not (train_dir / "summary.json").exists()
    (row,) = read_jsonl(train_dir / "health.jsonl")
    # strict JSON: a NaN is written null (issue 37); the row's warning and `halted` say which value it was
    assert row["step"] == 1 and row["loss"] is None and row["halted"].startswith("non-finite loss (nan)")
    metrics = [r for r in read_jsonl(train_dir / "metrics.jsonl") if "loss" in r]
    assert len(metrics) == 1 and metrics[0]["loss"] is None  # logged, not hidden (logging_nan_inf_filter)
    assert any("[health] step 1: non-finite loss (nan)" in line for line in console)


@pytest.mark.slow
def test_train_refuses_before_the_first_step_when_a_checkpoint_cannot_fit(prepared, monkeypatch):
    import shutil

    from vlmrl.train.stage import TrainError, train

    Usage = namedtuple("Usage", "total used free")
    config = _copy_run(prepared, "full-disk")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(2**30, 2**30 - 2**20, 2**20))  # 1 MiB free
    with pytest.raises(TrainError) as info:
        train(config, config.run_dir)
    message = str(info.value)
    assert str(config.run_dir / "train" / "checkpoints") in message
    assert "1.0 MiB free" in message and "one checkpoint needs about" in message
    assert not (config.run_dir / "train" / "metrics.jsonl").exists()  # refused before any step


@pytest.mark.slow
def test_gibberish_streak_stops_a_real_train_run(prepared, monkeypatch):
    """Every completion is classified as degenerate (the classifier is patched: a random tiny model emits
    `addCriterion` spam only by chance); the streak rule, the save, the stop and the error are the real path."""
    from vlmrl.train import callbacks as records
    from vlmrl.train.stage import TrainError, train

    monkeypatch.setattr(records, "is_degenerate", lambda text: True)
    config = _copy_run(prepared, "gibberish", "health.stop_on_gibberish_steps=2")  # max_gibberish_rate 0.2
    with pytest.raises(TrainError) as info:
        train(config, config.run_dir)
    assert str(info.value).startswith(
        "training stopped at step 2: gibberish rate above 0.2 for 2 steps: the policy is collapsing")
    train_dir = config.run_dir / "train"
    rows = read_jsonl(train_dir / "health.jsonl")
    assert [r["gibberish_rate"] for r in rows] == [1.0, 1.0] and "halted" in rows[-1]
    assert (train_dir / "checkpoints" / "checkpoint-2" / "trainer_state.json").is_file()
    assert {r["step"] for r in read_jsonl(train_dir / "rollouts.jsonl")} == {1, 2}


def test_an_fp16_overflow_is_a_skipped_step_not_a_halt(tmp_path):
    """Under fp16 accelerate's loss scaler skips a step whose gradients overflowed (grad_norm inf, loss finite)
    and lowers its scale: the monitor records it, and halts only when it does not recover."""
    from vlmrl.train.callbacks import MAX_FP16_OVERFLOWS

    mon, _ = monitor(tmp_path, HEALTHY)
    fp16 = SimpleNamespace(**{**vars(ARGS), "fp16": True})
    state = SimpleNamespace(global_step=1, is_world_process_zero=True)
    control = mon.on_log(fp16, state, TrainerControl(), logs={"loss": 0.1, "grad_norm": float("inf")})
    assert not control.should_training_stop and mon.halted is None
    (row,) = read_jsonl(tmp_path / "health.jsonl")
    overflow = "fp16 overflow: the loss scaler skipped this step's update (1 in a row)"
    assert row["fp16_overflow"] is True and row["warnings"] == [overflow]
    mon.on_log(fp16, state, TrainerControl(), logs={"loss": 0.1, "grad_norm": 0.5})  # recovered: the streak resets
    for step in range(MAX_FP16_OVERFLOWS):
        control = mon.on_log(fp16, SimpleNamespace(global_step=3 + step, is_world_process_zero=True),
                             TrainerControl(), logs={"loss": 0.1, "grad_norm": float("nan")})
    assert control.should_training_stop and "cannot recover" in mon.halted
    # bf16 / fp32: the same log is a non-finite gradient, which stops at once
    bf16, _ = monitor(tmp_path / "b", HEALTHY)
    (tmp_path / "b").mkdir()
    assert log_step(bf16, 1, {"loss": 0.1, "grad_norm": float("inf")}).should_training_stop
