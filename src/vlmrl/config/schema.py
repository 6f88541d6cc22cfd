"""Typed configuration: one YAML file, one section per stage, every field documented once, here.

A config is loaded from a preset shipped in ``vlmrl/config/presets/`` (``demo``, ``demo-gpu``, ``seed``,
``seed-16gb``, ``gspo-paper``) or a YAML file, then command-line overrides
(``--set train.learning_rate=1e-5``) are applied, then the whole thing is validated. Validation happens before
any model loads: unknown keys are named with the closest valid key, and cross-field contradictions say how to
fix them. The top-level `rewards:` list names the rewards and their weights; a user function's file is resolved
against the config file's folder here, at load time (importing and checking it is `vlmrl.grading.user_rewards`).

This module holds `Config` (the sections of `vlmrl.config.sections`, composed, their cross-field checks and
the fingerprints) and the entry points `load_config`, `validate_config`, `dump_config`; reading presets and
YAML, applying overrides, moving or refusing fields of earlier releases and wording the errors is
`vlmrl.config.load`, re-exported names included (`PRESETS`, `ConfigError`).

Deliberately left out: a mirror of all of ``GRPOConfig``. ``train.trl_overrides`` passes anything else
straight to TRL.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from vlmrl.config.load import (
    PRESETS,  # noqa: F401 (re-exported: `from vlmrl.config.schema import PRESETS`)
    ConfigError,
    apply_override,
    clip,
    describe_errors,
    quoted,
    read_source,
    refuse_reward_weights,
    upgrade_export_fields,
    upgrade_train_fields,
)
from vlmrl.config.sections import (  # noqa: F401 (re-exported: every stage imports its section from here)
    TRACKERS,
    TRL_DEFAULTS,
    TRL_NAMES,
    DataConfig,
    EvalConfig,
    ExportConfig,
    HealthConfig,
    LoraConfig,
    ModelConfig,
    RewardSpec,
    RolloutConfig,
    RunConfig,
    TrainConfig,
    _Section,
)

MAX_RUN_NAME = 128  # characters of run.name: one folder name, with room under the file system's 255 bytes

# Fields that only change how a run is watched or how fast it runs, not what it produces: left out of every
# fingerprint, so a run resumes (and a finished stage stays done) under another tracker or kernel setting. The
# kernels and the removed trim/grouping/window switches change float summation order only (grouping also how TRL
# averages its per-micro-batch metrics). Names as in the flat train section fingerprints read (`Config.flat_train`).
OBSERVATION_FIELDS = {"train": ("report_to", "trim_padding", "group_by_length", "rollout_filled_window",
                                "rollout_decode_kernel", "rollout_stacked", "rollout_stacked_kernel", "rollout_guards",
                                "loss_kernels")}
# Train fields of earlier releases that now have one value (automatic or fixed), as fingerprints see them.
_FIXED_TRAIN = {"rollout_merge": False, "rollout_adapter_copies": True, "rollout_stacked": True,
                "rollout_guards": "every step", "rollout_filled_window": 0, "adapter_input_cast": False,
                "trim_padding": True, "group_by_length": True}
# Fields added after runs existed, left out of fingerprints at these values so those runs keep theirs. A `split`
# of None (follow the source) reads as "testmini", the default it replaced (both mean testmini for MathVista).
_LATER_DATA = {"holdout_split": None, "choices_separator": None, "contamination": "auto",
               "contamination_max_distance": 4, "system_prompt": None, "prompt_template": None}
# Export fields of earlier releases as fingerprints see them: the removed one at the value it had, and
# `gguf: off` as gguf false with the default quantization (any other value as gguf true with its quantization).
_FIXED_EXPORT = {"logits_atol": 1e-3}
_GGUF_BEFORE = {"off": (False, "q8_0"), "f16": (True, "none"), "q8_0": (True, "q8_0"), "q4_k_m": (True, "q4_k_m")}


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
    contract: Literal["seed", "think"] = Field(
        "seed",
        description="The answer form asked for, read and rewarded (vlmrl.contract): `seed` is <REASONING>...</REASONING>"
        "<SOLUTION>...</SOLUTION> (the write-up's); `think` is <think>...</think> then \\boxed{answer}, as R1-style "
        "models and trl.rewards expect.",
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
        if t.trl_overrides.get("use_vllm") and self.lora.vision:
            raise ValueError(
                "train.trl_overrides.use_vllm with lora.vision=true: vLLM cannot serve LoRA on vision layers. "
                "Set lora.vision=false or drop use_vllm."
            )
        epsilon, epsilon_high = t.trl_value("epsilon"), t.trl_value("epsilon_high")
        if epsilon_high is not None and epsilon_high < epsilon:
            raise ValueError(f"train.trl_overrides.epsilon_high={epsilon_high} must be >= epsilon={epsilon} "
                             "(it is the upper clip range).")
        if not (self.lora.attention or self.lora.mlp or self.lora.vision):
            raise ValueError("lora: attention, mlp and vision are all false; nothing would train.")
        if self.export.checkpoint == "best" and not t.eval_every_steps:
            raise ValueError("export.checkpoint=best needs train.eval_every_steps (validation picks the best step).")
        name = self.run.name
        if name in ("", ".", "..") or any(c in name for c in "/\\\0"):
            raise ValueError(
                f"run.name={quoted(name)} is not a plain folder name; the run directory is <output_dir>/<name> and "
                "`--force` deletes it, so it must not be the output folder, its parent or a path. "
                "Put parent folders in run.output_dir."
            )
        if len(name) > MAX_RUN_NAME or not name.isprintable():
            raise ValueError(f"run.name={quoted(name, 40)}: a folder name of at most {MAX_RUN_NAME} printable "
                             "characters (no line breaks, tabs or control characters).")
        if not self.run.output_dir.isprintable():
            raise ValueError(f"run.output_dir={quoted(self.run.output_dir, 80)} holds a line break, tab or control "
                             "character; name a plain folder.")
        return self

    def fingerprint(self, *sections: str) -> str:
        """A short stable hash of the named sections (all when none): used to tell whether a stage's outputs
        were produced by this config."""
        data = self.model_dump(mode="json")
        data["train"] = self.flat_train()
        data["rewards"] = [spec.fingerprinted() for spec in self.rewards]
        data["data"] = _fingerprinted_data(data["data"])
        gguf, quantization = _GGUF_BEFORE[data["export"]["gguf"]]
        data["export"].update(gguf=gguf, gguf_quantization=quantization, **_FIXED_EXPORT)
        if data["contract"] == "seed":  # added later: a seed run keeps its fingerprint
            del data["contract"]
        for section, fields in OBSERVATION_FIELDS.items():
            for name in fields:
                data[section].pop(name, None)
        if sections:
            data = {k: data[k] for k in sections}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    def flat_train(self) -> dict:
        """The train section in the flat form it had before `train.rollout` existed, which every fingerprint
        reads: a run folder made by an earlier release keeps its fingerprints, so it resumes."""
        flat = self.train.model_dump(mode="json")
        rollout, overrides = flat.pop("rollout"), dict(flat["trl_overrides"])
        kernels = rollout["kernels"]
        flat.update(fast_generation=rollout["fast"], prompt_bucket=rollout["prompt_bucket"], loss_kernels=kernels,
                    rollout_decode_kernel=kernels, rollout_stacked_kernel=kernels, **_FIXED_TRAIN)
        flat.update({name: overrides.pop(name, default) for name, default in TRL_DEFAULTS.items()})
        flat["generation_backend"] = "vllm" if overrides.pop("use_vllm", False) else "hf"
        if flat["rollout_correction"] == "auto":  # added later: at its default, earlier runs keep their fingerprints
            del flat["rollout_correction"]
        flat["trl_overrides"] = overrides
        return flat

    def data_fingerprint(self) -> str:
        """What the prepared data depends on: the data section, the split seed and the model (its processor
        counts prompt tokens). The run's name and folder are left out so a copied run stays valid."""
        section = _fingerprinted_data(self.data.model_dump(mode="json"))
        if section["answer_type"] is None:  # a field added later: unset, earlier runs keep their fingerprint
            del section["answer_type"]
        data: dict[str, Any] = {"data": section, "seed": self.run.seed, "model": self.model.name}
        if self.contract != "seed":  # the prompts ask for its form
            data["contract"] = self.contract
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name


def _fingerprinted_data(section: dict) -> dict:
    """The data section as fingerprints read it: fields added later left out at their defaults."""
    section = {k: v for k, v in section.items() if k not in _LATER_DATA or v != _LATER_DATA[k]}
    section["split"] = section["split"] or "testmini"
    return section


def load_config(source: str | Path | None = None, overrides: list[str] | None = None, *,
                migrate: bool = False) -> Config:
    """Load a preset name or YAML path (None = `demo`), apply `key.path=value` overrides, validate. `migrate`:
    the file is a run folder's config.yaml, whose fields an earlier release may have written."""
    source = source or "demo"
    raw, origin = read_source(str(source))
    written = (raw.get("data") or {}).get("source") if isinstance(raw.get("data"), dict) else None
    upgrade_train_fields(raw, origin, migrate=migrate)
    upgrade_export_fields(raw, origin, migrate=migrate)
    for item in overrides or []:
        apply_override(raw, item)
    upgrade_train_fields(raw, f"{origin} (--set)", later_wins=True)
    upgrade_export_fields(raw, f"{origin} (--set)")
    config = validate_config(raw, origin)
    base = Path(origin).parent if Path(origin).is_file() else Path.cwd()
    _resolve_data_source(config, written, base)
    for spec in config.rewards:
        if spec.function is not None and spec.resolved is None:  # a copy in a run folder keeps its resolved path
            try:
                spec.resolved = _resolved_reward(spec, base)
            except (OSError, RuntimeError) as exc:  # a path the OS cannot resolve (too long, a symlink loop)
                raise ConfigError(f"{origin}: rewards: {quoted(spec.function)}: {clip(exc)}") from None
    return config


def _resolved_reward(spec: RewardSpec, base: Path) -> str | None:
    """A reward file's absolute path; for `package.module:name`, the config's folder when the package is there."""
    if spec.file is not None:
        return str((base / spec.file).resolve())
    top = str(spec.function).rpartition(":")[0].split(".")[0]
    found = (base / top).is_dir() or (base / f"{top}.py").is_file()
    return str(base.resolve()) if found and top.isidentifier() else None


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


def dump_config(config: Config, *, changed_only: bool = False) -> str:
    """The config as YAML; `changed_only`: only the fields that differ from their defaults (the `rewards:` list
    always), which loads back to the same config.

    >>> print(dump_config(Config.model_validate({"train": {"rollout": {"fast": "never"}}}), changed_only=True))
    train:
      rollout:
        fast: never
    rewards:
    - name: format
      weight: 0.3
    - name: correctness
      weight: 1.0
    <BLANKLINE>
    """
    data = config.model_dump(mode="json")
    if changed_only:
        data = _changed(data, Config().model_dump(mode="json"))
        default_timeout = RewardSpec.model_fields["timeout_s"].default
        data["rewards"] = [{k: v for k, v in r.items() if v not in (None, {}, []) and (k, v) != ("timeout_s", default_timeout)}
                           for r in config.model_dump(mode="json")["rewards"]]
    return yaml.safe_dump(data, sort_keys=False)


def _changed(data: dict, defaults: dict) -> dict:
    """The entries of `data` that differ from `defaults`, nested sections recursively (empty sections dropped)."""
    out = {}
    for key, value in data.items():
        default = defaults.get(key)
        if isinstance(value, dict) and isinstance(default, dict) and key != "trl_overrides" and key != "columns":
            if inner := _changed(value, default):
                out[key] = inner
        elif value != default:
            out[key] = value
    return out

