"""Stage 6 on a user's first day: a kill before the summary, the LoRA seed, a damaged adapter, a divergence and a
reward that never varies each end in a finished training or one line, never a traceback or a step past the end.

Every test calls the function that decides (the resume point, the seeding, the adapter check, the health
monitor) on small made-up folders or a tiny model; none trains.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from transformers import TrainerControl

from vlmrl.common.io import read_json, read_jsonl, write_json_atomic, write_jsonl_atomic
from vlmrl.config.schema import ConfigError, HealthConfig, LoraConfig, load_config
from vlmrl.models.loading import adapter_base_problem, adapter_files_problem
from vlmrl.run import layout
from vlmrl.train.callbacks import (
    HealthMonitor,
    RolloutRecorder,
    TrainProgress,
    divergence_line,
    nothing_learned_line,
    reward_never_varied,
)
from vlmrl.train.resume import ends_training, final_from_checkpoint, resume_point


def adapter(folder: Path, *, b: float = 0.5) -> Path:
    """A two-module PEFT adapter: adapter_config.json and adapter_model.safetensors (B filled with `b`)."""
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(folder / "adapter_config.json", {"r": 2, "base_model_name_or_path": "base",
                                                       "peft_type": "LORA"})
    stem = "base_model.model.model.language_model.layers.0.self_attn"
    save_file({f"{stem}.{p}.lora_{m}.weight": torch.full((2, 4) if m == "A" else (4, 2), 0.25 if m == "A" else b)
               for p in ("q_proj", "v_proj") for m in ("A", "B")}, str(folder / "adapter_model.safetensors"))
    return folder


def checkpoint(checkpoints: Path, step: int, fingerprint: str = "F") -> Path:
    """A checkpoint as transformers + vlmrl leave it: the adapter, the trainer's state, the stamp."""
    folder = adapter(checkpoints / f"checkpoint-{step}")
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"):
        (folder / name).write_bytes(b"state")
    write_json_atomic(folder / "trainer_state.json", {"global_step": step})
    write_json_atomic(folder / layout.CHECKPOINT_STAMP, {"fingerprint": fingerprint, "step": step})
    return folder


# --- a kill after the last checkpoint, before train/summary.json -----------------------------------------------


def test_a_checkpoint_at_max_steps_ends_the_training_instead_of_resuming_it(tmp_path):
    """Killed after checkpoint-4 of 4 and before the summary, `vlmrl train` resumed it and trained "step 5/4";
    a checkpoint at max_steps is the end: final/ is made from it and nothing trains."""
    checkpoints = tmp_path / layout.CHECKPOINTS
    for step in (3, 4):
        checkpoint(checkpoints, step)
    last = resume_point(checkpoints, "F", 4)
    assert last == checkpoints / "checkpoint-4" and ends_training(last, 4)
    assert not ends_training(checkpoints / "checkpoint-3", 4)  # one step left: resumed as before
    assert not ends_training(last, -1)  # an epoch count: transformers trains nothing past the last epoch itself
    assert not ends_training(None, 4)

    final = tmp_path / layout.FINAL
    adapter(final, b=9.0)  # a final/ from before the kill (or half written) is replaced
    final_from_checkpoint(last, final)
    assert sorted(p.name for p in final.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "training_args.bin"]  # what save_model writes
    assert (final / "adapter_model.safetensors").read_bytes() == (last / "adapter_model.safetensors").read_bytes()
    assert adapter_files_problem(final) is None and not (tmp_path / "train" / "final.partial").exists()


def offline_stage(monkeypatch, tmp_path: Path, *extra: str):
    """The train stage without data or a model: what comes before the model load answers from stubs."""
    from vlmrl.train import stage

    config = load_config("demo", ["model.name=tiny:qwen3_vl", f"run.output_dir={tmp_path}", *extra])
    monkeypatch.setattr(stage, "build_train_dataset", lambda run_dir: [{}] * 40)
    monkeypatch.setattr(stage, "check_run_rewards", lambda config, run_dir: [])
    monkeypatch.setattr(stage, "_multimodal_ids", lambda config, run_dir: [])
    monkeypatch.setattr(stage, "_same_file_on_every_rank", lambda path: None)
    monkeypatch.setattr(stage, "trl_device_problem", lambda device, version: None)
    monkeypatch.setattr("vlmrl.models.loading.resolve_model_source", lambda *a, **k: str(tmp_path / "base"))
    return stage, config


def test_the_train_stage_finishes_from_the_last_checkpoint_without_loading_a_model(tmp_path, monkeypatch):
    """The whole decision in `train`: the summary and final/ from checkpoint-2 of 2, the records untouched."""
    stage, config = offline_stage(monkeypatch, tmp_path, "train.max_steps=2")
    run_dir = config.run_dir
    checkpoint(run_dir / layout.CHECKPOINTS, 2, layout.checkpoint_fingerprint(config))
    write_jsonl_atomic(run_dir / layout.METRICS, [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}])
    write_jsonl_atomic(run_dir / layout.HEALTH, [{"step": s, "n": 8, "zero_variance_groups": 0.5, "warnings": []}
                                                 for s in (1, 2)])
    monkeypatch.setattr("vlmrl.models.loading.load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    said: list[str] = []

    result = stage.train(config, run_dir, console_callback=said.append)

    assert result.summary["steps"] == 2 and result.summary["finished_from_checkpoint"] == "checkpoint-2"
    assert result.summary["train_loss"] == pytest.approx(0.375) and result.summary["lora"]["lora_modules"] == 2
    assert read_json(run_dir / layout.TRAIN_SUMMARY)["steps"] == 2 and layout.is_trained(config, run_dir)
    assert sorted(p.name for p in (run_dir / layout.CHECKPOINTS).iterdir()) == ["checkpoint-2"]  # no checkpoint-3
    assert [r["step"] for r in read_jsonl(run_dir / layout.METRICS)] == [1, 2]
    assert [line for line in said if "checkpoint-2 is the last step" in line] and "training nothing" in said[-1]
    assert stage.is_finished(config, run_dir)  # the next `vlmrl train` has nothing to do


# --- LoRA's initialisation follows run.seed --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tiny_qwen3_vl):
    from transformers import AutoModelForImageTextToText

    return lambda: AutoModelForImageTextToText.from_pretrained(str(tiny_qwen3_vl), dtype=torch.float32)


def lora_a(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_A." in n}


class Loaded(Exception):
    """Stops the train stage at its model load."""


def test_the_train_stage_seeds_every_draw_from_run_seed_before_the_model_loads(tmp_path, monkeypatch):
    stage, config = offline_stage(monkeypatch, tmp_path, "run.seed=123")

    def load_model(*args, seed: int, **kwargs):
        raise Loaded(torch.initial_seed(), seed, torch.rand(1).item())

    monkeypatch.setattr("vlmrl.models.loading.load_model", load_model)
    draws = []
    for _ in range(2):
        torch.manual_seed(len(draws))  # whatever state an earlier command left
        with pytest.raises(Loaded) as info:
            stage.train(config, config.run_dir, resume=False)
        draws.append(info.value.args)
    assert draws[0] == draws[1] and draws[0][:2] == (123, 123)


def test_lora_initialisation_is_seeded_by_run_seed(tiny_model):
    """PEFT draws lora_A from torch's global generator: unseeded, two `vlmrl train`s of one config differed by up
    to 0.178. Every entry point that builds an adapter goes through `apply_lora` (train, and run through it);
    evaluation seeds each batch and export's checks are greedy."""
    from vlmrl.models.lora import apply_lora

    first, _ = apply_lora(tiny_model(), LoraConfig(), seed=7)
    torch.rand(1000)  # whatever ran before (a baseline evaluation, another test) does not matter
    second, _ = apply_lora(tiny_model(), LoraConfig(), seed=7)
    other, _ = apply_lora(tiny_model(), LoraConfig(), seed=8)
    a, b, c = lora_a(first), lora_a(second), lora_a(other)
    assert a and a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[n], b[n]) for n in a)  # bit-identical
    assert not all(torch.equal(a[n], c[n]) for n in a)


# --- a damaged adapter is not trusted ---------------------------------------------------------------------------


def test_a_truncated_or_broken_adapter_is_named_and_never_resumed(tmp_path):
    good = adapter(tmp_path / "good")
    assert adapter_files_problem(good) is None
    weights = adapter(tmp_path / "cut") / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    assert "adapter_model.safetensors is truncated" in adapter_files_problem(weights.parent)
    weights.write_bytes(weights.read_bytes()[:5])
    assert "header is cut off" in adapter_files_problem(weights.parent)
    (adapter(tmp_path / "json") / "adapter_config.json").write_text('{"r": 2,')
    assert "adapter_config.json is not valid JSON" in adapter_files_problem(tmp_path / "json")
    # export and eval ask adapter_base_problem first: one line, no SafetensorError / JSONDecodeError
    problem = adapter_base_problem(tmp_path / "json", "tiny:qwen3_vl", tmp_path)
    assert problem.startswith(f"{tmp_path / 'json'}: damaged adapter") and "`vlmrl train`" in problem
    assert "\n" not in problem

    checkpoints = tmp_path / layout.CHECKPOINTS
    checkpoint(checkpoints, 1)
    cut = checkpoint(checkpoints, 2) / "adapter_model.safetensors"
    cut.write_bytes(cut.read_bytes()[:40])
    assert resume_point(checkpoints, "F", 0) == checkpoints / "checkpoint-1"


def test_a_damaged_final_means_training_is_not_done(tmp_path):
    from vlmrl.train.stage import final_damage, is_finished

    config = load_config("demo", ["model.name=tiny:qwen3_vl", f"run.output_dir={tmp_path}"])
    run_dir = config.run_dir
    adapter(run_dir / layout.FINAL)
    write_json_atomic(run_dir / layout.TRAIN_SUMMARY, {"fingerprint": layout.train_fingerprint(config), "steps": 2})
    assert final_damage(config, run_dir) is None and is_finished(config, run_dir)
    weights = run_dir / layout.FINAL / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1])
    assert "truncated" in final_damage(config, run_dir) and not is_finished(config, run_dir)


# --- divergence stops in one line -------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", ["1e30", "1e300", "inf", "nan", "0"])
def test_an_absurd_learning_rate_is_refused_with_the_config(tmp_path, rate):
    with pytest.raises(ConfigError, match="train.learning_rate"):
        load_config("demo", [f"train.learning_rate={rate}", f"run.output_dir={tmp_path}"])


ARGS = SimpleNamespace(num_generations=2, reward_weights=[0.3, 1.0], learning_rate=0.5, logging_steps=1)


def health(tmp_path) -> tuple[HealthMonitor, list[str]]:
    said: list[str] = []
    monitor = HealthMonitor(HealthConfig(), tmp_path / "health.jsonl", console=said.append)
    monitor.attach(RolloutRecorder(tmp_path / "rollouts.jsonl"))
    return monitor, said


def step_end_and_log(monitor: HealthMonitor, model, logs: dict) -> TrainerControl:
    state = SimpleNamespace(global_step=1, is_world_process_zero=True)
    control = monitor.on_step_end(ARGS, state, TrainerControl(should_save=True), model=model)  # save_steps=1
    return monitor.on_log(ARGS, state, control, logs=logs)


@pytest.mark.parametrize(("value", "said"), [(math.inf, "non-finite trainable weights (inf)"),
                                             (1e30, "trainable weights blew up (|w| up to 1e+30")])
def test_weights_that_blow_up_stop_training_before_the_next_sampling(tmp_path, value, said):
    """learning_rate=1e30 wrote weights whose logits overflow: the next step's torch.multinomial raised a
    traceback. The monitor looks at the weights after each update and stops in one line."""
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight[0, 0] = value
    monitor, console = health(tmp_path)
    control = step_end_and_log(monitor, model, {"loss": 0.1, "grad_norm": 0.5})
    assert control.should_training_stop and not control.should_save  # not even the scheduled save: nothing to resume
    assert monitor.halted.startswith(said) and "learning rate too high? lower train.learning_rate (now 0.5)" in \
        monitor.halted
    assert console == [f"[health] step 1: {read_jsonl(tmp_path / 'health.jsonl')[0]['warnings'][0]}"]

    (tmp_path / "sane").mkdir()
    sane, _ = health(tmp_path / "sane")
    control = step_end_and_log(sane, torch.nn.Linear(2, 2), {"loss": 0.1})
    assert not control.should_training_stop and control.should_save and sane.halted is None


def test_errors_of_a_diverged_step_become_one_line():
    try:
        torch.multinomial(torch.tensor([math.nan, 1.0]), 1)
    except RuntimeError as exc:
        line = divergence_line(exc, 2, 1e30)
    assert line == ("training diverged at step 2: the policy's sampling probabilities are not finite (inf/nan): its "
                    "weights blew up; learning rate too high? lower train.learning_rate (now 1e+30), or clip harder "
                    "with a smaller train.max_grad_norm.")
    assert divergence_line(RuntimeError("CUDA out of memory"), 2, 1e-5) is None  # not ours to explain


def test_a_reward_logging_a_nan_loss_is_named_and_the_progress_line_survives(tmp_path):
    """TRL logs an all-NaN metric as None, and a reward's metric named "loss" replaces the trainer's: the
    progress line raised TypeError on None."""
    monitor, _ = health(tmp_path)
    control = step_end_and_log(monitor, None, {"loss": None, "reward": 1.0})
    assert control.should_training_stop and "log_metric" in monitor.halted
    lines: list[str] = []
    progress = TrainProgress(None, lines.append)
    state = SimpleNamespace(global_step=1, max_steps=4, is_world_process_zero=True)
    progress.on_train_begin(ARGS, SimpleNamespace(global_step=0, max_steps=4, is_world_process_zero=True), None)
    progress.on_log(ARGS, state, None, logs={"loss": None, "reward": "odd"})
    assert lines and lines[0].startswith("step 1/4 (25%)") and "reward nan" in lines[0] and "loss nan" in lines[0]


# --- nothing learned, said -----------------------------------------------------------------------------------------


def test_a_reward_that_never_varies_is_said_and_the_untrained_adapter_exports(tmp_path):
    """Every group tied at every step: the run ended in `export verification failed (lora_b_nonzero)` with no
    comparison and no report. Now the training says why in one line and export says the adapter is unchanged."""
    from vlmrl.export.stage import verify_adapter_weights

    path = tmp_path / "health.jsonl"
    write_jsonl_atomic(path, [{"step": s, "n": 8, "zero_variance_groups": 1.0} for s in (1, 2)])
    assert reward_never_varied(path)
    write_jsonl_atomic(path, [{"step": 1, "n": 8, "zero_variance_groups": 1.0},
                              {"step": 2, "n": 8, "zero_variance_groups": 0.75}])
    assert not reward_never_varied(path) and not reward_never_varied(tmp_path / "none.jsonl")
    line = nothing_learned_line("seed")
    assert "\n" not in line and "no reward varied" in line and "contract: seed" in line

    untrained = adapter(tmp_path / "adapter", b=0.0)
    failed = {c.name: c for c in verify_adapter_weights(untrained)}
    assert failed["lora_b_nonzero"].passed is False  # without the training's word, a zero B is a failure
    said = {c.name: c for c in verify_adapter_weights(untrained, untrained=True)}
    assert said["lora_b_nonzero"].passed is None and "unchanged from its initialisation" in said[
        "lora_b_nonzero"].detail
    assert said["lora_finite"].passed is True
    trained = {c.name: c for c in verify_adapter_weights(adapter(tmp_path / "trained"), untrained=True)}
    assert trained["lora_b_nonzero"].passed is True


def test_export_reads_the_trainings_word_from_its_summary(tmp_path):
    from vlmrl.export.stage import _reward_never_varied

    assert not _reward_never_varied(tmp_path)
    write_json_atomic(tmp_path / layout.TRAIN_SUMMARY, {"reward_never_varied": True})
    assert _reward_never_varied(tmp_path)
    (tmp_path / layout.TRAIN_SUMMARY).write_text("{broken")
    assert not _reward_never_varied(tmp_path)
