"""Which config fields decide each stage's outputs, and the fingerprints made of exactly those fields.

`STAGE_FIELDS` names, per stage, the fields (dotted paths; `rewards[].weight` is the weight of every `rewards:`
entry) whose values decide what that stage writes; a stage's fingerprint hashes those values, keyed by path, and
nothing else. So a field added to a section changes no fingerprint until it is listed here, and a schema edit
needs no compatibility entry for the run folders that exist. `NO_OUTPUT_FIELDS` names every other field with why
it decides no stage's output (where the run lives, how it is watched, how fast it runs). Every field of the schema
is in one or the other (tests/test_config.py checks it): a new field must be classified where it is added.

The stages: `data` (the prepared data), `eval` (the generations of an evaluation), `train` (the trained adapter;
its checkpoints leave out `RESUMABLE_FIELDS`), `export` (what is exported from the adapter), `rewards` (how
records are scored, and what training maximises). `vlmrl.run.layout` combines them with the hashes of the input
files a stage reads (`train_fingerprint`, `export_fingerprint`, `rewards_fingerprint`, ...).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any, get_args, get_origin

from pydantic import BaseModel

from vlmrl.config.train_section import TRL_DEFAULTS

MODEL_FIELDS = ("model.name", "model.backend", "model.load_in_4bit", "model.dtype", "model.attn_implementation",
                "model.max_seq_length")
LORA_FIELDS = ("lora.r", "lora.alpha", "lora.dropout", "lora.attention", "lora.mlp", "lora.vision")
DATA_FIELDS = ("data.source", "data.split", "data.holdout_split", "data.answer_types", "data.include_multi_choice",
               "data.answer_type", "data.prompt_field", "data.columns", "data.choices_separator", "data.image_size",
               "data.resize", "data.holdout_size", "data.max_prompt_tokens", "data.num_synthetic", "data.difficulty",
               "data.families", "data.max_items", "data.contamination", "data.system_prompt", "data.prompt_template",
               "data.contamination_max_distance")
EVAL_FIELDS = ("eval.batch_size", "eval.max_new_tokens", "eval.do_sample", "eval.temperature", "eval.num_samples",
               "eval.compile", "eval.visual_control")
# train.trl_overrides is read with vlmrl's own values filled in (TRL_DEFAULTS): writing one of them out is the same run.
TRAIN_FIELDS = ("train.algorithm", "train.loss_type", "train.learning_rate", "train.optim",
                "train.per_device_train_batch_size", "train.gradient_accumulation_steps", "train.num_generations",
                "train.steps_per_generation", "train.max_completion_length", "train.temperature",
                "train.num_train_epochs", "train.max_steps", "train.time_budget_minutes", "train.max_grad_norm", "train.gradient_checkpointing",
                "train.save_steps", "train.auto_batch", "train.rollout.fast", "train.rollout.prompt_bucket",
                "train.rollout_correction", "train.dynamic_sampling.enabled", "train.dynamic_sampling.max_rounds",
                "train.dynamic_sampling.accuracy_range", "train.dynamic_sampling.accuracy_reward",
                "train.eval_every_steps", "train.eval_subset", "train.trl_overrides",
                "health.stop_on_gibberish_steps")
EXPORT_FIELDS = ("export.merged_16bit", "export.merged_4bit", "export.gguf", "export.llama_cpp_dir",
                 "export.checkpoint", "export.checkpoint_metric")
REWARD_FIELDS = ("rewards[].name", "rewards[].function", "rewards[].weight", "rewards[].columns",
                 "rewards[].resolved")

STAGE_FIELDS: dict[str, tuple[str, ...]] = {
    # the items, their split and their prompts; the model's processor counts the prompt tokens
    "data": (*DATA_FIELDS, "run.seed", "model.name", "contract"),
    # the generations of the held-out set, given the data and (after training) the adapter
    "eval": (*MODEL_FIELDS, *EVAL_FIELDS, "run.seed", "contract"),
    # the trained adapter, given the data (whose fingerprint and the rewards' join it: vlmrl.run.layout)
    "train": (*MODEL_FIELDS, *LORA_FIELDS, *DATA_FIELDS, *TRAIN_FIELDS),
    # what is exported from the trained adapter
    "export": EXPORT_FIELDS,
    # how a completion is scored (the bytes of a user's reward file join it: vlmrl.run.layout.rewards_fingerprint)
    "rewards": REWARD_FIELDS,
}

# Train fields a resumed training may change: how long it trains, how often it logs, saves or validates, and when
# it stops on degenerate output. Left out of the checkpoints' fingerprint, so a run given more steps resumes.
RESUMABLE_FIELDS = ("train.max_steps", "train.num_train_epochs", "train.time_budget_minutes", "train.save_steps", "train.eval_every_steps",
                    "train.eval_subset", "train.trl_overrides.logging_steps", "train.trl_overrides.save_total_limit",
                    "health.stop_on_gibberish_steps")

_WARNING = "a warning threshold: what the run says about its health, not what it produces"
NO_OUTPUT_FIELDS: dict[str, str] = {
    "schema_version": "the config's layout version; a run folder of another one is refused, not fingerprinted",
    "run.name": "where the run lives: a run folder moved or copied elsewhere resumes as the same run",
    "run.output_dir": "where the run lives: a run folder moved or copied elsewhere resumes as the same run",
    "train.report_to": "which trackers watch the training: a run resumes under another tracker",
    "train.rollout.kernels": "vlmrl's and Liger's kernels or PyTorch's own: the same functions up to float rounding",
    "health.max_gibberish_rate": _WARNING,
    "health.min_format_rate": _WARNING,
    "health.max_truncation_rate": _WARNING,
    "health.max_zero_variance_groups": _WARNING,
    "rewards[].timeout_s": "a bound on a reward call's time: raised after a timeout, the run resumes",
}


def fingerprint(config: BaseModel, stage: str | None = None, *, without: Iterable[str] = ()) -> str:
    """16 hex digits of the values of `stage`'s fields (every stage's when None), less the paths in `without`
    (a field, or an entry of `train.trl_overrides`).

    >>> from vlmrl.config.schema import Config
    >>> a, b = Config(), Config.model_validate({"train": {"report_to": ["tensorboard"], "learning_rate": 1e-5}})
    >>> fingerprint(a, "data") == fingerprint(b, "data"), fingerprint(a, "train") == fingerprint(b, "train")
    (True, False)
    """
    return _digest(stage_values(config, stage, without=without))


def stage_values(config: BaseModel, stage: str | None = None, *, without: Iterable[str] = ()) -> dict[str, Any]:
    """{dotted path: value} of the fields that decide `stage`'s outputs (every stage's when None); `config` is a
    `vlmrl.config.schema.Config` (which imports this module, so it is not named in the signature)."""
    fields = STAGE_FIELDS[stage] if stage is not None else tuple(dict.fromkeys(
        path for paths in STAGE_FIELDS.values() for path in paths))
    dumped = config.model_dump(mode="json")
    dumped["train"]["trl_overrides"] = {**TRL_DEFAULTS, **dumped["train"]["trl_overrides"]}
    skipped = set(without)
    values = {path: _value(dumped, path) for path in fields if path not in skipped}
    for path in skipped:  # an entry of a mapping field: train.trl_overrides.logging_steps
        parent, _, key = path.rpartition(".")
        if isinstance(values.get(parent), dict):
            values[parent] = {k: v for k, v in values[parent].items() if k != key}
    return values


def _value(dumped: dict, path: str) -> Any:
    """The value at a dotted path of a model_dump; `list[].field` is that field of every entry, in order."""
    head, sep, rest = path.partition("[].")
    node: Any = dumped
    for part in head.split("."):
        node = node[part]
    return [_value(entry, rest) for entry in node] if sep else node


def _digest(values: Any) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]


def schema_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every field of `model` as a dotted path, sub-sections walked into (`train.rollout.fast`) and a list of
    sections as `name[].field`: the fields STAGE_FIELDS and NO_OUTPUT_FIELDS must classify between them."""
    paths: list[str] = []
    for name, info in model.model_fields.items():
        inner = section_of(info.annotation)
        if inner is None:
            paths.append(prefix + name)
        else:
            paths.extend(schema_fields(inner[0], f"{prefix}{name}{'[]' if inner[1] else ''}."))
    return paths


def section_of(annotation: Any) -> tuple[type[BaseModel], bool] | None:
    """(the section type, whether it is a list of them) for a field holding a section; None for a value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    if get_origin(annotation) is list:
        (item,) = get_args(annotation)
        if isinstance(item, type) and issubclass(item, BaseModel):
            return item, True
    return None
