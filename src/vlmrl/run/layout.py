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
      stages.json  per stage: the settings and the input hashes its outputs were made from
```

Public: the file-name constants, `records_file`, `summary_file`, `train_fingerprint`, `export_fingerprint`,
`rewards_fingerprint`, `checkpoint_fingerprint`, `read_holdout`, `is_prepared`, `eval_done`, `is_trained`,
`is_exported`, `best_checkpoint`, `set_aside_name`; the stage record: `stage_identity`, `record_stage`,
`stage_changes`, `made_from_current_inputs`, `run_finished`, `mark_finished`, `train_change`, `file_digest`,
`folder_digest`.
A fingerprint leaves out where the run lives (its name and folder), so a moved run folder resumes.

A done-check asks two things: were the outputs made by this config's settings (its fingerprints), and from
the inputs the folder holds now (the hash of the adapter an evaluation or export used, of the data manifests
the baseline and the training read). `stages.json` records both for each stage `vlmrl run` runs. A stage run
by its own command since (or a run folder from before `stages.json`) falls back to file times: its outputs
must be newer than every input, so a new training is never followed by an old evaluation.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Container
from pathlib import Path
from typing import Any

from vlmrl.common.io import read_json, read_jsonl, write_json_atomic
from vlmrl.config.fingerprints import RESUMABLE_FIELDS, stage_values
from vlmrl.config.schema import Config, RewardSpec

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
SET_ASIDE = "train.replaced-"  # + UTC time: the train/ of an earlier training, moved aside by a fresh start
METRICS = "train/metrics.jsonl"
ROLLOUTS = "train/rollouts.jsonl"
HEALTH = "train/health.jsonl"
VALIDATION = "train/validation.jsonl"
COMPARISON = "comparison.json"
ADAPTER = "adapter"  # the exported adapter
EXPORT = "export.json"
REPORT = "report.html"
STAGES_FILE = "stages.json"  # per stage: its settings' fingerprint and its inputs' hashes (record_stage)
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
    parts: list[Any] = [stage_values(config, "rewards")]
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
    """What a trained adapter depends on (vlmrl.config.fingerprints.STAGE_FIELDS["train"]), the prepared data's
    and the rewards' fingerprints, and the seed: the parts `train_change` reads."""
    return (config.fingerprint("train") + config.data_fingerprint()[:4]
            + rewards_fingerprint(config)[:4] + str(config.run.seed))


def checkpoint_fingerprint(config: Config) -> str:
    """What a checkpoint (and the kept best step) belongs to: the training config without
    vlmrl.config.fingerprints.RESUMABLE_FIELDS,
    so a run given more steps resumes its checkpoints while one with another learning rate does not."""
    data = {**_training_settings(config), "rewards": rewards_fingerprint(config)}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _training_settings(config: Config) -> dict:
    return {"train": config.fingerprint("train", without=RESUMABLE_FIELDS), "data": config.data_fingerprint(),
            "seed": config.run.seed}


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


def eval_done(config: Config, run_dir: Path, stage: str, settings: dict | None = None) -> bool:
    """The stage's summary covers every held-out item, scored by this config's rewards, from the inputs the
    folder holds now (the holdout; after training, the adapter); with `settings`, its records were generated
    with those generation settings."""
    summary = run_dir / summary_file(stage)
    if not summary.exists():
        return False
    try:
        made = read_json(summary)  # by these rewards too: else evaluate() rescores its records
        if made.get("n") != len(read_holdout(config, run_dir)) or made.get(
                "rewards_fingerprint") != rewards_fingerprint(config):
            return False
        if settings is not None and records_settings(run_dir, stage) not in (None, settings):
            return False
        return made_from_current_inputs(config, run_dir, stage)
    except (OSError, ValueError, AttributeError, RunFolderError):  # unreadable or not ours: evaluate (again)
        return False


def records_settings(run_dir: Path, stage: str) -> dict | None:
    """The generation settings of the stage's first record (None: no record)."""
    records = read_jsonl(run_dir / records_file(stage))
    return records[0].get("generation") if records else None


def is_trained(config: Config, run_dir: Path) -> bool:
    summary = run_dir / TRAIN_SUMMARY
    return ((run_dir / FINAL / ADAPTER_CONFIG).exists() and summary.exists()
            and read_json(summary).get("fingerprint") == train_fingerprint(config)
            and made_from_current_inputs(config, run_dir, "train"))


def is_exported(config: Config, run_dir: Path) -> bool:
    path = run_dir / EXPORT
    if not path.exists() or not (run_dir / ADAPTER / ADAPTER_CONFIG).exists():
        return False
    report = json.loads(path.read_text())
    return (bool(report.get("all_passed")) and report.get("fingerprint") == export_fingerprint(config)
            and made_from_current_inputs(config, run_dir, "export"))


# --- the stage record (stages.json) ------------------------------------------------------------------------

# The file whose bytes stand for a stage's outputs: the record holds its digest, so a stage re-run by its own
# command since (which rewrites this file) is told apart from the outputs the record describes.
STAGE_OUTPUT = {"train": TRAIN_SUMMARY, "export": EXPORT,
                **{s + swap: summary_file(s + swap) for s in STAGES for swap in ("", SWAPPED)}}
# What each part of a stage's identity is, in the words a console line uses.
_PARTS = {"settings": "its settings", "rewards": "the rewards (an entry or the file behind one)",
          "holdout": "the held-out set (data/holdout.jsonl)",
          "train_items": "the training set (data/train.jsonl)", "adapter": "the adapter"}


def eval_fingerprint(config: Config) -> str:
    """What an evaluation's generations depend on besides its inputs: the model and eval sections, the seed,
    the output contract (the rewards are not part of it: records scored under others are rescored, not made again)."""
    return config.fingerprint("eval")


def stage_identity(config: Config, run_dir: Path, stage: str) -> dict[str, str | None]:
    """The settings fingerprint and the hash of every input `stage` reads: train, export, or an evaluation
    (baseline, after, and their _swapped twins)."""
    holdout = file_digest(run_dir / HOLDOUT)
    if stage == "train":  # checkpoint_fingerprint's parts: a run given more steps resumes, so it is the same training
        settings = hashlib.sha256(json.dumps(_training_settings(config), sort_keys=True).encode()).hexdigest()[:16]
        return {"settings": settings, "rewards": rewards_fingerprint(config),
                "train_items": file_digest(run_dir / TRAIN_ITEMS), "holdout": holdout}
    if stage == "export":
        source = run_dir / (FINAL if config.export.checkpoint == "last" else BEST)
        return {"settings": export_fingerprint(config), "adapter": folder_digest(source)}
    identity = {"settings": eval_fingerprint(config), "holdout": holdout}
    if stage.startswith("after"):
        identity["adapter"] = folder_digest(run_dir / FINAL)
    return identity


def record_stage(config: Config, run_dir: Path, stage: str, *, done: bool) -> None:
    """Write `stage`'s identity into stages.json: when it starts (`done` False: its partial outputs belong to
    these inputs) and when it ends (with the digest of its output file)."""
    record = read_stages(run_dir)
    record[stage] = {"identity": stage_identity(config, run_dir, stage),
                     "output": file_digest(run_dir / STAGE_OUTPUT[stage]) if done else None}
    write_json_atomic(run_dir / STAGES_FILE, record)


def read_stages(run_dir: Path) -> dict:
    try:
        record = read_json(run_dir / STAGES_FILE)
    except (OSError, ValueError):  # none yet, or damaged: every stage falls back to file times
        return {}
    return record if isinstance(record, dict) else {}


def stage_changes(config: Config, run_dir: Path, stage: str) -> list[str]:
    """What differs between the inputs `stage` last started or finished from (stages.json) and those of now:
    `["the adapter", ...]`; empty when nothing does or nothing is recorded."""
    entry = read_stages(run_dir).get(stage)
    if not isinstance(entry, dict) or not isinstance(entry.get("identity"), dict):
        return []
    old, new = entry["identity"], stage_identity(config, run_dir, stage)
    return [_PARTS.get(k, k) for k in new if old.get(k) != new[k]]


def made_from_current_inputs(config: Config, run_dir: Path, stage: str, *, partial: bool = False) -> bool:
    """Whether `stage`'s outputs were made from this config's settings and the inputs the folder holds now:
    by stages.json while it describes those outputs; else (a stage re-run by its own command, a folder from
    before stages.json) by file times, the output newer than every input. `partial`: outputs of a stage that
    did not finish count too (its records file stands for them when it has no summary yet)."""
    entry = read_stages(run_dir).get(stage)
    output = file_digest(run_dir / STAGE_OUTPUT[stage])
    if isinstance(entry, dict) and (entry.get("output") == output is not None or partial and output is None):
        return entry.get("identity") == stage_identity(config, run_dir, stage)
    made = run_dir / STAGE_OUTPUT[stage]
    if partial and output is None and stage not in ("train", "export"):  # an evaluation's records so far
        made = run_dir / records_file(stage)
    return made.is_file() and _newer_than_inputs(config, run_dir, stage, made)


def _newer_than_inputs(config: Config, run_dir: Path, stage: str, made: Path) -> bool:
    inputs = [run_dir / HOLDOUT]
    if stage == "train":
        inputs.append(run_dir / TRAIN_ITEMS)
    if stage == "export":
        inputs = [run_dir / (FINAL if config.export.checkpoint == "last" else BEST)]
    elif stage.startswith("after"):
        inputs.append(run_dir / FINAL)
    files = [p for path in inputs for p in ([path] if path.is_file() else path.glob("*")) if p.is_file()]
    return all(p.stat().st_mtime_ns <= made.stat().st_mtime_ns for p in files)


def run_finished(run_dir: Path, settings: str) -> bool:
    """Whether every stage of the run whose settings fingerprint is `settings` finished (`vlmrl run` got to its
    end); a run folder from before stages.json counts as finished when it holds a report."""
    if not (run_dir / STAGES_FILE).exists():
        return (run_dir / REPORT).is_file()
    return read_stages(run_dir).get("finished") == settings


def mark_finished(run_dir: Path, settings: str) -> None:
    record = read_stages(run_dir)
    record["finished"] = settings
    write_json_atomic(run_dir / STAGES_FILE, record)


def train_change(config: Config, run_dir: Path) -> str | None:
    """What differs between the finished training in `run_dir` and `config`'s, in words; None when nothing
    does (or nothing finished). Read from the parts of `train_fingerprint`."""
    try:
        recorded = str(read_json(run_dir / TRAIN_SUMMARY).get("fingerprint") or "")
    except (OSError, ValueError, AttributeError):
        return None
    mine = train_fingerprint(config)
    if not recorded or recorded == mine:
        return None
    if recorded[:16] != mine[:16]:
        return "its model, lora, data or train settings differ from this config's"
    if recorded[16:20] != mine[16:20]:
        return "its prepared data differs from this config's"
    if recorded[20:24] != mine[20:24]:
        return "it used other rewards (a reward entry or the file behind it changed)"
    return "it used another run.seed"


def file_digest(path: Path) -> str | None:
    """The sha256 (16 hex digits) of a file's bytes; None when it is missing or unreadable."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    except OSError:
        return None
    return digest.hexdigest()[:16]


def folder_digest(folder: Path) -> str | None:
    """An adapter folder's identity: the names and bytes of its files (top level); None when it holds no adapter."""
    if not (folder / ADAPTER_CONFIG).is_file():
        return None
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        digest.update(f"{path.name}\0{file_digest(path)}\0".encode())
    return digest.hexdigest()[:16]


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
