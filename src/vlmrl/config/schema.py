"""Typed configuration: one YAML file, one section per stage, every field documented once, here.

A config is loaded from a preset shipped in ``vlmrl/config/presets/`` (``demo``, ``demo-gpu``, ``seed``,
``seed-16gb``, ``gspo-paper``) or a YAML file, then command-line overrides
(``--set train.learning_rate=1e-5``) are applied, then the whole thing is validated. Validation happens before
any model loads: unknown keys are named with the closest valid key, and cross-field contradictions say how to
fix them. The top-level `rewards:` list names the rewards and their weights; a user function's file is resolved
against the config file's folder here, at load time (importing and checking it is `vlmrl.grading.user_rewards`).

This module holds `Config` (the sections of `vlmrl.config.sections`, composed, and their cross-field checks) and
the entry points `load_config`, `validate_config`, `dump_config`; reading presets and YAML, applying overrides,
the schema version of a run folder's config.yaml and wording the errors is `vlmrl.config.load`, re-exported names
included (`PRESETS`, `ConfigError`). Which fields decide which stage's outputs, and the fingerprints made of them,
is `vlmrl.config.fingerprints`. Every field is listed with its description in docs/config.md
(`python -m vlmrl.config.reference > docs/config.md`).

Deliberately left out: a mirror of all of ``GRPOConfig``. ``train.trl_overrides`` passes anything else
straight to TRL.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from vlmrl.config.fingerprints import fingerprint as stage_fingerprint
from vlmrl.config.load import (
    PRESETS,  # noqa: F401 (re-exported: `from vlmrl.config.schema import PRESETS`)
    SCHEMA_VERSION,
    ConfigError,
    apply_override,
    check_schema_version,
    check_trl_overrides,
    clip,
    describe_errors,
    quoted,
    read_source,
    refuse_reward_weights,
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

def _default_rewards() -> list[RewardSpec]:
    return [RewardSpec(name="format", weight=0.3), RewardSpec(name="correctness", weight=1.0)]


class Config(_Section):
    schema_version: int = Field(
        SCHEMA_VERSION,
        description="The layout of this config, written into every run folder's config.yaml; a run folder of "
        "another version (or none) is refused. Your own config file may leave it out.",
    )
    run: RunConfig = Field(default_factory=RunConfig, description="The run's name, its folder and its seed.")
    model: ModelConfig = Field(default_factory=ModelConfig,
                               description="The policy model: which one, how it is loaded, its numerics.")
    lora: LoraConfig = Field(default_factory=LoraConfig,
                             description="The LoRA adapter trained on the model: its size and the layers it adapts.")
    data: DataConfig = Field(default_factory=DataConfig,
                             description="The dataset, how its rows are read, the held-out set, images and prompts "
                             "(docs/data.md).")
    eval: EvalConfig = Field(default_factory=EvalConfig,
                             description="The held-out evaluations before and after training (baseline, after).")
    train: TrainConfig = Field(default_factory=TrainConfig,
                               description="GRPO / GSPO training through TRL's GRPOTrainer; `trl_overrides` passes "
                               "any other GRPOConfig field.")
    health: HealthConfig = Field(default_factory=HealthConfig,
                                 description="Warnings (and an optional stop) on degenerate training "
                                 "(train/health.jsonl).")
    export: ExportConfig = Field(default_factory=ExportConfig,
                                 description="What `vlmrl export` writes beside the verified adapter (docs/export.md).")
    rewards: list[RewardSpec] = Field(
        default_factory=_default_rewards,
        description="The rewards GRPO maximises, each a built-in (`name:`) or a function of your own "
        "(`function:`), with its weight (docs/rewards.md).",
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

    @field_validator("schema_version")
    @classmethod
    def _this_version(cls, value: int) -> int:
        if value != SCHEMA_VERSION:
            raise ValueError(f"this vlmrl reads schema_version {SCHEMA_VERSION}")
        return value

    def fingerprint(self, stage: str | None = None, *, without: tuple[str, ...] = ()) -> str:
        """A short stable hash of the fields that decide `stage`'s outputs (every stage's when None), less
        `without`: used to tell whether a stage's outputs were produced by this config (vlmrl.config.fingerprints)."""
        return stage_fingerprint(self, stage, without=without)

    def data_fingerprint(self) -> str:
        """What the prepared data depends on: the data section, the split seed, the model (its processor counts
        prompt tokens) and the contract (the prompts ask for its form)."""
        return self.fingerprint("data")

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name


def load_config(source: str | Path | None = None, overrides: list[str] | None = None, *,
                run_folder: bool = False) -> Config:
    """Load a preset name or YAML path (None = `demo`), apply `key.path=value` overrides, validate. `run_folder`:
    the file is a run folder's config.yaml, which must carry this vlmrl's `schema_version` (else one ConfigError
    line says what to do)."""
    source = source or "demo"
    raw, origin = read_source(str(source))
    check_schema_version(raw, origin, run_folder=run_folder)
    written = (raw.get("data") or {}).get("source") if isinstance(raw.get("data"), dict) else None
    check_trl_overrides(raw, origin)
    for item in overrides or []:
        apply_override(raw, item)
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
    check_schema_version(raw, origin)
    check_trl_overrides(raw, origin)
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

