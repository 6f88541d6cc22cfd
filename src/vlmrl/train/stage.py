"""Stage 6, training: TRL's `GRPOTrainer` built from the config, GRPO or GSPO by one field.

We do not write an RL loop. What this module adds around TRL: the dataset from the prepared manifests, the
configured rewards with their weights, LoRA on the language layers only (checked), an honest optimizer fallback,
crash-safe resume, and records (`train/metrics.jsonl`, `train/rollouts.jsonl`, `train/health.jsonl`) written
by the callbacks in `vlmrl.train.callbacks`.

    step 1  data      train.jsonl -> datasets.Dataset (prompt, images: a list per item, every Item.columns());
                      each reward called once on held-out items (vlmrl.grading.user_rewards); GRPOConfig from the
                      config (+ trl_overrides), checked before any model loads
    step 2  model     base model + LoRA (initialised from run.seed), layout verified
    step 3  trainer   GRPOTrainer with our rewards and callbacks, vlmrl's engine inside (vlmrl.train.trainer_build)
    step 4  train     resume from the last checkpoint when one exists (one at max_steps: training was done, so
                      final/ is made from it and nothing trains; a damaged final/ is not done: see final_damage)
    step 5  save      train/final/ (the adapter) + train/summary.json, which says when no reward ever varied

Launched as several processes (`vlmrl train --gpus N`, on one host or `--nodes M`), every rank runs these steps
(TRL shards the prompts, transformers the checkpoints) after checking that all of them read the same
`data/train.jsonl`; only rank 0 writes the records, `train/final/vlmrl_base.json` and the summary.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from vlmrl.common.provenance import package_version, provenance, utc_now
from vlmrl.config.schema import Config
from vlmrl.engine.recompiles import trainer_hits
from vlmrl.engine.rollout.compile_cache import use_compile_cache
from vlmrl.grading.user_rewards import check_run_rewards
from vlmrl.models import loading, lora
from vlmrl.models.loading import BASE_RECORD, base_identity
from vlmrl.preflight.memory import BatchChoice, auto_batch
from vlmrl.run import layout
from vlmrl.run.layout import train_fingerprint
from vlmrl.train.args import gspo_loss_note, quiet_trl_gspo_warning
from vlmrl.train.dynamic_sampling import settings_problem
from vlmrl.train.trackers import TrackerError, build_tracker_callbacks, resume_trackers
from vlmrl.train.trainer_build import (
    BuiltTrainer,
    TrainError,
    build_grpo_config,
    build_train_dataset,
    build_trainer,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    final_dir: Path
    summary: dict
    already_done: bool = False  # a finished run of this config was found; nothing was trained


@dataclass(frozen=True)
class _Inputs:
    """What step 1 found: everything the trainer takes but the model, each checked before any model loads."""

    dataset: Any  # datasets.Dataset of data/train.jsonl
    rewards: list  # the configured rewards, each called once on held-out items
    batch: BatchChoice | None  # train.auto_batch's choice (None: off)
    args: Any  # GRPOConfig
    notes: list[str]  # fallbacks taken and notes said, for the summary
    last: Path | None  # the checkpoint to resume (None: step 0)


@dataclass(frozen=True)
class _Trained:
    """What step 4 measured."""

    start_step: int  # the step it resumed from (0: none)
    steps: int
    seconds: float  # this process's training, not the earlier ones it resumed
    loss: float | None  # the mean over every step (a resumed run's earlier ones from metrics.jsonl)
    never_varied: bool  # every group tied at every step (read on rank 0): nothing was learned


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
    from vlmrl.train.resume import ends_training

    say = console_callback
    if resume and (done := _done_already(config, run_dir, say)):
        return done
    started_at = utc_now()
    inputs = _prepare_inputs(config, run_dir, resume=resume, say=say)  # step 1
    if ends_training(inputs.last, config.train.max_steps, run_dir / layout.METRICS,
                     config.train.time_budget_minutes):  # killed after the last checkpoint, before the summary
        return _finish_from(inputs.last, config, run_dir, inputs, started_at=started_at, say=say)
    trackers = _trackers(config, run_dir)
    _note_gspo(config, inputs.notes, say)
    compile_cache = use_compile_cache()  # before anything compiles: the first step's compile, cached across runs
    loaded, model, lora_report = _load_model(config, run_dir)  # step 2
    built = build_trainer(config, run_dir, model=model, loaded=loaded, rewards=inputs.rewards, args=inputs.args,
                          dataset=inputs.dataset, trackers=trackers, say=say, progress=progress)  # step 3
    trained = _run(built, config, run_dir, inputs.last, trackers=trackers, say=say)  # step 4
    final_dir = run_dir / layout.FINAL  # step 5: save
    built.trainer.save_model(str(final_dir))  # every rank: FSDP/ZeRO-3 gather the weights; rank 0 writes them
    summary = _summary(config, inputs, built, trained, loaded=loaded, lora_report=lora_report,
                       compile_cache=compile_cache, started_at=started_at)
    _write_final(config, run_dir, loaded.source, summary,
                 (final_dir, run_dir / layout.CHECKPOINTS, run_dir / layout.BEST))
    return TrainResult(final_dir, summary)


def _done_already(config: Config, run_dir: Path, say: Any) -> TrainResult | None:
    """The finished training of this config in `run_dir` (nothing to do), or None; a damaged final/ is not done."""
    if damage := final_damage(config, run_dir):
        (say or log.warning)(f"train: {run_dir / layout.FINAL} is damaged ({damage}); training is not done: it "
                             "resumes from the last good checkpoint (step 0 if none)")
    if not is_finished(config, run_dir):
        return None
    summary = read_json(run_dir / layout.TRAIN_SUMMARY)
    if say:
        say(f"train: {run_dir} already finished {summary.get('steps')} steps with this config; nothing to do (pass "
            "--no-resume to train again).")
    return TrainResult(run_dir / layout.FINAL, summary, already_done=True)


def _prepare_inputs(config: Config, run_dir: Path, *, resume: bool, say: Any) -> _Inputs:
    """Step 1: the data (train.jsonl as a dataset), the rewards and the trainer's arguments, and the checkpoint to
    resume. A training set too small or not the same on every rank, a broken reward, a bad trl_overrides key or a
    device this TRL cannot train on fails here, before any model loads."""
    dataset = build_train_dataset(run_dir)
    _check_trainable(config, run_dir, len(dataset))
    rewards = check_run_rewards(config, run_dir)  # a broken reward fails here, not mid-run
    if problem := settings_problem(config.train.dynamic_sampling, [r.name for r in rewards]):
        raise TrainError(problem + ".")
    if not resume:
        _start_over(run_dir, say)
    batch = _auto_batch(config, run_dir / layout.TRAIN, len(dataset), say)
    args, notes = build_grpo_config(config, run_dir / layout.CHECKPOINTS,
                                    suppress_tokens=_multimodal_ids(config, run_dir),
                                    batch=batch.per_device_train_batch_size if batch else None)
    _ = args.device  # sets up the process group (several ranks) and pins this rank's GPU before the model loads
    if problem := trl_device_problem(args.device.type, package_version("trl") or "0"):
        raise TrainError(problem)
    _same_file_on_every_rank(run_dir / "data" / "train.jsonl")
    last = _start_point(config, run_dir, resume=resume)
    return _Inputs(dataset, rewards, batch, args, notes, last)


def _start_over(run_dir: Path, say: Any) -> None:
    """--no-resume: rank 0 moves an earlier training aside (vlmrl.train.resume.set_aside)."""
    from vlmrl.train.resume import set_aside

    if distributed.is_main_process() and (moved := set_aside(run_dir)) is not None:
        (say or log.warning)(f"train: starting over; the earlier training was moved aside to {moved}")


def _trackers(config: Config, run_dir: Path) -> list:
    """train.report_to's callbacks, writing under train/ (a tracker that cannot start is a TrainError)."""
    try:
        return build_tracker_callbacks(config.train.report_to, run_dir / layout.TRAIN)
    except TrackerError as exc:
        raise TrainError(str(exc)) from None


def _note_gspo(config: Config, notes: list[str], say: Any) -> None:
    """GSPO's note on its loss type joins `notes`, said once, and TRL's own warning (repeated per trainer) is quieted."""
    if note := gspo_loss_note(config):
        notes.append(note)
        quiet_trl_gspo_warning()  # ours says it once and why; TRL's would repeat it per trainer
        if say is None:  # the CLI says it itself, for the presets that choose it (cli.show.preset_note)
            log.warning(f"note: {note}")


def _load_model(config: Config, run_dir: Path) -> tuple[Any, Any, Any]:
    """Step 2: the base model (its `load_model` result), it wrapped in LoRA, and the LoRA report; every draw seeded
    from run.seed (the same seed gives the same LoRA initialisation), and disk room for one checkpoint checked."""
    lora.seed_all(config.run.seed)
    loaded = loading.load_model(config.model, run_dir, for_training=True, seed=config.run.seed)
    model, report = lora.apply_lora(loaded.model, config.lora, backend=loaded.backend, seed=config.run.seed)
    try:  # a full disk found at the first save would cost every step before it
        check_disk_space(run_dir / layout.CHECKPOINTS, checkpoint_bytes(report.trainable_params), what="one checkpoint")
    except DiskSpaceError as exc:
        raise TrainError(str(exc)) from None
    return loaded, model, report


def _run(built: BuiltTrainer, config: Config, run_dir: Path, last: Path | None, *, trackers: list, say: Any) -> _Trained:
    """Step 4: TRL's training loop, resumed from `last` when given. A step that diverged, or a health monitor
    that halted training, is a TrainError."""
    from vlmrl.train.callbacks import divergence_line, nothing_learned_line, reward_never_varied
    from vlmrl.train.resume import ResumeError

    trainer = built.trainer
    start_step = int(last.name.split("-")[-1]) if last else 0
    resume_trackers(trackers, start_step)  # TensorBoard hides what it plotted past that step
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
    if built.health.halted:
        raise TrainError(f"training stopped at step {trainer.state.global_step}: {built.health.halted} "
                         f"(checkpoints under {run_dir / layout.CHECKPOINTS}; see {run_dir / layout.HEALTH}).")
    if built.budget is not None and built.budget.stopped_at is not None and distributed.is_main_process():
        (say or log.warning)(f"train: stopped at step {built.budget.stopped_at} of {trainer.state.max_steps}: "
                             f"train.time_budget_minutes={config.train.time_budget_minutes:g} spent (checkpoint saved)")
    never_varied = distributed.is_main_process() and reward_never_varied(run_dir / layout.HEALTH)
    if never_varied:
        (say or log.warning)(nothing_learned_line(config.contract))
    steps = trainer.state.global_step
    # resumed: TRL's figure covers only this process's steps; metrics.jsonl holds them all
    resumed_loss = total_train_loss(run_dir / layout.METRICS, steps) if start_step else None
    loss = output.training_loss if resumed_loss is None else resumed_loss
    return _Trained(start_step, steps, seconds, loss, never_varied)


def _summary(config: Config, inputs: _Inputs, built: BuiltTrainer, trained: _Trained, *, loaded: Any,
             lora_report: Any, compile_cache: Any, started_at: str) -> dict:
    """train/summary.json of a training that ran (`_finish_from` writes the one of a training found done)."""
    return {
        **_summary_head(config, inputs.args),
        "steps": trained.steps,
        "resumed_from_step": trained.start_step,
        "train_seconds": round(trained.seconds, 2),
        "train_loss": trained.loss,
        "train_items": len(inputs.dataset),
        "world_size": distributed.world_size(),  # processes of all hosts: a generation batch is this many per-device ones
        "lora": lora_report.as_dict(),
        "backend": loaded.backend,
        "base_model": loaded.source,
        "notes": inputs.notes,
        "health_warnings": built.health.warning_count,
        "reward_never_varied": trained.never_varied,  # every group tied at every step: the adapter is its initialisation
        "stopped_by": "time_budget" if built.budget and built.budget.stopped_at is not None else None,
        **built.engine.as_dict(),  # fast_generation, loss_pass, rollout_correction, dynamic_sampling
        "recompile_limit_hits": trainer_hits(built.trainer),  # where rollouts decoded eagerly: dynamo gave up
        "compile_cache": compile_cache.as_dict(),
        "auto_batch": inputs.batch.as_dict() if inputs.batch else None,
        "report_to": list(config.train.report_to),
        "validation": built.validation.summary() if built.validation else None,
        "provenance": provenance(started_at=started_at, finished_at=utc_now()),
    }


def _write_final(config: Config, run_dir: Path, source: str, summary: dict, folders: tuple[Path, ...]) -> None:
    """Rank 0 makes `folders` readable as the umask says (the adapter weights arrive 0600 from safetensors) and
    writes final/'s base record and the summary; no rank returns (and maybe starts evaluating) before that."""
    if distributed.is_main_process():
        for folder in folders:
            if folder.is_dir():
                match_umask(folder)
        write_json_atomic(run_dir / layout.FINAL / BASE_RECORD, base_identity(config.model.name, source))
        write_json_atomic(run_dir / layout.TRAIN_SUMMARY, summary)
    distributed.barrier()


def _finish_from(checkpoint: Path, config: Config, run_dir: Path, inputs: _Inputs, *, started_at: str,
                 say: Any) -> TrainResult:
    """The training whose last checkpoint is `checkpoint` is done: `final/` from it and the summary, no step
    trained. The summary says what the files tell without loading the model (the steps, the loss from
    metrics.jsonl, the adapter's size); what only the trainer measured (fast_generation, loss_pass) is absent."""
    from vlmrl.train.callbacks import reward_never_varied
    from vlmrl.train.resume import ResumeError, checkpoint_step, final_from_checkpoint

    step = checkpoint_step(checkpoint)
    final_dir = run_dir / layout.FINAL
    budget = not 0 < config.train.max_steps <= step  # ends_training: then the checkpoint is past the time budget
    limit = (f"train.time_budget_minutes={config.train.time_budget_minutes:g}" if budget
             else f"train.max_steps={config.train.max_steps}")
    (say or log.warning)(f"train: {checkpoint.name} is the last step ({limit}): training was done; saving it as "
                         f"{final_dir} and writing the summary, training nothing")
    source = loading.resolve_model_source(config.model.name, run_dir, config.run.seed)
    summary = {
        **_summary_head(config, inputs.args),
        "steps": step,
        "resumed_from_step": step,
        "finished_from_checkpoint": checkpoint.name,
        "train_seconds": 0.0,
        "train_loss": total_train_loss(run_dir / layout.METRICS, step),
        "train_items": len(inputs.dataset),
        "world_size": distributed.world_size(),
        "lora": _adapter_size(checkpoint),
        "backend": None,
        "base_model": source,
        "notes": inputs.notes,
        "health_warnings": sum(len(r.get("warnings") or []) for r in read_jsonl(run_dir / layout.HEALTH)),
        "reward_never_varied": reward_never_varied(run_dir / layout.HEALTH),
        "stopped_by": "time_budget" if budget else None,
        "report_to": list(config.train.report_to),
        "provenance": provenance(started_at=started_at, finished_at=utc_now()),
    }
    if distributed.is_main_process():
        try:
            final_from_checkpoint(checkpoint, final_dir)
        except ResumeError as exc:
            raise TrainError(str(exc)) from None
    _write_final(config, run_dir, source, summary, (final_dir,))
    return TrainResult(final_dir, summary)


def _adapter_size(folder: Path) -> dict:
    """The LoRA counts an adapter's safetensors header gives: its parameters (all of them train) and modules."""
    with (folder / loading.ADAPTER_WEIGHTS).open("rb") as f:
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


def _multimodal_ids(config: Config, run_dir: Path) -> list[int]:
    """The base model's image/video token ids, which rollouts suppress (`loading.multimodal_token_ids`)."""
    from transformers import AutoConfig

    source = loading.resolve_model_source(config.model.name, run_dir, config.run.seed)
    return loading.multimodal_token_ids(AutoConfig.from_pretrained(source))


def final_damage(config: Config, run_dir: Path) -> str | None:
    """Why this config's finished training's `final/` cannot be trusted (None: it can, or there is none)."""
    return loading.adapter_files_problem(run_dir / layout.FINAL) if layout.is_trained(config, run_dir) else None


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
