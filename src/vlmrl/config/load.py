"""The loading side of the config: from a preset name or YAML file and `key.path=value` overrides to the raw
mapping that `vlmrl.config.schema` validates, and from pydantic's errors back to one readable message.

What lives here: the preset names and their files (``vlmrl/config/presets/``), YAML parsing that turns every parser
failure into a `ConfigError`, overrides, the refusal of fields that were replaced (with the form that replaces
them), and the error text (unknown keys named with the closest valid key). `load_config`, `validate_config`
and `dump_config` stay in `vlmrl.config.schema`, which imports this module (never the other way round), so the
schema is passed in where an error message needs it. Left out: the schema itself, and resolving paths
against the config file's folder (that needs the validated config: `vlmrl.config.schema.load_config`).
"""

from __future__ import annotations

import difflib
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

PRESETS = ("demo", "demo-gpu", "seed", "seed-16gb", "gspo-paper")


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file, the field and the fix."""


# Train fields of earlier releases, and where each went. Renamed ones and those now passed to TRL as they are
# (`train.trl_overrides`) are moved, the same run either way. Removed ones are refused in a config file, with
# where they went; in a run folder's own config.yaml (`migrate`), where every field was written out, they are
# dropped (a kernel switch that was off turns train.rollout.kernels off).
RENAMED_TRAIN = {"fast_generation": "fast", "prompt_bucket": "prompt_bucket"}  # -> train.rollout.<new>
TO_TRL = ("logging_steps", "save_total_limit", "mask_truncated_completions", "lr_scheduler_type", "warmup_ratio",
          "epsilon", "epsilon_high", "beta", "num_iterations")  # -> train.trl_overrides.<same>
_AUTOMATIC = "the stacked LoRA projections run wherever they apply and the adapter copies where they do not, automatically"
_EXPERIMENT = "an experiment that did not pay, now a script in benchmarks/ (vlmrl.engine.experimental)"
REMOVED_TRAIN = {
    "rollout_stacked": _AUTOMATIC,
    "rollout_adapter_copies": _AUTOMATIC,
    "rollout_stacked_kernel": "see train.rollout.kernels",
    "rollout_decode_kernel": "see train.rollout.kernels",
    "loss_kernels": "see train.rollout.kernels",
    "trim_padding": "the loss pass always skips all-padding columns (the same log-probs, less compute)",
    "group_by_length": "micro-batches are always grouped by length where the loss allows it",
    "rollout_merge": _EXPERIMENT,
    "rollout_guards": _EXPERIMENT,
    "rollout_filled_window": _EXPERIMENT,
    "adapter_input_cast": _EXPERIMENT,
}
_KERNEL_SWITCHES = ("rollout_stacked_kernel", "rollout_decode_kernel", "loss_kernels")
# Export fields of earlier releases: `gguf: true` with `gguf_quantization: none | q8_0 | q4_k_m` is now one
# `gguf:` naming the weights (`none` wrote f16, the converter's output type); removed ones as in REMOVED_TRAIN.
REMOVED_EXPORT = {"logits_atol": "the adapter reload check's tolerance is fixed (vlmrl.export.merge.LOGITS_ATOL)"}


def upgrade_train_fields(raw: dict, origin: str, *, migrate: bool = False) -> None:
    """Move renamed train fields to their place, refuse removed ones naming where they went (or, with `migrate`,
    drop them: a run folder's config.yaml written by an earlier release)."""
    train = raw.get("train")
    if not isinstance(train, dict):
        return
    rollout = train.get("rollout") if isinstance(train.get("rollout"), dict) else {}
    for old, new in RENAMED_TRAIN.items():
        if old in train:
            rollout[new] = train.pop(old)
    if any(train.get(name) is False for name in _KERNEL_SWITCHES) and migrate:
        rollout.setdefault("kernels", False)
    if rollout:
        train["rollout"] = rollout
    overrides = train.get("trl_overrides") if isinstance(train.get("trl_overrides"), dict) else {}
    for name in TO_TRL:
        if name in train:
            overrides[name] = train.pop(name)
    if train.get("generation_backend") == "vllm":
        overrides.setdefault("use_vllm", True)
    if train.pop("generation_backend", "hf") not in ("hf", "vllm"):
        raise ConfigError(f"{origin}: train.generation_backend is now train.trl_overrides.use_vllm (true or false).")
    if overrides:
        train["trl_overrides"] = overrides
    for name, where in REMOVED_TRAIN.items():
        if name in train:
            if not migrate:
                raise ConfigError(f"{origin}: train.{name} was removed: {where}; delete the line.")
            del train[name]


def upgrade_export_fields(raw: dict, origin: str, *, migrate: bool = False) -> None:
    """Fold `gguf: true` and `gguf_quantization` into `gguf: <weights>`, refuse removed export fields naming
    why (or, with `migrate`, drop them)."""
    export = raw.get("export")
    if not isinstance(export, dict):
        return
    quantization = export.pop("gguf_quantization", None)
    gguf = export.get("gguf")
    if gguf is True or (quantization is not None and gguf not in (None, False, "off")):
        quantization = "q8_0" if quantization is None else quantization  # the default it had
        export["gguf"] = "f16" if quantization == "none" else quantization
    for name, why in REMOVED_EXPORT.items():
        if name in export:
            if not migrate:
                raise ConfigError(f"{origin}: export.{name} was removed: {why}; delete the line.")
            del export[name]


def refuse_reward_weights(raw: dict, origin: str) -> None:
    """`train.reward_weights` (before `rewards:` existed) is refused with the form that replaces it."""
    train = raw.get("train")
    if not (isinstance(train, dict) and "reward_weights" in train):
        return
    old = train["reward_weights"]
    fmt, cor = old if isinstance(old, list) and len(old) == 2 else (0.3, 1.0)
    raise ConfigError(
        f"{origin}: train.reward_weights was replaced by a top-level `rewards:` list; write "
        f"`rewards: [{{name: format, weight: {fmt}}}, {{name: correctness, weight: {cor}}}]` "
        "(and add `{function: my_rewards.py:name, weight: ...}` entries for your own)."
    )


def read_source(source: str) -> tuple[dict, str]:
    """(the parsed mapping, where it came from) for a preset name or a YAML file path."""
    if source in PRESETS:
        text = resources.files("vlmrl.config.presets").joinpath(f"{source}.yaml").read_text()
        origin = f"preset {source}"
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"{source}: no such config file and not a preset (presets: {', '.join(PRESETS)}).")
        text = path.read_text(errors="replace")
        origin = str(path)
    try:
        raw = _parse_yaml(text)
    except Exception as exc:  # noqa: BLE001  see _parse_yaml
        raise ConfigError(f"{origin}: not valid YAML ({(str(exc) or type(exc).__name__).splitlines()[0]}).") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{origin}: the top level must be a mapping of sections, got {type(raw).__name__}.")
    return raw, origin


def apply_override(raw: dict, item: str) -> None:
    """Set `section.field=value` in the raw mapping; the value is YAML when it parses, else the text as typed.
    A mapping given to `train.trl_overrides` adds to the entries already there (a preset's scheduler or clip
    range lives there too), key by key."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r}: expected section.field=value, e.g. train.learning_rate=1e-5.")
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part} is not a section.")
        node = child
    before = node.get(parts[-1])
    try:
        node[parts[-1]] = _parse_yaml(value)
    except Exception:  # noqa: BLE001  not YAML: keep the text as typed, and let validation judge it
        node[parts[-1]] = value
    if parts == ["train", "trl_overrides"] and isinstance(before, dict) and isinstance(node[parts[-1]], dict):
        node[parts[-1]] = {**before, **node[parts[-1]]}


def _parse_yaml(text: str) -> Any:
    """yaml.safe_load, whose constructors raise plain ValueError, IndexError, AttributeError or RecursionError
    (not YAMLError) on some inputs (`2001-13-01`, `!!int`, `!!timestamp x`, 5000 nested `[`): callers treat
    any exception here as "not valid YAML" (found by tests/test_fuzz_config.py)."""
    return yaml.safe_load(text)


def describe_errors(exc: ValidationError, origin: str, root: type[BaseModel]) -> str:
    """pydantic's errors as one message: each field's path and problem, unknown keys with the closest
    valid one (`root` is the schema searched, `vlmrl.config.schema.Config`)."""
    lines = [f"{origin}: invalid configuration"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        if "entry" in err.get("ctx", {}):  # about one entry of a mapping field (train.trl_overrides.beta)
            loc, err = f"{loc}.{err['ctx']['entry']}", {**err, "input": err["ctx"]["value"]}
        if err["type"] == "extra_forbidden":
            lines.append(f"  unknown key {loc!r}{_suggest(err['loc'], root)}")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"  {loc or '(config)'}: {msg}" + (f" (got {err['input']!r})" if loc else ""))
    return "\n".join(lines)


def _suggest(loc: tuple, root: type[BaseModel]) -> str:
    if len(loc) == 1:  # a flat, TRL-style key at the top level: point to the section that holds it
        homes = _sections_holding(str(loc[0]), root)
        if homes:
            return f"; did you mean {' or '.join(repr(h) for h in homes)}? (fields live in their section)"
    model = root
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return ""
        model = annotation
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1, cutoff=0.5)
    prefix = ".".join(str(p) for p in loc[:-1])
    return f"; did you mean '{prefix + '.' if prefix else ''}{close[0]}'?" if close else ""


def _sections_holding(name: str, root: type[BaseModel]) -> list[str]:
    """`section.name` for every section with a field `name`.

    >>> from vlmrl.config.schema import Config  # only here: this module never imports the schema
    >>> _sections_holding("report_to", Config)
    ['train.report_to']
    >>> _sections_holding("nonsense", Config)
    []
    """
    return [f"{section}.{name}" for section, field in root.model_fields.items()
            if name in getattr(field.annotation, "model_fields", {})]
