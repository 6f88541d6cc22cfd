"""Stage 6, training: TRL's `GRPOTrainer` built from the config, GRPO or GSPO by one field.

We do not write an RL loop. What this module adds around TRL: the dataset from the prepared manifests, the
configured rewards with their weights, LoRA on the language layers only (checked), an honest optimizer fallback,
crash-safe resume, and records (`train/metrics.jsonl`, `train/rollouts.jsonl`, `train/health.jsonl`) written
by the callbacks in `vlmrl.train.callbacks`.

    step 1  data      train.jsonl -> datasets.Dataset (prompt, images: a list per item, every Item.columns());
                      each reward called once on held-out items (vlmrl.grading.user_rewards); GRPOConfig from the
                      config (+ trl_overrides), checked before any model loads
    step 2  model     base model + LoRA (initialised from run.seed), layout verified
    step 3  trainer   GRPOTrainer with our rewards and callbacks
    step 4  train     resume from the last checkpoint when one exists (one at max_steps: training was done, so
                      final/ is made from it and nothing trains; a damaged final/ is not done: see final_damage)
    step 5  save      train/final/ (the adapter) + train/summary.json, which says when no reward ever varied

Launched as several processes (`vlmrl train --gpus N`, on one host or `--nodes M`), every rank runs these steps
(TRL shards the prompts, transformers the checkpoints) after checking that all of them read the same
`data/train.jsonl`; only rank 0 writes the records, `train/final/vlmrl_base.json` and the summary.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlmrl.common import distributed
from vlmrl.common.io import (
    DiskSpaceError,
    check_disk_space,
    checkpoint_bytes,
    match_umask,
    read_json,
    read_jsonl,
    write_json_atomic,
)
from vlmrl.common.provenance import package_version
from vlmrl.config.schema import TRL_DEFAULTS, TRL_NAMES, Config
from vlmrl.engine.precision import float32_adapters_for_fp16
from vlmrl.grading.user_rewards import check_run_rewards
from vlmrl.preflight.memory import BatchChoice, auto_batch
from vlmrl.run import layout
from vlmrl.run.layout import train_fingerprint

log = logging.getLogger(__name__)


class TrainError(RuntimeError):
    """Training cannot start or had to stop; the message says why and what to change."""


@dataclass(frozen=True)
class TrainResult:
    final_dir: Path
    summary: dict
    already_done: bool = False  # a finished run of this config was found; nothing was trained


def trl_device_problem(device_type: str, trl_version: str) -> str | None:
    """Why this TRL cannot train on this device, or None. TRL 1.15's GRPOTrainer computes the loss pass's
    log-probs with Triton kernels only (`trl.kernels`), which do not run on a CPU; TRL 1.16 added a CPU path.
    vlmrl admits 1.15 because Unsloth 2026.10.9 pins trl<=1.15, and that pairing is for a GPU."""
    from packaging.version import Version

    if device_type != "cpu" or Version(trl_version) >= Version("1.16"):
        return None
    return (f"trl {trl_version} computes GRPO's log-probs with Triton kernels only, which do not run on a CPU; "
            "training on a CPU needs trl>=1.16 (pip install -U 'trl>=1.16'), or run on a CUDA GPU.")


def train(config: Config, run_dir: Path, *, resume: bool = True, console_callback: Any = None,
          progress: Any = None) -> TrainResult:
    """Train the LoRA adapter of `run_dir` and save it to `run_dir/train/final`."""
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOTrainer

    from vlmrl.common.provenance import provenance, utc_now
    from vlmrl.engine.loss.loss_pass import enable_loss_pass
    from vlmrl.engine.rollout.compile_cache import use_compile_cache
    from vlmrl.engine.rollout.fast import FastGeneration, enable_fast_generation
    from vlmrl.engine.rollout.fast import wanted as fast_wanted
    from vlmrl.engine.rollout.mismatch import enable_rollout_mismatch
    from vlmrl.engine.rollout.sharded import gather_root_in_rollouts
    from vlmrl.models.loading import BASE_RECORD, base_identity, load_model
    from vlmrl.models.lora import apply_lora, seed_all
    from vlmrl.train.args import gspo_loss_note, quiet_trl_gspo_warning
    from vlmrl.train.callbacks import (
        HealthMonitor,
        MetricsRecorder,
        RolloutRecorder,
        TrainProgress,
        divergence_line,
        nothing_learned_line,
        reward_never_varied,
    )
    from vlmrl.train.dynamic_sampling import enable_dynamic_sampling, settings_problem
    from vlmrl.train.resume import CheckpointStamp, ResumeError, ends_training, set_aside
    from vlmrl.train.trackers import TrackerError, build_tracker_callbacks, resume_trackers
    from vlmrl.train.validation import ValidationCallback

    train_dir = run_dir / layout.TRAIN
    checkpoints = run_dir / layout.CHECKPOINTS
    if resume and (damage := final_damage(config, run_dir)):
        (console_callback or log.warning)(f"train: {run_dir / layout.FINAL} is damaged ({damage}); training is not "
                                          "done: it resumes from the last good checkpoint (step 0 if none)")
    if resume and is_finished(config, run_dir):
        summary = read_json(run_dir / layout.TRAIN_SUMMARY)
        if console_callback:
            console_callback(f"train: {run_dir} already finished {summary.get('steps')} steps with this config; "
                             "nothing to do (pass --no-resume to train again).")
        return TrainResult(run_dir / layout.FINAL, summary, already_done=True)
    started_at = utc_now()
    # step 1: data, and the trainer's arguments (a bad trl_overrides key fails here, before any model loads)
    dataset = build_train_dataset(run_dir)
    _check_trainable(config, run_dir, len(dataset))
    rewards = check_run_rewards(config, run_dir)  # a broken reward fails here, not mid-run
    if problem := settings_problem(config.train.dynamic_sampling, [r.name for r in rewards]):
        raise TrainError(problem + ".")
    if not resume and distributed.is_main_process() and (moved := set_aside(run_dir)) is not None:
        (console_callback or log.warning)(f"train: starting over; the earlier training was moved aside to {moved}")
    choice = _auto_batch(config, train_dir, len(dataset), console_callback)
    args, notes = build_grpo_config(config, checkpoints, suppress_tokens=_multimodal_ids(config, run_dir),
                                    batch=choice.per_device_train_batch_size if choice else None)
    _ = args.device  # sets up the process group (several ranks) and pins this rank's GPU before the model loads
    if problem := trl_device_problem(args.device.type, package_version("trl") or "0"):
        raise TrainError(problem)
    _same_file_on_every_rank(run_dir / "data" / "train.jsonl")
    last = _start_point(config, run_dir, resume=resume)  # the checkpoint to resume, or None
    if ends_training(last, config.train.max_steps):  # killed after the last checkpoint, before the summary
        return _finish_from(last, config, run_dir, args=args, notes=notes, n_train=len(dataset),
                            started_at=started_at, say=console_callback)
    try:
        trackers = build_tracker_callbacks(config.train.report_to, train_dir)
    except TrackerError as exc:
        raise TrainError(str(exc)) from None
    if note := gspo_loss_note(config):
        notes.append(note)
        quiet_trl_gspo_warning()  # ours says it once and why; TRL's would repeat it per trainer
        if console_callback is None:  # the CLI says it itself, for the presets that choose it (cli.show.preset_note)
            log.warning(f"note: {notes[-1]}")
    compile_cache = use_compile_cache()  # before anything compiles: the first step's compile, cached across runs
    # step 2: model (every draw seeded from run.seed: the same seed gives the same LoRA initialisation)
    seed_all(config.run.seed)
    loaded = load_model(config.model, run_dir, for_training=True, seed=config.run.seed)
    model, lora_report = apply_lora(loaded.model, config.lora, backend=loaded.backend, seed=config.run.seed)
    try:  # a full disk found at the first save would cost every step before it
        check_disk_space(checkpoints, checkpoint_bytes(lora_report.trainable_params), what="one checkpoint")
    except DiskSpaceError as exc:
        raise TrainError(str(exc)) from None
    # step 3: trainer
    recorder = RolloutRecorder(run_dir / layout.ROLLOUTS, contract=config.contract)
    health = HealthMonitor(config.health, run_dir / layout.HEALTH, console=console_callback)
    watchers: list[Any] = [*trackers]
    if console_callback or progress:  # the progress display replaces MetricsRecorder's own line
        watchers.append(progress or TrainProgress(None, console_callback, recorder))
    validation = (ValidationCallback(config, run_dir, processor=loaded.processor, trackers=trackers,
                                     say=console_callback, base_record=base_identity(config.model.name, loaded.source))
                  if config.train.eval_every_steps else None)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[recorder.wrap(rewards[0].fn), *(r.fn for r in rewards[1:])],
        args=args,
        train_dataset=dataset,
        processing_class=loaded.processor,
        callbacks=[MetricsRecorder(run_dir / layout.METRICS, recorder), recorder, health, *watchers,
                   *([validation] if validation else []), CheckpointStamp(layout.checkpoint_fingerprint(config))],
    )
    trainer.remove_callback(PrinterCallback)  # TrainProgress prints one readable line per step instead
    float32_adapters_for_fp16(trainer)  # TRL casts QLoRA adapters to bf16, which fp16's loss scaler refuses
    gather_root_in_rollouts(trainer)  # FSDP: TRL's rollouts bypass the root unit (vlmrl.engine.rollout.sharded)
    fast = (
        enable_fast_generation(trainer, bucket=config.train.rollout.prompt_bucket, kernels=config.train.rollout.kernels)
        if fast_wanted(config.train.rollout.fast)
        else FastGeneration(False, f"train.rollout.fast={config.train.rollout.fast}")
    )
    loss_pass = enable_loss_pass(trainer, kernels=config.train.rollout.kernels)
    # last: it wraps the fast path's and the loss pass's wrappers (the sampler's log-probs, the mismatch, TIS)
    mismatch = enable_rollout_mismatch(trainer, correction=config.train.rollout_correction, fast=fast.enabled)
    sampling = (enable_dynamic_sampling(trainer, config.train.dynamic_sampling, seed=config.run.seed)
                if config.train.dynamic_sampling.enabled else None)  # wraps the batch TRL scores: off, nothing changes
    recorder.attach(trainer)
    health.attach(recorder)
    # step 4: train, from the checkpoint chosen in step 1 if there is one
    start_step = int(last.name.split("-")[-1]) if last else 0
    resume_trackers(trackers, start_step)  # TensorBoard hides what it plotted past that step
    if isinstance(progress, TrainProgress):
        progress.recorder = recorder
    started = time.perf_counter()
    try:
        output = trainer.train(resume_from_checkpoint=str(last) if last else None)
    except ResumeError as exc:  # a resumed step past the last one (an epoch count, not max_steps)
        raise TrainError(str(exc)) from None
    except (RuntimeError, OverflowError) as exc:  # a step that blew up, met by the next one (sampling, the update)
        if line := divergence_line(exc, trainer.state.global_step + 1, config.train.learning_rate):
            raise TrainError(line) from None
        raise
    seconds = time.perf_counter() - started
    if health.halted:
        raise TrainError(f"training stopped at step {trainer.state.global_step}: {health.halted} "
                         f"(checkpoints under {checkpoints}; see {run_dir / layout.HEALTH}).")
    never_varied = distributed.is_main_process() and reward_never_varied(run_dir / layout.HEALTH)
    if never_varied:
        (console_callback or log.warning)(nothing_learned_line(config.contract))
    # step 5: save
    final_dir = run_dir / layout.FINAL
    # resumed: TRL's figure covers only this process's steps; metrics.jsonl holds them all
    resumed_loss = total_train_loss(run_dir / layout.METRICS, trainer.state.global_step) if start_step else None
    trainer.save_model(str(final_dir))  # every rank: FSDP/ZeRO-3 gather the weights; rank 0 writes them
    summary = {
        **_summary_head(config, args),
        "steps": trainer.state.global_step,
        "resumed_from_step": start_step,
        "train_seconds": round(seconds, 2),
        "train_loss": output.training_loss if resumed_loss is None else resumed_loss,
        "train_items": len(dataset),
        "world_size": distributed.world_size(),  # processes of all hosts: a generation batch is this many per-device ones
        "lora": lora_report.as_dict(),
        "backend": loaded.backend,
        "base_model": loaded.source,
        "notes": notes,
        "health_warnings": health.warning_count,
        "reward_never_varied": never_varied,  # every group tied at every step: the adapter is its initialisation
        "fast_generation": fast.as_dict(),
        "loss_pass": loss_pass.as_dict(),  # this process's log-prob passes and how its micro-batches were formed
        "rollout_correction": mismatch.as_dict(),  # the sampler's log-probs, what they are compared with, TIS
        **({"dynamic_sampling": sampling.as_dict()} if sampling else {}),  # groups kept, dropped, filled (this process)
        "compile_cache": compile_cache.as_dict(),
        "auto_batch": choice.as_dict() if choice else None,
        "report_to": list(config.train.report_to),
        "validation": validation.summary() if validation else None,
        "provenance": provenance(started_at=started_at, finished_at=utc_now()),
    }
    if distributed.is_main_process():
        for folder in (final_dir, checkpoints, run_dir / layout.BEST):
            if folder.is_dir():
                match_umask(folder)  # the adapter weights arrive 0600 from safetensors
        write_json_atomic(final_dir / BASE_RECORD, base_identity(config.model.name, loaded.source))
        write_json_atomic(run_dir / layout.TRAIN_SUMMARY, summary)
    distributed.barrier()  # no rank returns (and maybe starts evaluating) before the adapter is complete
    return TrainResult(final_dir, summary)


def _finish_from(checkpoint: Path, config: Config, run_dir: Path, *, args: Any, notes: list[str], n_train: int,
                 started_at: str, say: Any) -> TrainResult:
    """The training whose last checkpoint is `checkpoint` is done: `final/` from it and the summary, no step
    trained. The summary says what the files tell without loading the model (the steps, the loss from
    metrics.jsonl, the adapter's size); what only the trainer measured (fast_generation, loss_pass) is absent."""
    from vlmrl.common.provenance import provenance, utc_now
    from vlmrl.models.loading import BASE_RECORD, base_identity, resolve_model_source
    from vlmrl.train.callbacks import reward_never_varied
    from vlmrl.train.resume import ResumeError, checkpoint_step, final_from_checkpoint

    step = checkpoint_step(checkpoint)
    final_dir = run_dir / layout.FINAL
    (say or log.warning)(f"train: {checkpoint.name} is the last step (train.max_steps={config.train.max_steps}): "
                         f"training was done; saving it as {final_dir} and writing the summary, training nothing")
    source = resolve_model_source(config.model.name, run_dir, config.run.seed)
    summary = {
        **_summary_head(config, args),
        "steps": step,
        "resumed_from_step": step,
        "finished_from_checkpoint": checkpoint.name,
        "train_seconds": 0.0,
        "train_loss": total_train_loss(run_dir / layout.METRICS, step),
        "train_items": n_train,
        "world_size": distributed.world_size(),
        "lora": _adapter_size(checkpoint),
        "backend": None,
        "base_model": source,
        "notes": notes,
        "health_warnings": sum(len(r.get("warnings") or []) for r in read_jsonl(run_dir / layout.HEALTH)),
        "reward_never_varied": reward_never_varied(run_dir / layout.HEALTH),
        "report_to": list(config.train.report_to),
        "provenance": provenance(started_at=started_at, finished_at=utc_now()),
    }
    if distributed.is_main_process():
        try:
            final_from_checkpoint(checkpoint, final_dir)
        except ResumeError as exc:
            raise TrainError(str(exc)) from None
        match_umask(final_dir)
        write_json_atomic(final_dir / BASE_RECORD, base_identity(config.model.name, source))
        write_json_atomic(run_dir / layout.TRAIN_SUMMARY, summary)
    distributed.barrier()
    return TrainResult(final_dir, summary)


def _adapter_size(folder: Path) -> dict:
    """The LoRA counts an adapter's safetensors header gives: its parameters (all of them train) and modules."""
    import json

    from vlmrl.models.loading import ADAPTER_WEIGHTS

    with (folder / ADAPTER_WEIGHTS).open("rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    shapes = {k: v["shape"] for k, v in header.items() if k != "__metadata__"}
    params = sum(math.prod(shape) for shape in shapes.values())
    return {"trainable_params": params, "lora_modules": sum(".lora_A" in k for k in shapes)}


def _start_point(config: Config, run_dir: Path, *, resume: bool) -> Path | None:
    """The checkpoint training resumes (None: step 0), with everything past its step removed: later
    checkpoints, record rows, a kept best step (vlmrl.train.resume)."""
    from vlmrl.train.callbacks import trim_records_after
    from vlmrl.train.resume import ResumeError, discard_after, resume_point

    fingerprint = layout.checkpoint_fingerprint(config)
    try:
        last = resume_point(run_dir / layout.CHECKPOINTS, fingerprint, config.train.max_steps) if resume else None
    except ResumeError as exc:  # another training's checkpoint: refused before anything is touched
        raise TrainError(str(exc)) from None
    if distributed.is_main_process():
        step = int(last.name.removeprefix("checkpoint-")) if last else 0
        discard_after(run_dir, step, fingerprint)
        trim_records_after(run_dir, step)
    distributed.barrier()  # no rank reads train/ before rank 0 has cleared it
    return last


def build_train_dataset(run_dir: Path):
    """`data/train.jsonl` as the conversational image dataset TRL expects (images decoded lazily; see
    data/table.py for the columns)."""
    import datasets

    path = run_dir / "data" / "train.jsonl"
    if not path.is_file():
        raise TrainError(f"{path}: no training set; run `vlmrl prepare` for this config first.")
    rows = read_jsonl(path)
    from vlmrl.data.items import Item
    from vlmrl.data.prepare import check_prepared
    from vlmrl.data.table import train_table

    holdout = read_jsonl(run_dir / layout.HOLDOUT)
    check_prepared(run_dir, [Item.from_json(r) for r in rows], [Item.from_json(r) for r in holdout])
    items = [Item.from_json(r) for r in rows]
    table = train_table(items, run_dir)  # prompt, images (a list per item) and every column rewards receive
    datasets.disable_progress_bars()  # its cast bar has no newline: our one-line messages would follow it
    return datasets.Dataset.from_dict(table).cast_column("images", datasets.Sequence(datasets.Image()))


def _auto_batch(config: Config, train_dir: Path, n_train: int, say: Any) -> BatchChoice | None:
    """train.auto_batch's choice (None when off), said and written to train/auto_batch.json before training."""
    t = config.train
    # no bigger batch than the training set fills: one generation batch needs batch x processes x
    # steps_per_generation / num_generations prompts (the check _check_trainable makes for the configured one)
    per_step = distributed.world_size() * (t.steps_per_generation or t.gradient_accumulation_steps)
    max_batch = max(t.num_generations, n_train * t.num_generations // per_step // t.num_generations * t.num_generations)
    choice = auto_batch(config, max_batch=min(max_batch, 4096))
    if choice is None:
        return None
    (say or log.info)(choice.note)
    if distributed.is_main_process():
        write_json_atomic(train_dir / "auto_batch.json", choice.as_dict())
    return choice


def _same_file_on_every_rank(path: Path) -> None:
    """Refuse, on every rank alike, a run whose ranks read different copies of `path`: hosts that do not share
    the run folder would each train on their own data and the records would mix them silently."""
    differing = distributed.ranks_differing(distributed.file_digest(path))
    if differing:
        raise TrainError(
            f"{path} differs between rank 0 and rank(s) {', '.join(map(str, differing))}: every host must read the "
            "same run folder, on a filesystem all of them see (docs/multi_gpu.md, Several hosts)."
        )


def _check_trainable(config: Config, run_dir: Path, n_train: int) -> None:
    """Refuse, before any model loads, a training set smaller than one generation batch (TRL would take 0 steps
    and an untrained adapter would be evaluated as if trained)."""
    from vlmrl.data.prepare import min_train_items

    need = min_train_items(config, distributed.world_size())
    if n_train >= need:
        return
    summary = run_dir / layout.DATA_SUMMARY
    dropped = read_json(summary).get("dropped_by_reason", {}) if summary.is_file() else {}
    top = ", ".join(f"{reason}: {count}" for reason, count in list(dropped.items())[:3])
    raise TrainError(
        f"{run_dir / 'data' / 'train.jsonl'}: {n_train} training items, fewer than one generation batch ({need} "
        f"prompts: per_device_train_batch_size x processes x steps_per_generation / num_generations), so training "
        f"could take no step" + (f" (drops: {top})" if top else "") + ". Lower the batch size or "
        "data.holdout_size, or supply more data, then re-run `vlmrl prepare`."
    )


def total_train_loss(metrics_path: Path, steps: int) -> float | None:
    """The mean loss over steps 1..`steps` from metrics.jsonl (each logged loss is the mean since the previous
    log, so it is weighted by its interval), or None when the rows do not cover every step. A resumed run's
    own `training_loss` covers only the steps it ran.
    """
    by_step = {r["step"]: r["loss"] for r in read_jsonl(metrics_path) if "loss" in r and "step" in r}
    if not by_step or max(by_step) != steps or None in by_step.values():  # null: a non-finite loss was logged
        return None
    total, previous = 0.0, 0
    for step in sorted(by_step):
        total += float(by_step[step]) * (step - previous)
        previous = step
    return total / steps


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
    from vlmrl.train.args import training_problems

    problems = training_problems(config)  # the same checks as `vlmrl config validate`
    if problems:
        raise TrainError("; ".join(problems) + ".")
    for name in [*TRL_DEFAULTS, *t.trl_overrides]:  # vlmrl's values for the fields it leaves to trl_overrides,
        kwargs[TRL_NAMES.get(name, name)] = t.trl_value(name)  # or the overrides (warmup_ratio as warmup_steps)
    try:  # an unknown optimizer or scheduler name, or a contradiction TRL finds: before any model loads
        return GRPOConfig(**kwargs), notes
    except (ValueError, TypeError) as exc:
        raise TrainError(f"train: TRL refuses these settings: {' '.join(str(exc).split())}") from None


def _multimodal_ids(config: Config, run_dir: Path) -> list[int]:
    from transformers import AutoConfig

    from vlmrl.models.loading import multimodal_token_ids, resolve_model_source

    return multimodal_token_ids(AutoConfig.from_pretrained(resolve_model_source(config.model.name, run_dir, config.run.seed)))


def final_damage(config: Config, run_dir: Path) -> str | None:
    """Why this config's finished training's `final/` cannot be trusted (None: it can, or there is none)."""
    from vlmrl.models.loading import adapter_files_problem

    return adapter_files_problem(run_dir / layout.FINAL) if layout.is_trained(config, run_dir) else None


def is_finished(config: Config, run_dir: Path) -> bool:
    """Trained with this config, `final/` whole (`final_damage`), and no checkpoint is missing the last step (a
    kill after the summary was written but mid-save would leave the last checkpoint behind the summary's step
    count: then training resumes)."""
    from vlmrl.train.resume import last_complete_checkpoint

    if not layout.is_trained(config, run_dir) or final_damage(config, run_dir):
        return False
    last = last_complete_checkpoint(run_dir / layout.CHECKPOINTS)
    steps = read_json(run_dir / layout.TRAIN_SUMMARY).get("steps") or 0
    return last is None or int(last.name.split("-")[-1]) >= steps


def _summary_head(config: Config, args) -> dict:
    """The first fields of train/summary.json: what trained, and how."""
    return {"fingerprint": train_fingerprint(config), "algorithm": config.train.algorithm,
            "importance_sampling_level": args.importance_sampling_level, "loss_type": args.loss_type,
            "optimizer": args.optim}
