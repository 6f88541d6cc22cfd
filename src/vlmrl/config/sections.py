"""The config's sections, one per stage, each field documented once: `RunConfig`, `ModelConfig`, `LoraConfig`,
`DataConfig`, `EvalConfig`, `HealthConfig`, `ExportConfig` and `RewardSpec` (an entry of the top-level `rewards:`
list) here; `TrainConfig` (with `RolloutConfig`) and `TRL_DEFAULTS` in `vlmrl.config.train_section`, re-exported
here. `vlmrl.config.schema.Config` composes them.

Every section refuses unknown keys, non-finite numbers, anything but true/false in a true/false field and
true/false in a number field (pydantic would read `"off"` as false and `true` as 1), and text over MAX_TEXT
(`vlmrl.config.section_base`); cross-field checks live on `Config`. `COLUMN_ROLES` and `TRL_TAKEN_NAMES` bound the
column maps (the one copy of each list: data/ and grading/ import them from here).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from vlmrl.config.load import quoted  # the loading side never imports the sections: no cycle
from vlmrl.config.section_base import MAX_TEXT, _Section  # noqa: F401 (re-exported)
from vlmrl.config.train_section import (  # noqa: F401 (re-exported: `from vlmrl.config.sections import TrainConfig`)
    TRL_DEFAULTS,
    TRL_NAMES,
    RolloutConfig,
    TrainConfig,
)

TRACKERS = ("tensorboard", "wandb", "trackio", "none")
MAX_WEIGHT = 1e6  # |weight| of a reward: far above any useful ratio, far below where the weighted sum overflows
# What `data.columns` maps (its keys): the roles a dataset's columns play for vlmrl (docs/data.md).
COLUMN_ROLES = ("id", "question", "answer", "image", "images", "choices", "answer_type", "precision", "unit",
                "category")
# The arguments TRL passes every reward function besides the dataset's columns.
TRL_REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
# Those plus the names TRL keeps for itself (an environment's, the row fields it drops from a reward's
# arguments): a reward's `columns` must neither hand a column under one of these names nor take one as a column.
TRL_TAKEN_NAMES = (*TRL_REWARD_ARGUMENTS, "environments", "prompt", "completion")


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
    split: str | None = Field(
        None,
        description="Split trained on (hub id, folder, DatasetDict). None follows the source: `testmini` where it has "
        "one (MathVista), else `train` where it has one, else every row.",
    )
    holdout_split: str | None = Field(
        None,
        description="Take the held-out set (up to holdout_size items) from this split of the source, e.g. `test`, "
        "instead of cutting it from the training split.",
    )
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
        "answer_type, precision, unit, category (docs/data.md).",
    )
    choices_separator: str | None = Field(
        None,
        min_length=1,  # YAML reads a bare | as an empty block: quote it, "|"
        description="A choices cell that is neither a JSON nor a Python list is split at this text (\"|\", \";\"); "
        "None: such a cell drops its row (bad_choices).",
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
    contamination: Literal["auto", "near", "exact", "off"] = Field(
        "auto",
        description="Training items showing a held-out picture are dropped: `near` copies too (re-encoded, resized, "
        "brightened: dHash within contamination_max_distance bits, confirmed pixel by pixel), `exact` identical "
        "pictures only, `off` none (held-out scores then may flatter the model). `auto`: near, but exact for "
        "`synthetic` (its template figures differ only in small labels). docs/data.md.",
    )
    system_prompt: str | None = Field(
        None, max_length=100_000, description="A system message for every item that has none of its own (a TRL "
        "conversational `prompt` cell may carry one); None: no system message."
    )
    prompt_template: str | None = Field(
        None, max_length=100_000, description="The user turn's text, `{question}` standing for the question (and its "
        "choices), instead of the question followed by vlmrl's instruction (EasyR1's format_prompt). Say in it the "
        "form the contract's rewards read. docs/data.md.",
    )
    contamination_max_distance: int = Field(
        4, ge=0, le=64, description="Near mode: dHash bits (of 64) two pictures may differ by and still be compared "
        "pixel by pixel as possible copies; 0 compares only pictures of equal hash."
    )

    @field_validator("columns")
    @classmethod
    def _column_roles(cls, value: dict[str, str]) -> dict[str, str]:
        if unknown := [k for k in value if k not in COLUMN_ROLES]:
            raise ValueError(f"{', '.join(quoted(k) for k in unknown[:5])} is no column role; the keys are vlmrl's "
                             f"roles ({', '.join(COLUMN_ROLES)}) and the values your file's column names, e.g. "
                             "{question: problem, answer: solution}; a reward's own argument names go in that "
                             "reward's `columns:`")
        return value

    @field_validator("prompt_template")
    @classmethod
    def _has_question(cls, value: str | None) -> str | None:
        if value is not None and "{question}" not in value:
            raise ValueError("has no {question}, so no prompt would show the question; put {question} where it goes")
        return value

    @field_validator("contamination", mode="before")
    @classmethod
    def _bare_off(cls, value: Any) -> Any:
        """YAML reads a bare `off` as false."""
        return "off" if value is False else value


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
    gguf: Literal["off", "f16", "q8_0", "q4_k_m"] = Field(
        "off", description="Also write `gguf/` with llama.cpp's converter (see docs/export.md), its weights in: f16 "
        "(unquantized) or q8_0 (the converter itself), q4_k_m (needs llama-quantize); `off`: no GGUF.")
    llama_cpp_dir: str | None = Field(
        None, description="A llama.cpp folder holding convert_hf_to_gguf.py; default $VLMRL_LLAMA_CPP_DIR, then "
        "vlmrl's cache (filled by `python -m vlmrl.export.gguf fetch`).")
    checkpoint: Literal["last", "best"] = Field(
        "last",
        description="`last`: export the adapter of the final step; `best`: the adapter of the validation step with "
        "the highest checkpoint_metric (needs train.eval_every_steps; kept in train/best/).",
    )
    checkpoint_metric: Literal["accuracy", "mathvista_accuracy", "format_compliance", "total_reward"] = Field(
        "accuracy", description="Validation metric that picks the best checkpoint (higher is better)."
    )

    @field_validator("gguf", mode="before")
    @classmethod
    def _bare_off(cls, value: Any) -> Any:
        """YAML reads a bare `off` as false."""
        return "off" if value is False else value


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
    timeout_s: float | None = Field(
        60.0, gt=0, le=86400,
        description="For a `function:` reward: seconds one call may take (one call scores a whole batch of "
        "completions); over it, the run stops with one line naming the reward and resumes when re-run. A minute "
        "is far above what a Python reward needs for a batch and short enough that a hung one is noticed. null: "
        "no limit, and the call runs in the caller's thread (for code that needs the main thread, e.g. "
        "signal.alarm). The built-ins bound their own work and ignore it. Not in any fingerprint: a run resumes "
        "under another limit.",
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="This reward's argument names for dataset columns, e.g. {solution: answer} hands "
        "trl.rewards:accuracy_reward the gold answer as `solution`.",
    )
    resolved: str | None = Field(
        None,
        description="Filled in by vlmrl when the config is loaded: the absolute path of a `function:` file (or the "
        "folder beside the config holding a `module.path`'s package), so the run folder's copy still finds it.",
    )

    @field_validator("weight")
    @classmethod
    def _bounded_weight(cls, value: float) -> float:
        if abs(value) > MAX_WEIGHT:
            raise ValueError(f"|weight| must be at most {MAX_WEIGHT:g}: the weighted total of the rewards must stay "
                             "finite (only the ratios between weights matter)")
        return value

    @field_validator("columns")
    @classmethod
    def _not_trl_names(cls, value: dict[str, str]) -> dict[str, str]:
        for argument, column in value.items():
            if taken := next((n for n in (argument, column) if n in TRL_TAKEN_NAMES), None):
                raise ValueError(
                    f"{{{quoted(argument)}: {quoted(column)}}}: TRL passes `{taken}` to every reward itself; map an "
                    "argument of your function to a column of the data, e.g. {solution: answer}")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> RewardSpec:
        if (self.name is None) == (self.function is None):
            raise ValueError("give exactly one of `name:` (format | correctness) or `function:` (file.py:name).")
        if self.function is not None:
            where, sep, attr = self.function.rpartition(":")
            if not sep or not where.strip() or not attr.isidentifier() or "\0" in where:
                raise ValueError(
                    f"function {quoted(self.function)}: expected `file.py:name` or `module.path:name`, e.g. "
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
