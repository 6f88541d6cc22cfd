"""The train section: `TrainConfig` and its `rollout:` sub-section (`RolloutConfig`), with `TRL_DEFAULTS`, the
GRPOConfig fields vlmrl gives a value of its own but leaves to `train.trl_overrides` (`TrainConfig.trl_value` is the
one way to read one). `vlmrl.config.sections` re-exports every name here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, field_validator
from pydantic_core import PydanticCustomError, ValidationError

from vlmrl.config.section_base import _exact_float, _Section

# GRPOConfig fields vlmrl gives a value of its own (TRL's default differs for some: lr_scheduler_type is linear
# there) but leaves to `train.trl_overrides`, under these names; read one with `TrainConfig.trl_value`.
TRL_DEFAULTS = {"logging_steps": 1, "save_total_limit": 2, "mask_truncated_completions": False,
                "lr_scheduler_type": "cosine", "warmup_ratio": 0.0, "epsilon": 0.2, "epsilon_high": None, "beta": 0.0,
                "num_iterations": 1}
# Names TRL knows by another: transformers 5 has no warmup_ratio; its warmup_steps reads a float below 1 as a ratio.
TRL_NAMES = {"warmup_ratio": "warmup_steps"}
# The type and range of the TRL_DEFAULTS entries a user may set, checked in trl_overrides before TRL sees them.
_TRL_CHECKS = {
    "lr_scheduler_type": TypeAdapter(str),  # a transformers scheduler name (vlmrl.train.args checks which)
    "warmup_ratio": TypeAdapter(Annotated[float, Field(ge=0.0, lt=1.0, allow_inf_nan=False)]),  # of all steps
    "num_iterations": TypeAdapter(Annotated[int, Field(gt=0, le=1024)]),  # policy updates per generation batch
    "epsilon": TypeAdapter(Annotated[float, Field(gt=0.0, allow_inf_nan=False)]),  # lower clip of the ratio
    "epsilon_high": TypeAdapter(Annotated[float | None, Field(gt=0.0, allow_inf_nan=False)]),  # upper; None: epsilon
    "beta": TypeAdapter(Annotated[float, Field(ge=0.0, allow_inf_nan=False)]),  # KL coefficient; 0: no reference model
}


class RolloutConfig(_Section):
    """How completions are generated during training (vlmrl.engine). Each piece of the fast path applies where it
    can and falls back by itself where it cannot (a 4-bit base, FSDP, no Triton), and the run records what ran
    (`fast_generation` in train/summary.json). What each piece is worth: benchmarks/NOTES.md."""

    fast: Literal["auto", "always", "never"] = Field(
        "auto",
        description="The fast rollout engine inside TRL's trainer (static KV cache, compiled decoding, stacked LoRA "
        "projections; vlmrl.engine.rollout.fast): `auto` = on a CUDA GPU; `never` = TRL's own generate.",
    )
    prompt_bucket: int = Field(
        64, gt=0, le=65_536,
        description="The fast engine's KV cache length is rounded up to a multiple of this, so compiled decoding sees "
        "few shapes (prompts are not padded). Raise it when prompt lengths vary widely.",
    )
    kernels: bool = Field(
        True,
        description="vlmrl's Triton kernels in rollouts (decode attention, the stacked projections' token step, "
        "each 4-bit projection's LoRA branch inside the nf4 kernel) and Liger's fused kernels in the loss pass, "
        "on CUDA where they apply, with each rollout's token step recorded as one CUDA graph. False: PyTorch's own "
        "operations, the same functions up to float rounding (to rule the kernels out when chasing a numerical "
        "question), token steps on torch.compile's CUDA graph trees.",
    )


class DynamicSamplingConfig(_Section):
    """DAPO-style dynamic sampling (vlmrl.train.dynamic_sampling, docs/rewards.md): groups whose rewards all agree
    train nothing (zero advantages), so they are dropped and more prompts are generated to fill the batch."""

    enabled: bool = Field(
        False,
        description="Drop the groups whose completions all earn the same total reward (and, with accuracy_range, "
        "those outside it), generate extra rounds of prompts drawn from the training set (seeded by run.seed and "
        "the step), and fill each generation batch with the groups kept. Off until measured on your task.",
    )
    max_rounds: int = Field(
        2, ge=0, le=8,
        description="Extra generation rounds per generation batch at most (each one a whole batch of prompts). When "
        "they leave a batch short, it is filled with dropped groups trained with zero advantage, and the step's "
        "`dynamic_sampling/cap_hit` is 1.",
    )
    accuracy_range: tuple[float, float] | None = Field(
        None,
        description="[low, high]: also drop a group whose mean of accuracy_reward (in that reward's own units) lies "
        "outside this closed range (EasyR1's online filtering). None: only agreeing groups are dropped.",
    )
    accuracy_reward: str = Field(
        "correctness_reward",
        description="The reward (its function's name, as in train/metrics.jsonl) whose group mean accuracy_range "
        "tests. The built-in correctness_reward gives 0, 1.5 or 2 per completion; trl.rewards.accuracy_reward 0 or 1.",
    )

    @field_validator("accuracy_range")
    @classmethod
    def _ordered(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        if value is not None and value[0] > value[1]:
            raise ValueError(f"[{value[0]:g}, {value[1]:g}] is empty: write [low, high] with low <= high")
        return value


class TrainConfig(_Section):
    algorithm: Literal["grpo", "gspo"] = Field(
        "gspo", description="`gspo` = sequence-level importance ratio (arXiv:2507.18671); `grpo` = token level."
    )
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo"] = Field("dr_grpo", description="TRL loss aggregation.")
    learning_rate: float = Field(5e-6, gt=0.0, le=1.0, description="Peak learning rate of the LoRA parameters "
                                 "(at most 1.0: LoRA's rates are about 1e-6 to 1e-3, and far above them the adapter "
                                 "blows up in its first step).")
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
    max_completion_length: int = Field(1024, gt=0, le=131_072, description="Completion token limit during training.")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature of rollouts.")
    num_train_epochs: float = Field(1.0, gt=0.0, description="Passes over the training set.")
    max_steps: int = Field(-1, description="Optimizer steps (>= 1); -1 = derived from num_train_epochs.")
    time_budget_minutes: float | None = Field(
        None, gt=0.0,
        description="Stop training at the first optimizer step that ends past this many wall-clock minutes of "
        "training (`elapsed_s` in train/metrics.jsonl, a resumed run's earlier sessions included), saving a "
        "checkpoint there; the summary says `stopped_by: time_budget`. The learning-rate schedule still spans "
        "max_steps. For comparing settings at equal cost (docs/rewards.md). None: no limit.",
    )
    max_grad_norm: float = Field(0.1, gt=0.0, description="Gradient clipping norm.")
    gradient_checkpointing: bool = Field(True, description="Trade compute for activation memory.")
    save_steps: int = Field(50, gt=0, description="Checkpoint every N optimizer steps.")
    auto_batch: bool = Field(
        False,
        description="On a CUDA GPU, replace per_device_train_batch_size by the largest multiple of num_generations "
        "whose predicted peak memory (vlmrl.preflight.memory, prompts at data.max_prompt_tokens) fits 92% of the card, "
        "capped by the training set; logged and recorded in train/auto_batch.json. A bigger batch means more "
        "prompts per optimizer step (and fewer steps per epoch). No change on the CPU.",
    )
    rollout: RolloutConfig = Field(
        default_factory=lambda: RolloutConfig(),
        description="How completions are generated during training: vlmrl's fast rollout engine and its kernels "
        "(docs/rollouts.md, docs/speed.md).",
    )
    rollout_correction: Literal["auto", "none", "tis"] = Field(
        "auto",
        description="Correct the loss for the gap between the rollout's sampling distribution and the loss pass's "
        "(vlmrl.engine.rollout.mismatch; measured every step either way): `tis` = truncated importance sampling "
        "with TRL's semantics (per token for grpo, per completion for gspo, capped at TRL's "
        "vllm_importance_sampling_clip_max, 3); `none` = measure only; `auto` = tis where the rollout's numerics "
        "differ from the loss pass's (the fast path, bf16/fp16, a 4-bit base), none where they match (float32 "
        "without the fast path). Why: docs/rollouts.md.",
    )
    dynamic_sampling: DynamicSamplingConfig = Field(
        default_factory=lambda: DynamicSamplingConfig(),
        description="DAPO-style dynamic sampling: drop groups whose rewards agree, generate more prompts to fill the "
        "batch (docs/rewards.md). Off by default.",
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
        description="GRPOConfig fields passed to TRL as they are, each value of its field's type (checked by "
        "`vlmrl config validate` and `vlmrl run`); a field vlmrl sets itself (learning_rate, save_strategy, "
        "generation_kwargs, push_to_hub, ...) is refused here, naming what to set instead. Where unset, vlmrl gives "
        "TRL its own values: "
        "lr_scheduler_type cosine, warmup_ratio 0.0 (a fraction of the steps, TRL's warmup_steps), epsilon 0.2 "
        "(lower clip of the importance ratio), epsilon_high None (= epsilon), beta 0.0 (KL coefficient; 0 skips the "
        "reference model), num_iterations 1 (policy updates per generation batch), logging_steps 1, "
        "save_total_limit 2, mask_truncated_completions false.",
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

    @field_validator("trl_overrides")
    @classmethod
    def _former_fields(cls, value: dict[str, Any]) -> dict[str, Any]:
        """The entries that were train fields keep their type and range; an error names the entry
        (`vlmrl.config.load.describe_errors` reads `entry` from its context)."""
        checked = dict(value)
        for name in [name for name in _TRL_CHECKS if name in value]:
            try:
                checked[name] = _TRL_CHECKS[name].validate_python(value[name])
                if isinstance(checked[name], float):
                    _exact_float(value[name])
            except ValueError as exc:  # a ValidationError is one
                problem = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
                raise PydanticCustomError("former_field", "{problem}",
                                          {"problem": problem, "entry": name, "value": value[name]}) from None
        return checked

    def trl_value(self, name: str) -> Any:
        """The value TRL gets for a field of `TRL_DEFAULTS` (or any trl_overrides key): the override, else vlmrl's.

        >>> TrainConfig(trl_overrides={"beta": 0.04}).trl_value("beta"), TrainConfig().trl_value("epsilon")
        (0.04, 0.2)
        """
        return self.trl_overrides[name] if name in self.trl_overrides else TRL_DEFAULTS[name]
