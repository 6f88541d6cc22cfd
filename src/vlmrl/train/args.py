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

from vlmrl.common.provenance import package_version
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
    from vlmrl.grading.user_rewards import RewardError, load_rewards

    try:
        problems = training_problems(config)
    except Exception as exc:  # noqa: BLE001  a checker that breaks must still answer in one line
        problems = [f"could not check the training settings: {type(exc).__name__}: {exc}".splitlines()[0]]
    try:
        load_rewards(config)
    except RewardError as exc:
        problems.append(str(exc))
    return problems


def override_problems(overrides: dict) -> list[str]:
    from trl import GRPOConfig

    grpo = {f.name for f in dataclasses.fields(GRPOConfig)}
    first = first_class_fields()
    problems = []
    for key in sorted(overrides):
        if key in first:
            problems.append(f"train.trl_overrides.{key}: set by vlmrl from {first[key]}; set it there instead")
        elif TRL_NAMES.get(key, key) not in grpo:
            close = difflib.get_close_matches(key, sorted(grpo), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append(f"train.trl_overrides.{key}: not a GRPOConfig field (TRL {package_version('trl')}){hint}")
    return problems


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
