"""The run folder's layout: every file name in it, the fingerprints that say which config made a file, and
the "is this stage done?" checks. Stages ask here; no stage imports another to learn whether it is done.

```
<run>/config.yaml  env.json
      data/       train.jsonl  holdout.jsonl  dropped.jsonl  summary.json  images/
      baseline_records.jsonl  baseline_summary.json  (+ _swapped_ for the visual control)
      train/      metrics.jsonl  rollouts.jsonl  health.jsonl  validation.jsonl  summary.json
                  checkpoints/checkpoint-N/  final/  best/
      train.replaced-<UTC time>/   an earlier training, moved aside by a fresh start
      after_records.jsonl  after_summary.json  comparison.json
      adapter/  export.json  report.html
```

Public: the file-name constants, `records_file`, `summary_file`, `train_fingerprint`, `export_fingerprint`,
`rewards_fingerprint`, `checkpoint_fingerprint`, `read_holdout`, `is_prepared`, `eval_done`, `is_trained`,
`is_exported`, `best_checkpoint`, `set_aside_name`.
A fingerprint leaves out where the run lives (its name and folder), so a moved run folder resumes.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Container
from pathlib import Path
from typing import Any

from vlmrl.common.io import read_json, read_jsonl
from vlmrl.config.schema import OBSERVATION_FIELDS, Config, RewardSpec

CONFIG = "config.yaml"
ENV = "env.json"
DATA = "data"
TRAIN_ITEMS = "data/train.jsonl"
HOLDOUT = "data/holdout.jsonl"
DROPPED = "data/dropped.jsonl"
DATA_SUMMARY = "data/summary.json"
TRAIN = "train"
TRAIN_SUMMARY = "train/summary.json"
CHECKPOINTS = "train/checkpoints"
FINAL = "train/final"  # the trained adapter
BEST = "train/best"  # the kept best validation step's adapter
BEST_RECORD = "vlmrl_best.json"  # inside BEST: which step, metric and value, and the checkpoint fingerprint
CHECKPOINT_STAMP = "vlmrl_checkpoint.json"  # inside each checkpoint-N: {"fingerprint", "step"} of its training
LEGACY_STAMP = "vlmrl_fingerprint.json"  # inside CHECKPOINTS, before CHECKPOINT_STAMP: one for the whole folder
SET_ASIDE = "train.replaced-"  # + UTC time: the train/ of an earlier training, moved aside by a fresh start
METRICS = "train/metrics.jsonl"
ROLLOUTS = "train/rollouts.jsonl"
HEALTH = "train/health.jsonl"
VALIDATION = "train/validation.jsonl"
COMPARISON = "comparison.json"
ADAPTER = "adapter"  # the exported adapter
EXPORT = "export.json"
REPORT = "report.html"
ADAPTER_CONFIG = "adapter_config.json"  # PEFT's file: its presence makes a folder an adapter

STAGES = ("baseline", "after")  # the two evaluations
SWAPPED = "_swapped"  # the visual control's evaluations: baseline_swapped_records.jsonl, ...


class RunFolderError(RuntimeError):
    """A file a stage needs is missing or was made by another config; the message names it and the fix."""


def records_file(stage: str) -> str:
    """`baseline_records.jsonl`, `after_swapped_records.jsonl`, ..."""
    return f"{stage}_records.jsonl"


def summary_file(stage: str) -> str:
    return f"{stage}_summary.json"


def rewards_fingerprint(config: Config) -> str:
    """The `rewards:` entries plus the bytes of every user file behind them: a changed reward file means the
    trained adapter is stale."""
    parts: list[Any] = [spec.fingerprinted() for spec in config.rewards]
    for spec in config.rewards:
        path = reward_source_file(spec)
        parts.append(_sha256(path) if path else None)
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def reward_source_file(spec: RewardSpec) -> Path | None:
    """The file a user reward lives in (a `file.py:name` path, or a module's origin); None for a built-in."""
    if spec.file is not None:
        return Path(spec.resolved or spec.file)
    if spec.function is None:
        return None
    module = str(spec.function).rpartition(":")[0]
    if spec.resolved:  # a package beside the config file
        base = Path(spec.resolved, *module.split("."))
        return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return Path(found.origin) if found and found.origin else None


def train_fingerprint(config: Config) -> str:
    """What a trained adapter depends on (the run's name and folder are not part of it)."""
    return (config.fingerprint("model", "lora", "data", "train") + config.data_fingerprint()[:4]
            + rewards_fingerprint(config)[:4] + str(config.run.seed))


# Fields a resumed run may change: how long to train, how often to log, save or validate, and where to report.
RESUMABLE_CHANGES = ("max_steps", "num_train_epochs", "save_steps", "save_total_limit", "logging_steps",
                     *OBSERVATION_FIELDS["train"], "eval_every_steps", "eval_subset")


def checkpoint_fingerprint(config: Config) -> str:
    """What a checkpoint (and the kept best step) belongs to: the training config without RESUMABLE_CHANGES,
    so a run given more steps resumes its checkpoints while one with another learning rate does not."""
    train = {k: v for k, v in config.flat_train().items() if k not in RESUMABLE_CHANGES}
    data = {"train": train, "model": config.model.model_dump(mode="json"), "lora": config.lora.model_dump(mode="json"),
            "data": config.data_fingerprint(), "seed": config.run.seed, "rewards": rewards_fingerprint(config)}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def set_aside_name(stamp: str, taken: Container[str] = ()) -> str:
    """The folder an earlier train/ moves to: `train.replaced-<stamp>`, numbered when that name is taken.

    >>> set_aside_name("20260101-120000"), set_aside_name("20260101-120000", {"train.replaced-20260101-120000"})
    ('train.replaced-20260101-120000', 'train.replaced-20260101-120000-2')
    """
    name, number = f"{SET_ASIDE}{stamp}", 2
    while name in taken:
        name, number = f"{SET_ASIDE}{stamp}-{number}", number + 1
    return name


def export_fingerprint(config: Config) -> str:
    return train_fingerprint(config) + config.fingerprint("export")[:8]


def read_holdout(config: Config, run_dir: Path) -> list[dict]:
    """The held-out items of this config's prepared data; refused when missing, empty, or prepared by another."""
    path = run_dir / HOLDOUT
    if not path.exists():
        raise RunFolderError(f"{path}: no held-out set; run `vlmrl prepare` for this config first.")
    summary_path = run_dir / DATA_SUMMARY
    if summary_path.exists():
        recorded = read_json(summary_path).get("fingerprint")
        if recorded and recorded != config.data_fingerprint():
            raise RunFolderError(
                f"{path}: this held-out set was prepared with a different data config "
                f"(fingerprint {recorded} vs {config.data_fingerprint()}); re-run `vlmrl prepare` or use that run's config."
            )
    items = read_jsonl(path)
    if not items:
        raise RunFolderError(f"{path}: the held-out set is empty; check data.holdout_size and the drop report.")
    return items


def is_prepared(config: Config, run_dir: Path) -> bool:
    summary = run_dir / DATA_SUMMARY
    return (summary.exists() and (run_dir / HOLDOUT).exists()
            and read_json(summary).get("fingerprint") == config.data_fingerprint())


def eval_done(config: Config, run_dir: Path, stage: str) -> bool:
    """The stage's summary covers every held-out item, scored by this config's rewards."""
    summary = run_dir / summary_file(stage)
    if not summary.exists():
        return False
    try:
        made = read_json(summary)  # by these rewards too: else evaluate() rescores its records
        return made.get("n") == len(read_holdout(config, run_dir)) and made.get(
            "rewards_fingerprint") == rewards_fingerprint(config)
    except (OSError, ValueError, AttributeError, RunFolderError):  # unreadable or not ours: evaluate (again)
        return False


def is_trained(config: Config, run_dir: Path) -> bool:
    summary = run_dir / TRAIN_SUMMARY
    return ((run_dir / FINAL / ADAPTER_CONFIG).exists() and summary.exists()
            and read_json(summary).get("fingerprint") == train_fingerprint(config))


def is_exported(config: Config, run_dir: Path) -> bool:
    path = run_dir / EXPORT
    if not path.exists() or not (run_dir / ADAPTER / ADAPTER_CONFIG).exists():
        return False
    report = json.loads(path.read_text())
    return bool(report.get("all_passed")) and report.get("fingerprint") == export_fingerprint(config)


def best_checkpoint(run_dir: Path, config: Config | None = None) -> dict | None:
    """The kept best validation step (`train/best/vlmrl_best.json`), or None; with `config`, None also when
    it was kept by another training (its `fingerprint` is not this config's `checkpoint_fingerprint`)."""
    best = run_dir / BEST
    try:
        record = read_json(best / BEST_RECORD) if (best / ADAPTER_CONFIG).is_file() else None
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    if config is not None and record.get("fingerprint") != checkpoint_fingerprint(config):
        return None
    return record


def _sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:  # missing or unreadable: loading the rewards says which
        return None
