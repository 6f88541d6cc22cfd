"""Stage 6, training: GRPO and GSPO through TRL change only the LoRA weights, leave complete records, resume
after a kill without duplicating a step, and refuse bad settings before any model loads.

A random-weight model never earns the real correctness reward, so every group would tie, every advantage be
zero and nothing move. The tests that need learning swap in a reward that varies with the completion's
length (deterministic, so a failure repeats), which is all GRPO needs to produce non-zero advantages.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import copy_run, quick_config, step_rows, varied_reward
from vlmrl.common.io import read_json, read_jsonl
from vlmrl.config.schema import ConfigError, load_config
from vlmrl.engine.rollout.mismatch import COLUMNS as MISMATCH_COLUMNS
from vlmrl.grading.rewards import format_reward
from vlmrl.run.layout import is_trained
from vlmrl.train.stage import TrainError, build_grpo_config, train

# the small run's (tests/helpers.py, QUICK)
GENERATION_BATCH = 8  # per_device_train_batch_size x gradient_accumulation_steps (1 in the demo preset)
NUM_GENERATIONS = 4
COMPLETION_TOKENS = 12
ON_CPU = not torch.cuda.is_available()
ROLLOUT_KEYS = {"step", "id", "completion", "rewards", "advantage", "length", "truncated"}


@pytest.fixture
def learnable(monkeypatch):
    monkeypatch.setattr("vlmrl.grading.rewards.correctness_reward", varied_reward)


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("load_model was called before the config was checked")

    monkeypatch.setattr("vlmrl.models.loading.load_model", refuse)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# GRPOConfig


@pytest.mark.parametrize(("algorithm", "level"), [("grpo", "token"), ("gspo", "sequence")])
def test_algorithm_sets_the_importance_sampling_level(algorithm: str, level: str, tmp_path: Path) -> None:
    config = quick_config(tmp_path, f"train.algorithm={algorithm}", "train.loss_type=grpo")
    args, notes = build_grpo_config(config, tmp_path / "checkpoints")
    assert args.importance_sampling_level == level
    assert args.loss_type == "grpo"
    assert args.num_generations == NUM_GENERATIONS
    assert args.max_completion_length == COMPLETION_TOKENS
    assert list(args.reward_weights) == [0.3, 1.0]
    assert args.output_dir == str(tmp_path / "checkpoints")
    assert notes == []  # the demo preset's adamw_torch needs no fallback


@pytest.mark.skipif(not ON_CPU, reason="on CUDA adamw_8bit may be available")
def test_adamw_8bit_on_cpu_falls_back_to_adamw_torch_with_a_note(tmp_path: Path) -> None:
    config = quick_config(tmp_path, "train.optim=adamw_8bit")
    args, notes = build_grpo_config(config, tmp_path)
    assert str(args.optim.value if hasattr(args.optim, "value") else args.optim) == "adamw_torch"
    assert len(notes) == 1 and "adamw_8bit" in notes[0] and "adamw_torch" in notes[0]


def test_trl_overrides_pass_known_fields_through(tmp_path: Path) -> None:
    config = quick_config(tmp_path, "train.trl_overrides={top_k: 3, scale_rewards: batch}")
    args, _ = build_grpo_config(config, tmp_path)
    assert args.top_k == 3 and args.scale_rewards == "batch"


def test_the_trl_values_vlmrl_sets_reach_grpoconfig(tmp_path: Path) -> None:
    """beta and epsilon in train.trl_overrides reach GRPOConfig; unset, TRL gets vlmrl's own values."""
    path = tmp_path / "own.yaml"
    path.write_text("train:\n  trl_overrides: {beta: 0.04, epsilon: 3.0e-4}\n")
    config = load_config(str(path), [f"run.output_dir={tmp_path}", "train.optim=adamw_torch"])
    assert config.train.trl_overrides == {"beta": 0.04, "epsilon": 3e-4}
    args, _ = build_grpo_config(config, tmp_path / "checkpoints")
    assert (args.beta, args.epsilon, args.epsilon_high, args.num_iterations) == (0.04, 3e-4, None, 1)
    assert (str(args.lr_scheduler_type.value), args.warmup_steps) == ("cosine", 0.0)
    moved = quick_config(tmp_path, "train.trl_overrides={warmup_ratio: 0.1, num_iterations: 2, epsilon_high: 0.3}")
    args, _ = build_grpo_config(moved, tmp_path / "checkpoints")
    assert (args.warmup_steps, args.num_iterations, args.epsilon, args.epsilon_high) == (0.1, 2, 0.2, 0.3)
    assert str(args.lr_scheduler_type.value) == "linear"  # the demo preset's


def test_unknown_trl_override_is_named_before_any_model_loads(
    quick_prepared, tmp_path: Path, no_model_load
) -> None:
    config = quick_config(tmp_path, "train.trl_overrides={top_k: 3, no_such_knob: 1}")
    run_dir = copy_run(quick_prepared, tmp_path)
    with pytest.raises(TrainError) as info:
        train(config, run_dir)
    message = str(info.value)
    assert "train.trl_overrides" in message and "no_such_knob" in message and "top_k" not in message
    assert not (run_dir / "train" / "checkpoints").exists()


def test_num_generations_must_divide_the_generation_batch(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        quick_config(tmp_path, "train.per_device_train_batch_size=6", "train.num_generations=4")
    message = str(info.value)
    assert "num_generations=4" in message and "per_device_train_batch_size" in message
    with pytest.raises(ConfigError, match="num_generations=8"):
        quick_config(tmp_path, "train.per_device_train_batch_size=4", "train.steps_per_generation=3",
                     "train.num_generations=8")
    quick_config(tmp_path, "train.per_device_train_batch_size=4", "train.steps_per_generation=2",
                 "train.num_generations=8")  # 8 completions per generation batch: one whole group


def test_rewards_list_sets_the_trl_weights(tmp_path: Path) -> None:
    config = quick_config(tmp_path, "rewards=[{name: correctness, weight: 2.0}, {name: format, weight: -0.5}]")
    args, _ = build_grpo_config(config, tmp_path / "checkpoints")
    assert list(args.reward_weights) == [2.0, -0.5]


def test_training_without_prepared_data_names_the_file(tmp_path: Path, no_model_load) -> None:
    config = quick_config(tmp_path)
    with pytest.raises(TrainError, match=str(config.run_dir / "data" / "train.jsonl")):
        train(config, config.run_dir)


# ---------------------------------------------------------------------------------------------------------------
# a real run of each algorithm


@pytest.mark.parametrize(("algorithm", "level"), [("grpo", "token"), ("gspo", "sequence")])
def test_training_changes_only_lora_weights_and_records_everything(
    algorithm: str, level: str, quick_prepared, tmp_path: Path, learnable, captured
) -> None:
    # gspo: the CPU fallback of adamw_8bit, end to end; grpo: two micro-batches per generation batch, length-grouped
    extra = ["train.optim=adamw_8bit"] if algorithm == "gspo" else [
        "train.gradient_accumulation_steps=2", f"train.per_device_train_batch_size={GENERATION_BATCH // 2}"]
    config = quick_config(tmp_path, f"train.algorithm={algorithm}", *extra)
    run_dir = copy_run(quick_prepared, tmp_path)
    base_file = run_dir / "base-model" / "model.safetensors"
    base_hash = sha256(base_file)

    result = train(config, run_dir)

    # only LoRA moved: every base weight, vision and language, is bit-identical
    model, before = captured["model"], captured["before"]
    after = dict(model.named_parameters())
    base_names = [n for n in before if ".lora_" not in n]
    assert any(".visual." in n for n in base_names) and any(".language_model." in n for n in base_names)
    on_disk = load_file(str(base_file))  # the snapshot is the base model as built, vision and language
    assert len(on_disk) == len(base_names)
    for key, tensor in on_disk.items():
        name = "base_model.model." + key
        if name not in before:  # an adapted layer: PEFT moved its weights under base_layer
            stem, _, kind = name.rpartition(".")
            name = f"{stem}.base_layer.{kind}"
        assert torch.equal(before[name], tensor), key
    changed_base = [n for n in base_names if not torch.equal(before[n], after[n].detach())]
    assert changed_base == []
    assert sha256(base_file) == base_hash
    lora_b = [n for n in before if ".lora_B." in n]
    assert lora_b and all(torch.count_nonzero(before[n]) == 0 for n in lora_b)  # B starts at zero...
    assert any(torch.count_nonzero(after[n]) > 0 for n in lora_b)  # ...and training moved it
    assert all(torch.isfinite(p).all() for p in after.values())

    # the saved adapter is the trained one
    final = run_dir / "train" / "final"
    adapter_config = json.loads((final / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str((run_dir / "base-model").resolve())
    saved = load_file(str(final / "adapter_model.safetensors"))
    assert saved and all(".lora_" in k for k in saved)
    for key, tensor in saved.items():
        name = key.replace(".weight", ".default.weight")  # PEFT saves without the adapter name
        assert torch.equal(tensor, after[name].detach()), key

    # the summary
    summary = read_json(run_dir / "train" / "summary.json")
    assert summary == json.loads(json.dumps(result.summary, default=str))
    assert summary["algorithm"] == algorithm and summary["importance_sampling_level"] == level
    assert summary["steps"] == 2 and summary["resumed_from_step"] == 0
    assert summary["backend"] == "transformers"
    assert summary["base_model"] == str((run_dir / "base-model").resolve())
    assert summary["lora"]["vision_trainable_params"] == 0 and summary["lora"]["trainable_params"] > 0
    assert summary["train_items"] == len(read_jsonl(run_dir / "data" / "train.jsonl"))
    if algorithm == "gspo" and ON_CPU:
        assert summary["optimizer"] == "adamw_torch"
        assert any("adamw_8bit" in note for note in summary["notes"])
    else:
        assert summary["notes"] == []
    trim = summary["loss_pass"]  # vlmrl.engine.loss.loss_pass on by default; tiny:qwen3_vl trims both sides
    assert trim["trim_padding"] and trim["left_padding_trimmed"] and trim["calls"] >= 2
    assert 0 < trim["positions"] <= trim["positions_untrimmed"]
    assert all(0 <= r["loss_pass/padding_trimmed"] < 1 for r in step_rows(run_dir / "train" / "metrics.jsonl"))
    if algorithm == "grpo":  # dr_grpo, steps_per_generation = accumulation = 2: one generation batch per step
        assert trim["group_by_length"] and trim["generation_batches_grouped"] == 2
        assert trim["group_by_length_why_not"] is None
    else:
        assert not trim["group_by_length"] and "one micro-batch" in trim["group_by_length_why_not"]
    assert is_trained(config, run_dir)

    check_records(run_dir / "train", steps=[1, 2])


def check_records(train_dir: Path, steps: list[int]) -> None:
    metrics = step_rows(train_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics] == steps
    assert all("reward" in r and "loss" in r for r in metrics)
    assert all(set(MISMATCH_COLUMNS) <= set(r) for r in metrics)  # the rollout against the loss pass, every step
    health = read_jsonl(train_dir / "health.jsonl")
    assert [r["step"] for r in health] == steps
    assert all(r["n"] == GENERATION_BATCH for r in health)

    rollouts = read_jsonl(train_dir / "rollouts.jsonl")
    assert len(rollouts) == len(steps) * GENERATION_BATCH
    assert Counter(r["step"] for r in rollouts) == dict.fromkeys(steps, GENERATION_BATCH)
    train_ids = {r["id"] for r in read_jsonl(train_dir.parent / "data" / "train.jsonl")}
    for row in rollouts:
        assert ROLLOUT_KEYS <= set(row), sorted(ROLLOUT_KEYS - set(row))
        assert set(row["rewards"]) == {"format_reward", "correctness_reward"}
        assert row["id"] in train_ids
        assert isinstance(row["completion"], str)
        assert row["rewards"]["format_reward"] == format_reward([row["completion"]])[0]
        assert row["rewards"]["correctness_reward"] == varied_reward([row["completion"]], ["0"])[0]
        assert 0 < row["length"] <= COMPLETION_TOKENS
        assert isinstance(row["truncated"], bool)
        if row["truncated"]:
            assert row["length"] == COMPLETION_TOKENS
    # each group of num_generations rows shares a prompt; advantages are centred and ordered by total reward
    for start in range(0, len(rollouts), NUM_GENERATIONS):
        group = rollouts[start : start + NUM_GENERATIONS]
        assert len({r["id"] for r in group}) == 1
        assert sum(r["advantage"] for r in group) == pytest.approx(0.0, abs=1e-4)
        totals = [0.3 * r["rewards"]["format_reward"] + r["rewards"]["correctness_reward"] for r in group]
        for a, ta in zip(group, totals):
            for b, tb in zip(group, totals):
                if ta > tb:
                    assert a["advantage"] > b["advantage"]
    assert any(r["advantage"] != 0 for r in rollouts)  # the reward gave a learning signal


# ---------------------------------------------------------------------------------------------------------------
# resume


def test_resume_continues_from_the_last_checkpoint_without_duplicating_steps(
    quick_trained, tmp_path: Path, learnable
) -> None:
    run_dir = copy_run(quick_trained, tmp_path)  # trained for 2 steps by quick_config(...), a checkpoint each
    checkpoints = run_dir / "train" / "checkpoints"
    assert (checkpoints / "checkpoint-1").is_dir() and (checkpoints / "checkpoint-2").is_dir()

    longer = quick_config(tmp_path, "train.max_steps=3")
    assert not is_trained(longer, run_dir)  # another config: the stage is not done for it
    result = train(longer, run_dir)
    assert result.summary["resumed_from_step"] == 2 and result.summary["steps"] == 3
    assert read_json(run_dir / "train" / "summary.json")["resumed_from_step"] == 2
    check_records(run_dir / "train", steps=[1, 2, 3])

    # killed after step 3 was logged but before its checkpoint was complete: step 3 is redone, once
    shutil.rmtree(checkpoints / "checkpoint-3")
    result = train(longer, run_dir)
    assert result.summary["resumed_from_step"] == 2 and result.summary["steps"] == 3
    check_records(run_dir / "train", steps=[1, 2, 3])


def test_a_time_budget_stops_at_the_step_that_spends_it_and_the_run_is_then_done(
    quick_trained, tmp_path: Path, learnable
) -> None:
    """train.time_budget_minutes counts the resumed sessions too: given a budget a little past what steps 1-2
    spent, the resumed run trains step 3 and stops there (checkpoint saved, `stopped_by` said), not step 4; a
    rerun is done; killed before the summary, the checkpoint past the budget ends the training."""
    run_dir = copy_run(quick_trained, tmp_path)
    spent = step_rows(run_dir / "train" / "metrics.jsonl")[-1]["elapsed_s"]
    budgeted = quick_config(tmp_path, "train.max_steps=4", f"train.time_budget_minutes={(spent + 1e-3) / 60!r}")
    said: list[str] = []
    result = train(budgeted, run_dir, console_callback=said.append)
    assert result.summary["resumed_from_step"] == 2 and result.summary["steps"] == 3
    assert any(line.startswith("train: stopped at step 3 of 4: train.time_budget_minutes=") for line in said), said
    assert result.summary["stopped_by"] == "time_budget"
    check_records(run_dir / "train", steps=[1, 2, 3])
    assert (run_dir / "train" / "checkpoints" / "checkpoint-3").is_dir()
    assert step_rows(run_dir / "train" / "metrics.jsonl")[-1]["elapsed_s"] >= spent + 1e-3
    assert train(budgeted, run_dir).already_done

    (run_dir / "train" / "summary.json").unlink()
    finished = train(budgeted, run_dir)
    assert finished.summary["finished_from_checkpoint"] == "checkpoint-3" and finished.summary["train_seconds"] == 0
    assert finished.summary["stopped_by"] == "time_budget"
    check_records(run_dir / "train", steps=[1, 2, 3])
    assert train(quick_config(tmp_path), run_dir).summary["stopped_by"] is None  # unbudgeted: no stop said


def test_checkpoints_of_another_training_config_are_not_resumed(quick_prepared, tmp_path: Path, learnable) -> None:
    run_dir = copy_run(quick_prepared, tmp_path)
    train(quick_config(tmp_path, "train.max_steps=1"), run_dir)
    changed = quick_config(tmp_path, "train.max_steps=2", "train.learning_rate=3e-4")
    with pytest.raises(TrainError, match="another training config.*--no-resume"):
        train(changed, run_dir)
    result = train(changed, run_dir, resume=False)  # the way out the message names
    assert result.summary["resumed_from_step"] == 0 and result.summary["steps"] == 2


def test_no_resume_starts_from_step_zero(quick_prepared, tmp_path: Path, learnable) -> None:
    run_dir = copy_run(quick_prepared, tmp_path)
    config = quick_config(tmp_path, "train.max_steps=1")
    train(config, run_dir)
    result = train(config, run_dir, resume=False)
    assert result.summary["resumed_from_step"] == 0 and result.summary["steps"] == 1
    check_records(run_dir / "train", steps=[1])  # the first run's rows were replaced, not appended to


def test_a_finished_run_is_not_trained_again(quick_trained, tmp_path: Path, learnable) -> None:
    """Issue 20: re-running a finished `vlmrl train` trained on ("step 3/2") and overwrote the adapter."""
    run_dir = copy_run(quick_trained, tmp_path)  # finished: `train(config, ...)` ran its 2 steps there
    config = quick_config(tmp_path)
    files = sorted(p for p in (run_dir / "train").rglob("*") if p.is_file())
    before = {p: (p.stat().st_mtime_ns, sha256(p)) for p in files}
    result = train(config, run_dir)
    assert result.already_done and result.summary["steps"] == 2
    assert {p: (p.stat().st_mtime_ns, sha256(p)) for p in files} == before
    assert sorted(p for p in (run_dir / "train").rglob("*") if p.is_file()) == files
    # another tracker is not another training config
    assert train(quick_config(tmp_path, "train.report_to=[none]"), run_dir).already_done


def test_trl_without_a_cpu_path_is_refused_on_a_cpu_only(quick_prepared, tmp_path: Path, no_model_load, monkeypatch) -> None:
    """TRL 1.15 (Unsloth's pin) computes log-probs with Triton kernels only: on a CPU that fails mid-step, so
    `train` refuses it in one line before any model loads; on a GPU, or with TRL >= 1.16, nothing is said."""
    from vlmrl.train import stage as train_module

    assert train_module.trl_device_problem("cuda", "1.15.0") is None
    assert train_module.trl_device_problem("cpu", "1.16.0") is None
    assert train_module.trl_device_problem("cpu", "1.17.0.dev0") is None
    assert "trl>=1.16" in train_module.trl_device_problem("cpu", "1.15.0")
    real = train_module.package_version
    monkeypatch.setattr(train_module, "package_version", lambda name: "1.15.0" if name == "trl" else real(name))
    config = quick_config(tmp_path)
    run_dir = copy_run(quick_prepared, tmp_path)
    with pytest.raises(TrainError, match=r"trl 1\.15\.0 computes GRPO's log-probs with Triton kernels only"):
        train(config, run_dir)
    assert not (run_dir / "train" / "checkpoints").exists()
