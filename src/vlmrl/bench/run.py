"""One bench path measured (`run_path`), and the whole benchmark (`run_bench`): every path, then the summary.

Each path builds the shaped model afresh, trains it with TRL's `GRPOTrainer` (vlmrl's paths after
`vlmrl.engine.rollout.fast.enable_fast_generation` and `vlmrl.engine.loss.loss_pass.enable_loss_pass`), and records wall
time per optimizer step, generation time inside it and the peak GPU memory of rollouts and of the rest
(`StepClock`). One path failing records its error and leaves the others' numbers. The unsloth path runs in a
process of its own (`unsloth_path`) through the same `train_and_measure`.

`VARIANTS` is empty in the product: it is the one hook for engine variants. Benchmark plugins (benchmarks/variants/,
through benchmarks/engine_variants.py) register paths there, each a callable that sets up the engine on the built
trainer in place of `vlmrl_engine`, changing it from outside, then run the same CLI. Left out: the model and data
(`shaped`), the figures and tables (`summary`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from vlmrl.bench.comm import CommProfile
from vlmrl.bench.floors import measure_ceilings
from vlmrl.bench.ragged import force_lengths
from vlmrl.bench.shaped import (
    GIB,
    LORA_TARGETS,
    PATHS,
    BenchSettings,
    batching,
    bench_dataset,
    build_processor,
    build_shaped_model,
    free_memory,
    load_shapes,
    save_weights_once,
)
from vlmrl.bench.summary import markdown_table, summarize
from vlmrl.bench.unsloth_path import UNSLOTH_PATHS, run_unsloth
from vlmrl.common import distributed
from vlmrl.common.io import strict_json
from vlmrl.engine.rollout.compile_cache import use_compile_cache

log = logging.getLogger(__name__)


def vlmrl_engine(trainer: Any, settings: BenchSettings) -> tuple[Any, Any]:
    """The `vlmrl` path's engine on a built trainer, as `vlmrl train` sets it up by default; returns the rollout's
    and the loss pass's records (`FastGeneration`, `LossPass`)."""
    from vlmrl.engine.loss.loss_pass import enable_loss_pass
    from vlmrl.engine.rollout.fast import enable_fast_generation

    return enable_fast_generation(trainer, bucket=settings.prompt_bucket), enable_loss_pass(trainer)


# Engine variants: path name -> a callable (trainer, settings) -> (rollout record, loss-pass record), each record
# with `as_dict()`, run in place of `vlmrl_engine`. Empty unless a benchmark plugin registers some.
VARIANTS: dict[str, Callable[[Any, BenchSettings], tuple[Any, Any]]] = {}


def path_names() -> tuple[str, ...]:
    """The paths a bench can run here: `PATHS`, then the registered variants."""
    return (*PATHS, *VARIANTS)


class StepClock:
    """Wall time per optimizer step and generation time inside it (TRL generates once per step here), and the
    peak GPU memory of each phase: rollouts (inside `generate`) and everything else (loss pass, optimizer)."""

    def __init__(self):
        self.steps: list[dict] = []
        self._start = 0.0
        self._gen = 0.0
        self._lengths: list[list[int]] = []  # this step's rollouts: each completion's length (its end token included)
        self.generation_peaks: list[int] = []  # bytes, per generate call: is the first (compiling) call special?
        self.other_peak = 0
        self.reserved_peak = 0  # the allocator's own peak, kept across the per-phase resets

    def callback(self) -> Any:
        from transformers import TrainerCallback

        clock = self

        class Clock(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                # the model as the strategy holds it from here (FSDP / DeepSpeed shard or wrap it just before),
                # not the whole model each rank built first
                clock.take_peak()

            def on_step_begin(self, args, state, control, **kwargs):
                _sync()
                clock._start, clock._gen, clock._lengths = time.perf_counter(), 0.0, []

            def on_step_end(self, args, state, control, **kwargs):
                _sync()
                clock.steps.append({"seconds": time.perf_counter() - clock._start, "generate_seconds": clock._gen,
                                    "rollout_lengths": clock._lengths})

        return Clock()

    def wrap_generation(self, trainer: Any) -> None:
        inner = trainer._generate_single_turn

        def timed(*args, **kwargs):
            _sync()
            self.other_peak = max(self.other_peak, self.take_peak())
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            _sync()
            self._gen += time.perf_counter() - start
            self.generation_peaks.append(self.take_peak())
            self._lengths.append([len(ids) for ids in out[0]])  # TRL's (completion_ids, logprobs)
            return out

        trainer._generate_single_turn = timed

    def take_peak(self) -> int:
        """Allocated-memory peak since the last call (bytes), then start a new phase; 0 without CUDA."""
        if not torch.cuda.is_available():  # the CPU tests of the unsloth process's wiring
            return 0
        peak = torch.cuda.max_memory_allocated()
        self.reserved_peak = max(self.reserved_peak, torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()
        return peak


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_path(path: str, settings: BenchSettings, shapes: dict, processor_dir: Path, dataset: Any, work: Path) -> dict:
    from peft import LoraConfig
    from transformers import AutoProcessor

    free_memory()
    model = build_shaped_model(shapes, processor_dir, load_in_4bit=settings.load_in_4bit, work=work,
                               dtype=getattr(torch, settings.dtype))
    processor = AutoProcessor.from_pretrained(str(processor_dir))
    peft_config = LoraConfig(r=settings.lora_r, lora_alpha=settings.lora_r, task_type="CAUSAL_LM",
                             target_modules=LORA_TARGETS)
    return train_and_measure(path, settings, model, processor, dataset, work, peft_config=peft_config)


def varied_reward(completions: list, **_: Any) -> list[float]:
    """A reward that differs between completions and means nothing: the first 32 bits of each completion text's
    SHA-256 as a fraction of 2**32 (deterministic, in [0, 1)). `vlmrl bench --varied-reward` adds it so that a
    random-weight model's groups have non-zero advantages, hence real gradients."""
    texts = [c if isinstance(c, str) else json.dumps(c, sort_keys=True) for c in completions]
    return [int(hashlib.sha256(t.encode()).hexdigest()[:8], 16) / 2**32 for t in texts]


def train_and_measure(path: str, settings: BenchSettings, model: Any, processor: Any, dataset: Any, work: Path, *,
                      peft_config: Any) -> dict:
    """Train `model` with TRL's GRPOTrainer under the step clock (the seed recipe's GRPOConfig) and return the
    path's record. `peft_config` None: the model already carries its adapter (the unsloth path's)."""
    # In the unsloth process this import follows `import unsloth`, so it is Unsloth's patched trainer.
    from trl import GRPOConfig, GRPOTrainer

    from vlmrl.engine.precision import float32_adapters_for_fp16
    from vlmrl.engine.recompiles import recompile_limit_hits
    from vlmrl.engine.rollout.mismatch import enable_rollout_mismatch, step_rows
    from vlmrl.engine.rollout.sharded import gather_root_in_rollouts
    from vlmrl.grading.rewards import correctness_reward, format_reward
    from vlmrl.models.loading import multimodal_token_ids

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()  # the peak of training, not of building the random model
    # TRL re-processes prompts for the loss with the processor's own padding side but pads prompt ids on the
    # left; with right padding and prompts of different lengths the image-token mask is shifted and Qwen's
    # rope index crashes (TRL 1.16). vlmrl's loader always sets left; the plain path needs it to run at all.
    processor.tokenizer.padding_side = "left"
    micro, accumulation = batching(asdict(settings))
    args = GRPOConfig(
        output_dir=str(work / f"out-{path}"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=settings.steps_per_generation,
        num_generations=settings.generations,
        max_completion_length=settings.completion,
        # Full-length completions (or ragged ones, `vlmrl.bench.ragged`); and no image/video delimiter tokens,
        # which a random-weight model samples (TRL suppresses only the image token; a stray <|vision_start|>
        # crashes the next forward pass).
        generation_kwargs={**({} if settings.ragged_median else {"min_new_tokens": settings.completion}),
                           "suppress_tokens": multimodal_token_ids(model.config)},
        importance_sampling_level="sequence" if settings.algorithm == "gspo" else "token",
        loss_type="dr_grpo",
        learning_rate=5e-6,
        max_grad_norm=0.1,
        max_steps=path_steps(settings, path) + (1 if settings.comm_profile else 0),  # the profiled step
        gradient_checkpointing=True,
        bf16=torch.cuda.is_available() and settings.dtype == "bfloat16",
        fp16=torch.cuda.is_available() and settings.dtype == "float16",  # accelerate's loss scaling
        use_cpu=not torch.cuda.is_available(),
        optim="adamw_8bit" if settings.load_in_4bit else "adamw_torch",
        reward_weights=[0.3, 1.0, 1.0] if settings.varied_reward else [0.3, 1.0],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    clock = StepClock()
    comm = CommProfile(path_steps(settings, path)) if settings.comm_profile else None
    rewards = [format_reward, correctness_reward, *([varied_reward] if settings.varied_reward else [])]
    trainer = GRPOTrainer(model=model, reward_funcs=rewards, args=args,
                          train_dataset=dataset, processing_class=processor, peft_config=peft_config,
                          callbacks=[clock.callback(), *([comm.callback()] if comm else [])])
    gather_root_in_rollouts(trainer)  # FSDP: TRL's rollouts bypass the root unit (vlmrl.engine.rollout.sharded)
    float32_adapters_for_fp16(trainer)  # fp16: TRL's bf16 QLoRA adapters would stop the loss scaler (every path)
    fast = loss_pass = None  # plain: TRL as a user writes it
    if path == "vlmrl" or path in VARIANTS:
        fast, loss_pass = VARIANTS.get(path, vlmrl_engine)(trainer, settings)
    # the sampler's log-probs against the loss pass's at every step, measured only (the loss stays TRL's)
    mismatch = enable_rollout_mismatch(trainer, correction="none") if path not in UNSLOTH_PATHS else None
    if settings.ragged_median:  # after the mismatch's recorder: it sees the logits before the forcing
        force_lengths(trainer, settings.ragged_median, settings.completion)
    clock.wrap_generation(trainer)
    started = time.perf_counter()
    error = None
    try:
        with recompile_limit_hits() as gave_up:  # a function dynamo stopped compiling ran eagerly after that
            trainer.train()
    except Exception as exc:  # one path failing must not hide the other's numbers
        error = f"{type(exc).__name__}: {exc}"[:2000]
        log.exception("bench path %s failed", path)
    if comm and len(clock.steps) > comm.step:
        clock.steps[comm.step]["profiled"] = True  # left out of the step times (vlmrl.bench.summary)
    other_peak = max(clock.other_peak, clock.take_peak())
    generation_peak = max(clock.generation_peaks, default=0)
    peak = max(generation_peak, other_peak) / GIB
    result = {
        "path": path,
        "error": error,
        "fast_generation": fast.as_dict() if fast else None,
        "loss_pass": loss_pass.as_dict() if loss_pass else None,
        "total_seconds": time.perf_counter() - started,
        "steps": clock.steps,
        "peak_memory_gib": peak,
        "generation_peak_gib": generation_peak / GIB,
        "generation_peaks_gib": [round(p / GIB, 3) for p in clock.generation_peaks],
        "training_peak_gib": other_peak / GIB,
        "peak_reserved_gib": clock.reserved_peak / GIB,
        "world_size": distributed.world_size(),
        "peak_memory_gib_per_rank": _gather(peak),
        "communication_per_rank": _gather(comm.figures) if comm else None,  # vlmrl.bench.comm, one per rank
        "log": [row for row in trainer.state.log_history if "loss" in row],
        # LoRA layers trained: the unsloth path names its targets its own way, so the table shows they match
        "lora_modules": sum(1 for name, _ in trainer.model.named_modules() if name.endswith(".lora_A")),
        "rollout_mismatch": step_rows(trainer.state.log_history) if mismatch else None,  # per optimizer step
        "recompile_limit_hits": [asdict(hit) for hit in gave_up],
    }
    del trainer, model
    free_memory()
    return result


def path_steps(settings: BenchSettings, path: str) -> int:
    """Optimizer steps a path runs: `steps`, or `steps_plain` for plain TRL when given."""
    return settings.steps_plain if path == "plain" and settings.steps_plain else settings.steps


def _gather(value: float) -> list[float]:
    """One value per rank (a one-element list in a single process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def run_bench(settings: BenchSettings, out_dir: Path, work: Path) -> dict:
    """Run each path; under `accelerate launch` every rank runs it on its own GPU and rank 0 writes."""
    compile_cache, work = prepare_device(settings, work, cap=False)
    shapes = load_shapes(settings.shapes)
    ceilings = measure_ceilings()
    processor_dir = build_processor(work, settings.image_size)
    if settings.load_in_4bit:  # the random 16-bit weights, made and saved before the cap (a small card's cap
        save_weights_once(shapes, processor_dir, work)  # is below their size); every 4-bit path reloads them
    cap_memory(settings)
    dataset = bench_dataset(settings)
    results = []
    for path in settings.paths:
        if path in UNSLOTH_PATHS:  # its own interpreter: this one has imported transformers, TRL and PEFT
            results.append(run_unsloth(settings, save_weights_once(shapes, processor_dir, work), work))
        else:
            results.append(run_path(path, settings, shapes, processor_dir, dataset, work))
        if distributed.is_main_process():  # a run stopped by a time limit still leaves the paths it finished
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "bench.partial.json").write_text(strict_json(results, indent=2))
    prompt_tokens = prompt_tokens_of(processor_dir, dataset)
    summary = summarize(settings, shapes, ceilings, results, prompt_tokens)
    summary["compile_cache"] = compile_cache.as_dict()  # was the first step's compile served from disk?
    if distributed.is_main_process():
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "bench.json").write_text(strict_json(summary, indent=2))
        (out_dir / "bench.md").write_text(markdown_table(summary))
    return summary


def prepare_device(settings: BenchSettings, work: Path, *, cap: bool = True) -> tuple[Any, Path]:
    """This rank's GPU, its memory cap (`cap`; else `cap_memory` later) and the compile cache, before anything
    is built; and its work folder."""
    import os

    if not torch.cuda.is_available():
        raise RuntimeError("vlmrl bench needs a CUDA GPU; the CPU tests cover its bookkeeping only.")
    compile_cache = use_compile_cache(Path(settings.compile_cache) if settings.compile_cache else None)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    if distributed.world_size() > 1:
        work = work / f"rank{distributed.rank()}"  # no two ranks write the same processor or weight files
    if cap:
        cap_memory(settings)
    return compile_cache, work


def cap_memory(settings: BenchSettings) -> None:
    """This process's GPU memory cap (`--memory-cap-gib`), if any."""
    if settings.memory_cap_gib:
        device = torch.cuda.current_device()
        total = torch.cuda.get_device_properties(device).total_memory / GIB
        torch.cuda.set_per_process_memory_fraction(min(1.0, settings.memory_cap_gib / total), device)


def prompt_tokens_of(processor_dir: Path, dataset: Any) -> int:
    from transformers import AutoProcessor

    from vlmrl.engine.rollout.generation import count_prompt_tokens

    processor = AutoProcessor.from_pretrained(str(processor_dir))
    row = dataset[0]
    return count_prompt_tokens(processor, row["prompt"][0]["content"], row["image"])
