"""The train stage's trainer: `GRPOConfig` from the config, and TRL's `GRPOTrainer` built around the LoRA-wrapped
model with vlmrl's callbacks and its engine switched on (`vlmrl.train.stage` runs it).

    build_grpo_config   the config's fields as GRPOConfig's (+ trl_overrides), refused before any model loads
    build_train_dataset data/train.jsonl as the dataset TRL takes (prompt, images, every column rewards receive)
    build_trainer       GRPOTrainer with our rewards and callbacks (the records, health, progress, validation)
    enable_engine       inside the built trainer: the fast rollout path, the loss pass, the rollout mismatch,
                        dynamic sampling; what each did is read for train/summary.json after training
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlmrl.common.io import read_jsonl
from vlmrl.config.schema import TRL_DEFAULTS, TRL_NAMES, Config
from vlmrl.data.items import Item
from vlmrl.data.table import train_table
from vlmrl.engine.loss import loss_pass
from vlmrl.engine.loss.loss_pass import LossPass
from vlmrl.engine.precision import float32_adapters_for_fp16
from vlmrl.engine.rollout import fast, mismatch
from vlmrl.engine.rollout.fast import FastGeneration
from vlmrl.engine.rollout.mismatch import RolloutMismatch
from vlmrl.engine.rollout.sharded import gather_root_in_rollouts
from vlmrl.models.loading import base_identity
from vlmrl.run import layout
from vlmrl.train.args import training_problems
from vlmrl.train.dynamic_sampling import DynamicSampling, enable_dynamic_sampling

log = logging.getLogger(__name__)


class TrainError(RuntimeError):
    """Training cannot start or had to stop; the message says why and what to change."""


def build_grpo_config(
    config: Config, output_dir: Path, *, suppress_tokens: list[int] | None = None, batch: int | None = None
) -> tuple[Any, list[str]]:
    """GRPOConfig from our typed config; returns it and notes about any fallback taken. `batch` replaces
    train.per_device_train_batch_size (train.auto_batch's choice; the config, and so its fingerprint, keep the
    configured value)."""
    from trl import GRPOConfig

    t = config.train
    notes: list[str] = []
    optim = t.optim
    if "8bit" in optim and not (torch.cuda.is_available() and importlib.util.find_spec("bitsandbytes")):
        notes.append(f"optimizer {optim} needs bitsandbytes on CUDA; using adamw_torch instead")
        log.warning(notes[-1])
        optim = "adamw_torch"
    on_cuda = torch.cuda.is_available()
    kwargs: dict[str, Any] = dict(  # noqa: C408  (keyword form mirrors GRPOConfig)
        output_dir=str(output_dir),
        seed=config.run.seed,
        learning_rate=t.learning_rate,
        optim=optim,
        per_device_train_batch_size=batch or t.per_device_train_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        steps_per_generation=t.steps_per_generation,
        num_generations=t.num_generations,
        max_completion_length=t.max_completion_length,
        temperature=t.temperature,
        num_train_epochs=t.num_train_epochs,
        max_steps=t.max_steps,
        max_grad_norm=t.max_grad_norm,
        reward_weights=[r.weight for r in config.rewards],
        importance_sampling_level="sequence" if t.algorithm == "gspo" else "token",
        loss_type=t.loss_type,
        gradient_checkpointing=t.gradient_checkpointing,
        logging_nan_inf_filter=False,  # the default logs a NaN loss as the mean of earlier ones, hiding it
        save_strategy="steps",
        save_steps=t.save_steps,
        bf16=on_cuda and config.model.dtype in ("auto", "bfloat16"),
        fp16=on_cuda and config.model.dtype == "float16",
        use_cpu=not on_cuda,
        report_to="none",
        log_completions=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        generation_kwargs={"suppress_tokens": suppress_tokens} if suppress_tokens else None,
    )
    problems = training_problems(config)  # the same checks as `vlmrl config validate`
    if problems:
        raise TrainError("; ".join(problems) + ".")
    for name in [*TRL_DEFAULTS, *t.trl_overrides]:  # vlmrl's values for the fields it leaves to trl_overrides,
        kwargs[TRL_NAMES.get(name, name)] = t.trl_value(name)  # or the overrides (warmup_ratio as warmup_steps)
    try:  # an unknown optimizer or scheduler name, or a contradiction TRL finds: before any model loads
        return GRPOConfig(**kwargs), notes
    except (ValueError, TypeError) as exc:
        raise TrainError(f"train: TRL refuses these settings: {' '.join(str(exc).split())}") from None


def build_train_dataset(run_dir: Path):
    """`data/train.jsonl` as the conversational image dataset TRL expects (images decoded lazily; see
    data/table.py for the columns)."""
    import datasets

    from vlmrl.data.prepare import check_prepared

    path = run_dir / "data" / "train.jsonl"
    if not path.is_file():
        raise TrainError(f"{path}: no training set; run `vlmrl prepare` for this config first.")
    rows = read_jsonl(path)
    holdout = read_jsonl(run_dir / layout.HOLDOUT)
    check_prepared(run_dir, [Item.from_json(r) for r in rows], [Item.from_json(r) for r in holdout])
    items = [Item.from_json(r) for r in rows]
    table = train_table(items, run_dir)  # prompt, images (a list per item) and every column rewards receive
    datasets.disable_progress_bars()  # its cast bar has no newline: our one-line messages would follow it
    return datasets.Dataset.from_dict(table).cast_column("images", datasets.Sequence(datasets.Image()))


@dataclass(frozen=True)
class Engine:
    """What `enable_engine` switched on inside a trainer, each under its train/summary.json field."""

    fast_generation: FastGeneration
    loss_pass: LossPass  # this process's log-prob passes and how its micro-batches were formed
    rollout_correction: RolloutMismatch  # the sampler's log-probs, what they are compared with, TIS
    dynamic_sampling: DynamicSampling | None  # groups kept, dropped, filled (this process); None: it is off

    def as_dict(self) -> dict:
        """The summary's fields, read after training (the loss pass and dynamic sampling count there)."""
        return {
            "fast_generation": self.fast_generation.as_dict(),
            "loss_pass": self.loss_pass.as_dict(),
            "rollout_correction": self.rollout_correction.as_dict(),
            **({"dynamic_sampling": self.dynamic_sampling.as_dict()} if self.dynamic_sampling else {}),
        }


@dataclass(frozen=True)
class BuiltTrainer:
    """A GRPOTrainer ready to train, and the parts of it the stage reads after training."""

    trainer: Any
    health: Any  # vlmrl.train.callbacks.HealthMonitor: halted, warning_count
    validation: Any  # vlmrl.train.validation.ValidationCallback, or None without train.eval_every_steps
    engine: Engine
    budget: Any = None  # vlmrl.train.callbacks.TimeBudget (stopped_at), or None without train.time_budget_minutes


def build_trainer(config: Config, run_dir: Path, *, model: Any, loaded: Any, rewards: list, args: Any, dataset: Any,
                  trackers: list, say: Any = None, progress: Any = None) -> BuiltTrainer:
    """GRPOTrainer over `model` (LoRA-wrapped; `loaded` is its `load_model` result) with the configured rewards (the
    first one's scores recorded with each rollout) and vlmrl's callbacks, its engine switched on."""
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOTrainer

    from vlmrl.train.callbacks import (
        HealthMonitor,
        MetricsRecorder,
        RolloutRecorder,
        TimeBudget,
        TrainProgress,
    )
    from vlmrl.train.resume import CheckpointStamp
    from vlmrl.train.validation import ValidationCallback

    recorder = RolloutRecorder(run_dir / layout.ROLLOUTS, contract=config.contract)
    health = HealthMonitor(config.health, run_dir / layout.HEALTH, console=say)
    watchers: list[Any] = [*trackers]
    if say or progress:  # the progress display replaces MetricsRecorder's own line
        watchers.append(progress or TrainProgress(None, say, recorder))
    validation = (ValidationCallback(config, run_dir, processor=loaded.processor, trackers=trackers, say=say,
                                     base_record=base_identity(config.model.name, loaded.source))
                  if config.train.eval_every_steps else None)
    metrics = MetricsRecorder(run_dir / layout.METRICS, recorder)
    minutes = config.train.time_budget_minutes
    budget = TimeBudget(minutes * 60, metrics) if minutes is not None else None
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[recorder.wrap(rewards[0].fn), *(r.fn for r in rewards[1:])],
        args=args,
        train_dataset=dataset,
        processing_class=loaded.processor,
        callbacks=[metrics, *([budget] if budget else []), recorder, health, *watchers,
                   *([validation] if validation else []), CheckpointStamp(layout.checkpoint_fingerprint(config))],
    )
    trainer.remove_callback(PrinterCallback)  # TrainProgress prints one readable line per step instead
    engine = enable_engine(trainer, config)
    recorder.attach(trainer)
    health.attach(recorder)
    if isinstance(progress, TrainProgress):
        progress.recorder = recorder
    return BuiltTrainer(trainer, health, validation, engine, budget)


def enable_engine(trainer: Any, config: Config) -> Engine:
    """vlmrl's engine inside a built trainer, each piece a wrapper around TRL's own calls; in this order."""
    float32_adapters_for_fp16(trainer)  # TRL casts QLoRA adapters to bf16, which fp16's loss scaler refuses
    gather_root_in_rollouts(trainer)  # FSDP: TRL's rollouts bypass the root unit (vlmrl.engine.rollout.sharded)
    rollout = config.train.rollout
    fast_path = (fast.enable_fast_generation(trainer, bucket=rollout.prompt_bucket, kernels=rollout.kernels)
                 if fast.wanted(rollout.fast) else FastGeneration(False, f"train.rollout.fast={rollout.fast}"))
    passes = loss_pass.enable_loss_pass(trainer, kernels=rollout.kernels)
    # last: it wraps the fast path's and the loss pass's wrappers (the sampler's log-probs, the mismatch, TIS)
    measured = mismatch.enable_rollout_mismatch(trainer, correction=config.train.rollout_correction,
                                                fast=fast_path.enabled)
    sampling = (enable_dynamic_sampling(trainer, config.train.dynamic_sampling, seed=config.run.seed)
                if config.train.dynamic_sampling.enabled else None)  # wraps the batch TRL scores: off, nothing changes
    return Engine(fast_path, passes, measured, sampling)
