"""What training would refuse, found without a model: `vlmrl config validate` and `vlmrl train` share it.

pydantic checks each field's type and range; the names that only transformers and TRL know (scheduler and
optimizer names, GRPOConfig fields for `train.trl_overrides`) and the trackers' packages are checked here, so
a config that validates is a config that trains. Each problem is one line naming the field and the fix.

Left out: anything that needs the model or the data (memory, prompt lengths); `vlmrl doctor --config` and
`vlmrl prepare` cover those.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import typing

from pydantic import ConfigDict, TypeAdapter, ValidationError

from vlmrl.common.provenance import package_version
from vlmrl.config.load import quoted
from vlmrl.config.schema import TRL_NAMES, Config, TrainConfig
from vlmrl.train.trackers import missing_packages

# GRPOConfig fields vlmrl sets from a field of its own config under another name (same-named fields of
# TrainConfig are found by name). A trl_overrides key among these would silently replace the first-class value.
RENAMED = {
    "seed": "run.seed",
    "warmup_steps": "train.trl_overrides.warmup_ratio",
    "importance_sampling_level": "train.algorithm",
    "bf16": "model.dtype",
    "fp16": "model.dtype",
    "output_dir": "the run directory",
    "reward_weights": "the top-level rewards: list (each entry's weight)",
    "report_to": "train.report_to (vlmrl runs the trackers itself)",
    "save_strategy": "train.save_steps (vlmrl resumes from those checkpoints)",
    "eval_strategy": "train.eval_every_steps (vlmrl's own validation)",
    "eval_steps": "train.eval_every_steps (vlmrl's own validation)",
    "do_eval": "train.eval_every_steps (vlmrl's own validation)",
}
# GRPOConfig fields vlmrl sets under no field of its own (and `hub_*`, as push_to_hub): why, and what to do instead.
OWNED = {
    "generation_kwargs": "it holds the image tokens a completion must not contain; sample with train.temperature, "
                         "train.max_completion_length or trl_overrides top_p, top_k, min_p, repetition_penalty",
    "push_to_hub": "vlmrl uploads the verified adapter after training: `vlmrl export RUN --push-to-hub REPO`",
    "resume_from_checkpoint": "vlmrl resumes from the last complete checkpoint when the same command is re-run",
    "use_cpu": "vlmrl trains on CUDA when present, else on the CPU",
    "logging_nan_inf_filter": "vlmrl logs a NaN loss as NaN, so its health checks see it",
    "log_completions": "vlmrl records the completions itself, under train/",
    "disable_tqdm": "vlmrl shows its own progress",
    "dataloader_num_workers": "vlmrl reads its prepared files in the main process",
    "remove_unused_columns": "rewards take every data column as a keyword argument, so vlmrl keeps them all",
}


def first_class_fields() -> dict[str, str]:
    """GRPOConfig field -> the vlmrl field that sets it."""
    from trl import GRPOConfig

    grpo = {f.name for f in dataclasses.fields(GRPOConfig)}
    same = {name: f"train.{name}" for name in TrainConfig.model_fields if name in grpo}
    return {**same, **{k: v for k, v in RENAMED.items() if k in grpo}}


def training_problems(config: Config) -> list[str]:
    """Every reason `vlmrl train` would refuse this config before loading a model; [] when none."""
    t = config.train
    problems = []
    problems += _name_problem("train.trl_overrides.lr_scheduler_type", t.trl_value("lr_scheduler_type"),
                              scheduler_names())
    problems += _name_problem("train.optim", t.optim, optimizer_names())
    problems += override_problems(t.trl_overrides)
    problems += missing_packages(t.report_to)
    return problems


def validation_problems(config: Config) -> list[str]:
    """training_problems for `vlmrl config validate`, plus the rewards (each user function imported and its
    signature checked, as training would: vlmrl.grading.user_rewards); a checker that breaks is one more problem
    line, never a traceback (the command must answer in one line per problem)."""
    from vlmrl.grading.user_rewards import RewardError, check_data_columns, load_rewards

    try:
        problems = training_problems(config)
    except Exception as exc:  # noqa: BLE001  a checker that breaks must still answer in one line
        problems = [f"could not check the training settings: {type(exc).__name__}: {exc}".splitlines()[0]]
    from vlmrl.train.dynamic_sampling import settings_problem

    try:
        loaded = load_rewards(config)
        check_data_columns(config, loaded)  # each reward's arguments: columns the data will give
    except RewardError as exc:
        problems.append(str(exc))
    else:
        if problem := settings_problem(config.train.dynamic_sampling, [r.name for r in loaded]):
            problems.append(problem)
    return problems


def override_problems(overrides: dict) -> list[str]:
    """One line per `train.trl_overrides` entry TRL would refuse late or vlmrl would lose: a field vlmrl sets
    itself (naming the field to use), an unknown name, a value of the wrong type for the GRPOConfig field (read
    off the dataclass's annotations, no GRPOConfig built: that needs the device), vLLM asked for but absent."""
    from trl import GRPOConfig

    grpo = {f.name for f in dataclasses.fields(GRPOConfig)}
    first = first_class_fields()
    problems = []
    for key in sorted(overrides):
        field = TRL_NAMES.get(key, key)
        if key in first:
            problems.append(f"train.trl_overrides.{key}: set by vlmrl from {first[key]}; set it there instead")
        elif key in OWNED or key.startswith("hub_"):
            problems.append(f"train.trl_overrides.{key}: set by vlmrl ({OWNED.get(key, OWNED['push_to_hub'])}); "
                            "delete it")
        elif field not in grpo:
            close = difflib.get_close_matches(key, sorted(grpo), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append(f"train.trl_overrides.{key}: not a GRPOConfig field (TRL {package_version('trl')}){hint}")
        elif problem := _value_problem(field, overrides[key], GRPOConfig):
            problems.append(f"train.trl_overrides.{key}={quoted(overrides[key])}: {problem}")
    if overrides.get("use_vllm") is True and importlib.util.find_spec("vllm") is None:
        problems.append("train.trl_overrides.use_vllm: vLLM is not installed; drop use_vllm: vlmrl's own rollouts "
                        "(train.rollout: a static KV cache and compiled decoding on CUDA) need no vLLM")
    return problems


# GRPOConfig fields whose annotation is wider or narrower than the values TRL accepts: the values it accepts.
_CHOICES = {"scale_rewards": ("group", "batch", "none", True, False), "vllm_mode": ("server", "colocate")}
_STRICT = ConfigDict(strict=True, allow_inf_nan=False, arbitrary_types_allowed=True)


def _value_problem(field: str, value: object, grpo: type) -> str | None:
    """Why `value` does not fit GRPOConfig's `field`, or None. Strict: a true/false field takes only true or
    false and a number field takes no true/false, no text (TRL passes values on unconverted).

    >>> from trl import GRPOConfig
    >>> _value_problem("top_p", "x", GRPOConfig), _value_problem("top_p", 0.9, GRPOConfig)
    ('GRPOConfig.top_p is float: Input should be a valid number', None)
    >>> _value_problem("scale_rewards", 42, GRPOConfig)
    "GRPOConfig.scale_rewards takes one of 'group', 'batch', 'none', True, False"
    """
    if field in _CHOICES:
        choices = _CHOICES[field]
        if any(value is c or (type(value) is type(c) and value == c) for c in choices):
            return None
        return f"GRPOConfig.{field} takes one of {', '.join(map(repr, choices))}"
    hint = typing.get_type_hints(grpo)[field]
    try:
        TypeAdapter(hint, config=_STRICT).validate_python(value)
    except ValidationError as exc:
        name = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
        message = exc.errors(include_url=False)[0]["msg"]
        return f"GRPOConfig.{field} is {name}: {message}{_number_text(value)}"
    except Exception:  # noqa: BLE001  an annotation pydantic cannot check (a class of TRL's): TRL judges it
        return None
    return None


def _number_text(value: object) -> str:
    """The fix for a number YAML read as text (`1e-5`: YAML 1.1 wants a dot), else ''."""
    try:
        float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ""
    return " (YAML reads 1e-5 as text: write 1.0e-5)" if isinstance(value, str) else ""


def scheduler_names() -> list[str]:
    from transformers.trainer_utils import SchedulerType

    return [s.value for s in SchedulerType]


def optimizer_names() -> list[str]:
    from transformers.training_args import OptimizerNames

    return [o.value for o in OptimizerNames]


def _name_problem(field: str, value: str, known: list[str]) -> list[str]:
    """[] when `value` is known, else one line with the closest names.

    >>> _name_problem("train.optim", "adamw", ["adamw_torch", "sgd"])
    ["train.optim='adamw' is not a transformers name; did you mean 'adamw_torch'?"]
    """
    if value in known:
        return []
    close = difflib.get_close_matches(value, known, n=3, cutoff=0.5)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else f"choose one of {', '.join(known)}"
    return [f"{field}={value!r} is not a transformers name; {hint}"]


# ---- GSPO with a token-summing loss: said once, in our words ----------------------------------------------

_TRL_GSPO_WARNING = "When using `importance_sampling_level='sequence'`"


def gspo_loss_note(config: Config) -> str | None:
    """Why a GSPO config with a token-summing loss is what it is (TRL warns about it without the reason).

    >>> from vlmrl.config.schema import load_config
    >>> gspo_loss_note(load_config("gspo-paper")) is None
    True
    >>> "dr_grpo" in gspo_loss_note(load_config("demo"))
    True
    """
    t = config.train
    if t.algorithm != "gspo" or t.loss_type not in ("dr_grpo", "bnpo", "dapo"):
        return None
    return (f"train.algorithm=gspo with train.loss_type={t.loss_type}: the importance ratio is per sequence (GSPO), "
            "but the loss sums over tokens, so longer completions weigh more. The demo and seed presets keep this "
            "on purpose (the write-up's recipe, which trained well); for the GSPO paper's per-sequence objective "
            "use train.loss_type=grpo (preset gspo-paper).")


class _DropTrlGspoWarning:
    """A logging filter for TRL's one warning that vlmrl's note replaces; every other TRL message passes."""

    def filter(self, record) -> bool:
        return _TRL_GSPO_WARNING not in str(record.msg)  # accelerate's adapter prefixes `[RANK n] `


_FILTER = _DropTrlGspoWarning()


def quiet_trl_gspo_warning() -> None:
    """Install the filter on TRL's GRPO trainer logger (idempotent)."""
    import logging

    logger = logging.getLogger("trl.trainer.grpo_trainer")
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
