"""Typed configuration: one YAML file, one section per stage, every field documented once, here.

A config is loaded from a preset shipped in ``vlmrl/presets/`` (``demo``, ``seed``, ``gspo-paper``) or a
YAML file, then command-line overrides (``--set train.learning_rate=1e-5``) are applied, then the whole
thing is validated. Validation happens before any model loads: unknown keys are named with the closest
valid key, and cross-field contradictions say how to fix them. The top-level `rewards:` list names the
rewards and their weights; a user function's file is resolved against the config file's folder here, at load
time (importing and checking it is `vlmrl.grading.user_rewards`).

This module holds the schema (the sections, their fields and cross-field checks, the fingerprints) and the
entry points `load_config`, `validate_config`, `dump_config`; reading presets and YAML, applying overrides,
refusing replaced fields and wording the errors is `vlmrl.config.load`, re-exported names included
(`PRESETS`, `ConfigError`).

Deliberately left out: a mirror of all of ``GRPOConfig``. ``train.trl_overrides`` passes anything else
straight to TRL.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from vlmrl.config.load import (
    PRESETS,  # noqa: F401 (re-exported: `from vlmrl.config.schema import PRESETS`)
    ConfigError,
    apply_override,
    describe_errors,
    read_source,
    refuse_reward_weights,
)

TRACKERS = ("tensorboard", "wandb", "trackio", "none")
# Fields that only change how a run is watched or how fast it runs, not what it produces: left out of every
# fingerprint, so a run resumes (and a finished stage stays done) under another tracker or trim setting. Trim,
# grouping, the filled-cache window and the decode kernel change float summation order only (grouping also how TRL
# averages its per-micro-batch metrics).
OBSERVATION_FIELDS = {"train": ("report_to", "trim_padding", "group_by_length", "rollout_filled_window",
                                "rollout_decode_kernel", "rollout_stacked", "rollout_stacked_kernel", "rollout_guards",
                                "loss_kernels")}


class _Section(BaseModel):
    # inf/nan pass `gt=0` checks (a learning rate of .inf is "positive") and fail only hours later
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _exact_in_float_fields(cls, value: Any, info: Any) -> Any:
        """An integer given to a float field arrives unchanged or is refused: pydantic would store 2**53 + 1 as
        2**53 (found by tests/test_fuzz_config.py)."""
        if isinstance(value, int) and not isinstance(value, bool) and _takes_float(cls.model_fields[info.field_name]):
            try:
                exact = float(value) == value
            except OverflowError:
                exact = False
            if not exact:
                raise ValueError(f"{value} has no exact floating-point value; write the number you mean as a float")
        return value


def _takes_float(field: Any) -> bool:
    """True when a field's type is float, alone or in a union (float | None)."""
    annotation = field.annotation
    return annotation is float or float in get_args(annotation)


class RunConfig(_Section):
    name: str = Field("demo", description="Run name; artifacts land in `<output_dir>/<name>/`.")
    output_dir: str = Field("runs", description="Parent folder of run directories.")
    seed: int = Field(0, description="Seed for data splits, sampling and training.")


class ModelConfig(_Section):
    name: str = Field(
        "tiny:qwen3_vl",
        description="Hub id, local folder, or `tiny:<arch>` (an offline random-weight model built into the run, "
        "arch in qwen3_vl|qwen2_5_vl|gemma3), or `demo-policy` (the project's small warm-started policy).",
    )
    backend: Literal["auto", "unsloth", "transformers"] = Field(
        "auto", description="`auto`: Unsloth FastVisionModel when installed and CUDA is present, else transformers."
    )
    load_in_4bit: bool = Field(False, description="bitsandbytes nf4 base weights (CUDA, or CPU with bitsandbytes >= 0.48).")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Weight dtype; `auto` is bfloat16 on CUDA and float32 on CPU."
    )
    attn_implementation: Literal["auto", "eager", "sdpa", "flash_attention_2"] = Field(
        "auto", description="Attention kernel; `auto` lets transformers choose (sdpa where supported)."
    )
    max_seq_length: int = Field(
        16384, gt=0, le=262_144, description="Longest sequence (image tokens + prompt + completion) the model must hold."
    )


class LoraConfig(_Section):
    r: int = Field(16, gt=0, le=1024, description="LoRA rank; higher adds capacity and memory.")
    alpha: int = Field(16, gt=0, le=65_536, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    attention: bool = Field(True, description="Adapt the language model's attention projections.")
    mlp: bool = Field(True, description="Adapt the language model's MLP projections.")
    vision: bool = Field(
        False,
        description="Also adapt the vision tower. Off by default: the task is reasoning about what the model sees, "
        "and vLLM's LoRA cannot serve vision layers.",
    )


class DataConfig(_Section):
    source: str = Field(
        "synthetic",
        description="`synthetic` (built-in procedural visual math), a hub id (`AI4Math/MathVista`), "
        "or a local Parquet/JSONL/CSV file, imagefolder or save_to_disk folder.",
    )
    split: str = Field("testmini", description="Dataset split for hub or folder sources.")
    answer_types: list[Literal["integer", "float", "choice", "expression", "text"]] = Field(
        ["integer", "float"],
        description="Answer types kept (graded by `vlmrl.grading.grader.grade`, docs/rewards.md); MathVista's free-form "
        "items are integer or float, so the default keeps its free-form numeric items.",
    )
    include_multi_choice: bool = Field(
        False, description="Also keep MathVista's multiple-choice items, as answer type `choice` with their choices."
    )
    answer_type: Literal["integer", "float", "choice", "expression", "text"] | None = Field(
        None,
        description="Answer type of mapped rows without an `answer_type` cell; unset: read off the gold "
        "(a number is integer/float, one of the row's choices is choice, else text). See docs/data.md.",
    )
    prompt_field: Literal["question", "query"] = Field(
        "question",
        description="`question` as the write-up does, or MathVista's `query` (which carries hints, units, choices).",
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="Column mapping for other datasets: keys id, question, answer, image, images, choices, "
        "answer_type, precision, unit (docs/data.md).",
    )
    # 28: one merged vision patch of Qwen-VL; 4096: a 4096^2 RGB image is 48 MiB before the processor copies it
    image_size: int = Field(512, ge=28, le=4096, description="Side of the normalised image (squash/fit policies).")
    resize: Literal["squash", "fit", "max_pixels"] = Field(
        "squash",
        description="`squash` to image_size x image_size ignoring aspect (the write-up's choice), `fit` keeps aspect "
        "and pads, `max_pixels` only shrinks to at most image_size^2 pixels.",
    )
    holdout_size: int = Field(100, gt=0, le=100_000, description="Held-out items for baseline/after evaluation.")
    max_prompt_tokens: int = Field(
        2048, gt=0, le=262_144, description="Prompts longer than this (image tokens included) are dropped with the reason."
    )
    num_synthetic: int = Field(400, gt=0, le=1_000_000, description="Items generated when source is `synthetic`.")
    difficulty: int = Field(1, ge=1, le=3, description="Synthetic difficulty: 1 easy .. 3 hard.")
    families: list[str] = Field(
        default_factory=list, description="Synthetic families to draw from; empty means the first data version's 20 "
        "(vlmrl.data.synthetic.DEFAULT_FAMILIES); bar_tallest and polygon_sides are drawn only when named."
    )
    max_items: int | None = Field(None, gt=0, le=10_000_000, description="Cap on source rows read (for quick runs).")


class EvalConfig(_Section):
    batch_size: int = Field(8, gt=0, le=4096, description="Held-out items generated together.")
    max_new_tokens: int = Field(1024, gt=0, le=131_072, description="Completion token limit for evaluation.")
    do_sample: bool = Field(False, description="Greedy by default so before/after differ only by the weights.")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature when do_sample.")
    num_samples: int = Field(1, gt=0, le=256, description="Samples per item when do_sample (gives pass@k, majority vote).")
    compile: Literal["auto", "always", "never"] = Field(
        "auto", description="Static KV cache + torch.compile decode; `auto` turns it on for CUDA only."
    )
    visual_control: bool = Field(
        False,
        description="Also evaluate the held-out set with each item's image swapped for another item's (same family), "
        "before and after training, and report the visual gain (vlmrl.evaluate.visual_control).",
    )


class TrainConfig(_Section):
    algorithm: Literal["grpo", "gspo"] = Field(
        "gspo", description="`gspo` = sequence-level importance ratio (arXiv:2507.18671); `grpo` = token level."
    )
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo"] = Field("dr_grpo", description="TRL loss aggregation.")
    learning_rate: float = Field(5e-6, gt=0.0, description="Peak learning rate of the LoRA parameters.")
    lr_scheduler_type: str = Field("cosine", description="transformers scheduler name.")
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0, description="Fraction of steps spent warming up.")
    optim: str = Field(
        "adamw_8bit",
        description="Optimizer; `adamw_8bit` needs bitsandbytes on CUDA and falls back to `adamw_torch` otherwise "
        "(the fallback is logged).",
    )
    per_device_train_batch_size: int = Field(8, gt=0, le=4096, description="Completions per device per micro-step.")
    gradient_accumulation_steps: int = Field(4, gt=0, le=4096, description="Micro-steps per optimizer step.")
    num_generations: int = Field(4, ge=2, le=1024, description="Completions sampled per prompt (the GRPO group).")
    steps_per_generation: int | None = Field(
        None, gt=0, le=4096, description="Optimizer micro-steps per generation batch; None = gradient_accumulation_steps."
    )
    num_iterations: int = Field(1, gt=0, le=1024, description="Policy updates per generation batch (mu in the papers).")
    max_completion_length: int = Field(1024, gt=0, le=131_072, description="Completion token limit during training.")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature of rollouts.")
    epsilon: float = Field(0.2, gt=0.0, description="Lower clip range of the importance ratio.")
    epsilon_high: float | None = Field(None, gt=0.0, description="Upper clip range; None = epsilon.")
    beta: float = Field(0.0, ge=0.0, description="KL coefficient (0 skips the reference model).")
    num_train_epochs: float = Field(1.0, gt=0.0, description="Passes over the training set.")
    max_steps: int = Field(-1, description="Optimizer steps (>= 1); -1 = derived from num_train_epochs.")
    max_grad_norm: float = Field(0.1, gt=0.0, description="Gradient clipping norm.")
    mask_truncated_completions: bool = Field(False, description="Exclude truncated completions from the loss.")
    gradient_checkpointing: bool = Field(True, description="Trade compute for activation memory.")
    logging_steps: int = Field(1, gt=0, description="Log every N optimizer steps.")
    save_steps: int = Field(50, gt=0, description="Checkpoint every N optimizer steps.")
    save_total_limit: int = Field(2, gt=0, le=1000, description="Checkpoints kept on disk.")
    generation_backend: Literal["hf", "vllm"] = Field("hf", description="Rollout engine; vLLM when installed.")
    fast_generation: Literal["auto", "always", "never"] = Field(
        "auto",
        description="Static KV cache + torch.compile for rollouts inside TRL's trainer (vlmrl.engine.rollout.fast); `auto` is "
        "on for CUDA only.",
    )
    prompt_bucket: int = Field(
        64, gt=0, le=65_536,
        description="The rollout KV cache length is rounded up to a multiple of this, so compiled decoding sees few "
        "shapes (prompts are not padded).",
    )
    auto_batch: bool = Field(
        False,
        description="On a CUDA GPU, replace per_device_train_batch_size by the largest multiple of num_generations "
        "whose predicted peak memory (vlmrl.run.preflight, prompts at data.max_prompt_tokens) fits 92% of the card, "
        "capped by the training set; logged and recorded in train/auto_batch.json. A bigger batch means more "
        "prompts per optimizer step (and fewer steps per epoch). No change on the CPU.",
    )
    rollout_merge: bool = Field(
        False,
        description="With fast generation, merge the LoRA adapter into the base weights for each rollout and restore "
        "them exactly from a pinned host copy (vlmrl.engine.rollout.merge): faster decoding, but adapter deltas below half a bf16 "
        "step of their weight are lost in rollouts; skipped for 4-bit bases, DoRA/variants and FSDP/ZeRO.",
    )
    rollout_adapter_copies: bool = Field(
        True,
        description="With fast generation and float32 LoRA weights over a bf16 base, rollouts read bf16 copies of the "
        "adapter weights made when each rollout starts (vlmrl.engine.rollout.adapter_cast) instead of casting them at every "
        "token step: 12.51 -> 11.63 ms per token step for Qwen3-VL-8B on an H200 (outside TRL), the same numerics as the "
        "autocast. The "
        "copies (2 bytes per adapter parameter) exist only during rollouts, while the optimizer state waits on the host "
        "(vlmrl.engine.rollout.offload), so the peak memory does not grow. Not with the adapter merged, nor under FSDP / "
        "DeepSpeed, nor where the stacked projections apply (train.rollout_stacked), which read the adapters themselves.",
    )
    rollout_stacked: bool = Field(
        True,
        description="With fast generation and the adapter not merged: LoRA projections that read the same input "
        "(q/k/v; gate/up; o and down alone) run in rollouts as one matmul for the base weights and the adapters' first "
        "factors, and one for the second factors (block-diagonal): 8 matmuls per layer instead of 21 "
        "(vlmrl.engine.rollout.stacked). The base weights are moved once into stacked tensors (each layer's weight a view "
        "of its rows; the loss pass computes what it did). The same values as the adapter's own forward up to float "
        "summation order. Plain LoRA without dropout over unquantized, unsharded weights (elsewhere the record says "
        "why not, and the adapter copies apply); replaces rollout_adapter_copies. On an H200 in TRL, Qwen3-VL-8B, seed "
        "recipe: 18.1 -> 11.6 ms per token step and 25.4 -> 17.0 s per step beside the copies (15.4 -> 12.5 ms with "
        "the stacked path run first).",
    )
    rollout_stacked_kernel: bool = Field(
        True,
        description="With the stacked projections (train.rollout_stacked): at token steps, each group's second step "
        "(the rank-space inputs times the block-diagonal second factors, scaled, added to the base outputs) runs as "
        "one Triton kernel instead of a small cuBLAS matmul and a sum (vlmrl.engine.rollout.second_factors), rounded where "
        "that path rounds; bf16 only, and where Triton cannot run it, the cuBLAS step with one warning. On an H200 "
        "(Qwen3-VL-8B, seed recipe) a token step's GPU kernels fell from 10.1 to 9.0 ms, and in TRL the record's "
        "token step is 8.5 ms (1.89x its floor; 9.38 ms before, another host).",
    )
    rollout_guards: Literal["every step", "first step"] = Field(
        "every step",
        description="With fast generation: when a rollout's compiled token steps check TorchDynamo's guards. `first "
        "step`: at the first token steps of each generate call, until one compiles nothing; the later ones run under "
        "torch.compiler.set_stance(skip_guard_eval_unsafe=True) (vlmrl.engine.rollout.fast.guards_once), and one that still "
        "needs a new graph runs again checked. On an H200 (Qwen3-VL-8B, seed recipe) the checks' host time fell from "
        "6.15 to 1.30 ms per token step, but in TRL the step did not get faster (9.42 against 9.38 ms): the GPU's work "
        "covers the host's. Off by default: skipping guards is unsafe in general.",
    )
    rollout_filled_window: int = Field(
        0,
        ge=0,
        description="With fast generation and vlmrl_sdpa: each token step's attention reads only the filled "
        "static-cache positions, rounded up to this many (vlmrl.engine.rollout.fast.attend_filled), instead of the whole "
        "cache; 0 reads it all. The same attention up to float summation order. Opt-in: measured on an H200 it saved "
        "0.3 ms of 12.3 per token step (each rollout records one CUDA graph per window).",
    )
    rollout_decode_kernel: bool = Field(
        True,
        description="With fast generation and vlmrl_sdpa on CUDA: each token step's attention runs vlmrl's Triton "
        "kernel (vlmrl.engine.rollout.decode_attention), which reads only the static-cache blocks holding an attended "
        "position (the filled ones), with the cache's shapes unchanged (one CUDA graph). The same attention up to "
        "float summation order. False: PyTorch's SDPA over the whole cache. Compiled evaluation uses the kernel too.",
    )
    loss_kernels: bool = Field(
        True,
        description="On CUDA with liger-kernel installed (Qwen3-VL, Qwen2.5-VL): the language model's RMSNorm, RoPE and "
        "SiLU gate run as Liger's fused Triton kernels wherever the model runs eagerly, i.e. in the loss pass "
        "(vlmrl.engine.loss_kernels); compiled graphs (rollout decode steps) keep the modules' own code, which inductor "
        "fuses. The same functions up to bf16 rounding. False: the modules' own forwards everywhere.",
    )
    adapter_input_cast: bool = Field(
        False,
        description="False: under the trainer's bf16/fp16 autocast, LoRA layers skip PEFT's cast of their input to the "
        "float32 adapter dtype, which autocast undoes at once (vlmrl.engine.adapter_inputs; layers without dropout or DoRA): "
        "the same numbers; on an H200 the seed recipe's loss pass peaked 0.91 GiB lower and took 0.26 s less. True: "
        "PEFT's cast as is.",
    )
    trim_padding: bool = Field(
        True,
        description="The loss pass skips columns that are padding in every row of a micro-batch (vlmrl.engine.loss_pass): "
        "the same log-probs and gradients, less compute; logged as loss_pass/padding_trimmed. False: TRL's pass as is.",
    )
    group_by_length: bool = Field(
        True,
        description="With trim_padding, cut each generation batch into micro-batches of similar completion lengths "
        "(instead of TRL's random ones) so the trim drops more: the same optimizer step, where the loss allows it "
        "(not bnpo, top_entropy_quantile < 1, steps_per_generation not a multiple of the accumulation; says why).",
    )
    report_to: list[Literal["tensorboard", "wandb", "trackio", "none"]] = Field(
        default_factory=list,
        description="Experiment trackers fed during training (TensorBoard event files under train/tensorboard/; "
        "W&B and trackio in offline mode unless WANDB_MODE / TRACKIO_* say otherwise). Not part of the fingerprint: "
        "a run resumes under another tracker. Empty or [none]: records only.",
    )
    eval_every_steps: int | None = Field(
        None, gt=0,
        description="Evaluate a fixed subset of the held-out set (greedy) every N optimizer steps during training; "
        "rows go to train/validation.jsonl and the trackers. None: no validation during training.",
    )
    eval_subset: int = Field(32, gt=0, description="Held-out items (the first N) evaluated during training.")
    trl_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra GRPOConfig fields passed through unchanged (escape hatch); a field vlmrl sets from its "
        "own config (learning_rate, ...) is refused here: set it in its section.",
    )

    @field_validator("max_steps")
    @classmethod
    def _steps(cls, value: int) -> int:
        if value < 1 and value != -1:
            raise ValueError("must be >= 1, or -1 to train for train.num_train_epochs")
        return value

    @field_validator("report_to")
    @classmethod
    def _trackers(cls, value: list[str]) -> list[str]:
        if "none" in value and len(value) > 1:
            raise ValueError("`none` cannot be combined with a tracker")
        return value


class HealthConfig(_Section):
    max_gibberish_rate: float = Field(0.2, ge=0, le=1, description="Warn when more completions are degenerate.")
    min_format_rate: float = Field(0.0, ge=0, le=1, description="Warn when fewer completions follow the format.")
    max_truncation_rate: float = Field(0.5, ge=0, le=1, description="Warn when more completions hit the limit.")
    max_zero_variance_groups: float = Field(
        0.9, ge=0, le=1, description="Warn when more groups have identical rewards (no learning signal)."
    )
    stop_on_gibberish_steps: int | None = Field(
        None, gt=0, description="Stop when the gibberish rate stays above max_gibberish_rate this many steps."
    )


class ExportConfig(_Section):
    merged_16bit: bool = Field(False, description="Also write `merged-16bit/` and verify it against the adapter.")
    merged_4bit: bool = Field(False, description="Also write `merged-4bit/` (nf4 through bitsandbytes, CUDA or CPU).")
    gguf: bool = Field(False, description="Also write `gguf/` with llama.cpp's converter (see docs/export.md).")
    gguf_quantization: Literal["none", "q8_0", "q4_k_m"] = Field(
        "q8_0", description="GGUF weights: none (f16), q8_0 (the converter itself), q4_k_m (needs llama-quantize).")
    llama_cpp_dir: str | None = Field(
        None, description="A llama.cpp folder holding convert_hf_to_gguf.py; default $VLMRL_LLAMA_CPP_DIR, then "
        "vlmrl's cache (filled by `python -m vlmrl.export.gguf fetch`).")
    logits_atol: float = Field(1e-3, gt=0, description="Tolerance for reload-reproduces-logits checks.")
    checkpoint: Literal["last", "best"] = Field(
        "last",
        description="`last`: export the adapter of the final step; `best`: the adapter of the validation step with "
        "the highest checkpoint_metric (needs train.eval_every_steps; kept in train/best/).",
    )
    checkpoint_metric: Literal["accuracy", "mathvista_accuracy", "format_compliance", "total_reward"] = Field(
        "accuracy", description="Validation metric that picks the best checkpoint (higher is better)."
    )


class RewardSpec(_Section):
    """One entry of `rewards:`: a built-in by `name`, or a user function by `function`, with its weight."""

    name: Literal["format", "correctness"] | None = Field(
        None, description="A built-in reward: `format` (format_reward) or `correctness` (correctness_reward)."
    )
    function: str | None = Field(
        None,
        description="A user reward `file.py:name` (the file relative to the config file) or `module.path:name`, "
        "with TRL's signature `fn(prompts, completions, **kwargs) -> list[float | None]`.",
    )
    weight: float = Field(1.0, description="Weight of this reward in the total (GRPOConfig.reward_weights).")
    resolved: str | None = Field(
        None,
        description="Filled in by vlmrl when the config is loaded: the absolute path of a `function:` file, so the "
        "copy of the config in the run folder still finds it.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> RewardSpec:
        if (self.name is None) == (self.function is None):
            raise ValueError("give exactly one of `name:` (format | correctness) or `function:` (file.py:name).")
        if self.function is not None:
            where, sep, attr = self.function.rpartition(":")
            if not sep or not where.strip() or not attr.isidentifier() or "\0" in where:
                raise ValueError(
                    f"function {self.function!r}: expected `file.py:name` or `module.path:name`, e.g. "
                    "my_rewards.py:shortness."
                )
        return self

    @property
    def file(self) -> str | None:
        """The `.py` file part of `function`, or None for a built-in or a module path.

        >>> RewardSpec(function="r/my.py:f").file, RewardSpec(function="pkg.mod:f").file
        ('r/my.py', None)
        """
        where = (self.function or "").rpartition(":")[0]
        return where if where.endswith(".py") else None


def _default_rewards() -> list[RewardSpec]:
    return [RewardSpec(name="format", weight=0.3), RewardSpec(name="correctness", weight=1.0)]


class Config(_Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    rewards: list[RewardSpec] = Field(
        default_factory=_default_rewards,
        description="The rewards GRPO maximises, with weights; default format 0.3 + correctness 1.0.",
        min_length=1,
    )

    @model_validator(mode="after")
    def _check_invariants(self) -> Config:
        t = self.train
        generation_batch = t.per_device_train_batch_size * (t.steps_per_generation or t.gradient_accumulation_steps)
        if generation_batch % t.num_generations:
            raise ValueError(
                f"train: the generation batch (per_device_train_batch_size x steps_per_generation = {generation_batch}) "
                f"is not divisible by num_generations={t.num_generations}; every prompt needs a whole group. "
                f"Change per_device_train_batch_size to a multiple of {t.num_generations}."
            )
        names = [r.name or r.function for r in self.rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"rewards: {sorted({n for n in names if names.count(n) > 1})} listed twice.")
        if t.generation_backend == "vllm" and self.lora.vision:
            raise ValueError(
                "train.generation_backend=vllm with lora.vision=true: vLLM cannot serve LoRA on vision layers. "
                "Set lora.vision=false or train.generation_backend=hf."
            )
        if t.epsilon_high is not None and t.epsilon_high < t.epsilon:
            raise ValueError("train.epsilon_high must be >= train.epsilon (it is the upper clip range).")
        if not (self.lora.attention or self.lora.mlp or self.lora.vision):
            raise ValueError("lora: attention, mlp and vision are all false; nothing would train.")
        if self.export.checkpoint == "best" and not t.eval_every_steps:
            raise ValueError("export.checkpoint=best needs train.eval_every_steps (validation picks the best step).")
        name = self.run.name
        if name in ("", ".", "..") or any(c in name for c in "/\\\0"):
            raise ValueError(
                f"run.name={name!r} is not a plain folder name; the run directory is <output_dir>/<name> and "
                "`--force` deletes it, so it must not be the output folder, its parent or a path. "
                "Put parent folders in run.output_dir."
            )
        return self

    def fingerprint(self, *sections: str) -> str:
        """A short stable hash of the named sections (all when none): used to tell whether a stage's outputs
        were produced by this config."""
        data = self.model_dump(mode="json")
        for section, fields in OBSERVATION_FIELDS.items():
            for name in fields:
                data[section].pop(name, None)
        if sections:
            data = {k: data[k] for k in sections}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    def data_fingerprint(self) -> str:
        """What the prepared data depends on: the data section, the split seed and the model (its processor
        counts prompt tokens). The run's name and folder are left out so a copied run stays valid."""
        section = self.data.model_dump(mode="json")
        if section["answer_type"] is None:  # a field added later: unset, earlier runs keep their fingerprint
            del section["answer_type"]
        data = {"data": section, "seed": self.run.seed, "model": self.model.name}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name


def load_config(source: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a preset name or YAML path (None = `demo`), apply `key.path=value` overrides, validate."""
    source = source or "demo"
    raw, origin = read_source(str(source))
    written = (raw.get("data") or {}).get("source") if isinstance(raw.get("data"), dict) else None
    for item in overrides or []:
        apply_override(raw, item)
    config = validate_config(raw, origin)
    base = Path(origin).parent if Path(origin).is_file() else Path.cwd()
    _resolve_data_source(config, written, base)
    for spec in config.rewards:
        if spec.file is not None and spec.resolved is None:  # a copy in a run folder keeps its resolved path
            try:
                spec.resolved = str((base / spec.file).resolve())
            except (OSError, RuntimeError) as exc:  # a path the OS cannot resolve (too long, a symlink loop)
                raise ConfigError(f"{origin}: rewards: {spec.function!r}: {exc}") from None
    return config


def _resolve_data_source(config: Config, written: Any, base: Path) -> None:
    """A relative `data.source` written in a config file names a path beside that file (as reward files do),
    when one is there; given on the command line, or not found beside the file, it stays as written (relative
    to the current folder, or a hub id)."""
    source = config.data.source
    if not isinstance(written, str) or source != written or source == "synthetic" or Path(source).is_absolute():
        return
    try:
        beside = (base / source).resolve()
        if base != Path.cwd() and beside.exists():
            config.data.source = str(beside)
    except (OSError, RuntimeError):  # unresolvable: prepare reports the path as written
        pass


def validate_config(raw: Any, origin: str = "<config>") -> Config:
    """Validate a parsed mapping, turning pydantic's errors into one readable ConfigError."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{origin}: the top level must be a mapping of sections, got {type(raw).__name__}.")
    refuse_reward_weights(raw, origin)
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(describe_errors(exc, origin, Config)) from None


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)

