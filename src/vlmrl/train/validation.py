"""Validation during training: every `train.eval_every_steps` optimizer steps, the first `train.eval_subset`
held-out items are decoded greedily and scored with evaluation's own record and summary code.

Each validation appends one row to `train/validation.jsonl`: the step, the item count and, for each metric,
its mean and 95% bootstrap interval (a 32-item subset has wide intervals, and the row says how wide). The same
means go to the trackers (`eval/<metric>`, transformers' name for held-out numbers), and each configured reward,
the user's own included, goes to both (`rewards` in the row, `eval/rewards/<name>/mean` in the trackers). With `export.checkpoint: best` the adapter of the best step so
far (by `export.checkpoint_metric`) is kept in `train/best/` with `vlmrl_best.json` naming step, value and the
training's checkpoint fingerprint (a best/ of another training is ignored).

Greedy and a fixed subset, so two rows differ only by the weights. Left out: sampled validation and pass@k
(`vlmrl eval` does those on the whole held-out set), and compiled decoding (its warm-up would cost more than a
32-item subset saves). Under several processes every rank decodes the same subset (the model may be sharded);
only rank 0 writes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from vlmrl.common.io import append_jsonl, write_json_atomic
from vlmrl.config.schema import Config
from vlmrl.data.items import open_record_images
from vlmrl.engine.rollout.generation import generate_batch
from vlmrl.evaluate.stage import make_record, summarize
from vlmrl.grading.user_rewards import load_rewards
from vlmrl.run import layout
from vlmrl.run.layout import BEST_RECORD, read_holdout, rewards_fingerprint
from vlmrl.train.trackers import log_to_trackers

log = logging.getLogger(__name__)

METRICS = ("accuracy", "mathvista_accuracy", "format_compliance", "total_reward", "format_reward",
           "correctness_reward")


def validation_row(step: int, summary: dict, seconds: float) -> dict:
    """One validation.jsonl row from an evaluation summary: each metric as {mean, ci95}.

    >>> s = {"n": 2, **{m: {"mean": 0.5, "ci95": [0.0, 1.0]} for m in METRICS}, "truncation_rate": 0.0}
    >>> row = validation_row(4, s, 1.234)
    >>> row["step"], row["n"], row["accuracy"], row["seconds"]
    (4, 2, {'mean': 0.5, 'ci95': [0.0, 1.0]}, 1.23)
    """
    row: dict[str, Any] = {"step": step, "n": summary["n"]}
    row.update({m: summary[m] for m in METRICS})
    row["rewards"] = summary.get("rewards") or {}  # every configured reward alone, the user's too
    row["truncation_rate"] = summary["truncation_rate"]
    row["seconds"] = round(seconds, 2)
    return row


def tracker_scalars(row: dict) -> dict[str, float]:
    """A validation row's means under transformers' held-out names: `eval_<metric>`, and each configured
    reward as `eval_rewards/<name>/mean` (shown as `eval/rewards/<name>/mean`, beside TRL's `rewards/<name>/mean`).

    >>> tracker_scalars({"rewards": {"brevity": {"mean": 0.5}}, **{m: {"mean": 1.0} for m in METRICS}})["eval_rewards/brevity/mean"]
    0.5
    """
    scalars = {f"eval_{m}": row[m]["mean"] for m in METRICS}
    scalars.update({f"eval_rewards/{name}/mean": stat["mean"] for name, stat in (row.get("rewards") or {}).items()
                    if stat.get("mean") is not None})
    return scalars


class ValidationCallback(TrainerCallback):
    def __init__(self, config: Config, run_dir: Path, *, processor: Any, trackers: list[Any] | None = None,
                 say: Callable[[str], None] | None = None, base_record: dict | None = None):
        self.config = config
        self.run_dir = run_dir
        self.processor = processor
        self.trackers = trackers or []
        self.say = say
        self.base_record = base_record
        self.every = config.train.eval_every_steps or 0
        self.items = read_holdout(config, run_dir)[: config.train.eval_subset]
        self.path = run_dir / layout.VALIDATION
        self.best_dir = run_dir / layout.BEST
        self.keep_best = config.export.checkpoint == "best"
        self.metric = config.export.checkpoint_metric
        self.best_key = layout.checkpoint_fingerprint(config)  # best/ is this training's only with this stamp
        self.best = layout.best_checkpoint(run_dir, config) if self.keep_best else None
        self.rows = 0
        # scored with the run's configured rewards, as evaluation is (not the defaults make_record falls back on)
        self.rewards, self.rewards_key = load_rewards(config), rewards_fingerprint(config)
        self.settings = {"max_new_tokens": config.eval.max_new_tokens, "do_sample": False, "temperature": None,
                         "num_samples": 1, "model": config.model.name, "adapter": "training"}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if not self.every or state.global_step % self.every or model is None:
            return control
        started = time.perf_counter()
        summary = self.evaluate(model)
        row = validation_row(state.global_step, summary, time.perf_counter() - started)
        self.rows += 1
        if state.is_world_process_zero:
            append_jsonl(self.path, [row])
            log_to_trackers(self.trackers, args, state, control, tracker_scalars(row))
            if self.say:
                self.say(_describe(row))
            if self.keep_best:
                self._keep_if_best(model, row)
        return control

    def evaluate(self, model: Any) -> dict:
        """Greedy decoding of the subset with the weights as they are now; the model's mode is restored."""
        was_training = model.training
        model.eval()
        records, size = [], self.config.eval.batch_size
        try:
            with torch.no_grad():
                for start in range(0, len(self.items), size):
                    batch = self.items[start : start + size]
                    t0 = time.perf_counter()
                    images = [open_record_images(self.run_dir, i) for i in batch]
                    generations = generate_batch(
                        model, self.processor, [i["prompt"] for i in batch], images,
                        max_new_tokens=self.config.eval.max_new_tokens, do_sample=False,
                        systems=[i.get("system") for i in batch],
                    )
                    seconds = (time.perf_counter() - t0) / len(batch)
                    records += [make_record(item, gens, self.settings, seconds, "validation", rewards=self.rewards,
                                            image=imgs, rewards_key=self.rewards_key, contract=self.config.contract)
                                for item, gens, imgs in zip(batch, generations, images)]
        finally:
            model.train(was_training)
        return summarize(records, stage="validation", seed=self.config.run.seed)

    def _keep_if_best(self, model: Any, row: dict) -> None:
        value = row[self.metric]["mean"]
        if self.best is not None and value <= self.best["value"]:
            return  # ties keep the earlier step: fewer updates for the same score
        (self.best_dir / BEST_RECORD).unlink(missing_ok=True)  # a kill mid-save leaves no record, not a wrong one
        model.save_pretrained(str(self.best_dir))
        if self.base_record:
            write_json_atomic(self.best_dir / "vlmrl_base.json", self.base_record)
        self.best = {"step": row["step"], "metric": self.metric, "value": value, "ci95": row[self.metric]["ci95"],
                     "fingerprint": self.best_key}
        write_json_atomic(self.best_dir / BEST_RECORD, self.best)  # last: its presence means best/ is whole

    def summary(self) -> dict:
        return {"every_steps": self.every, "items": len(self.items), "rows": self.rows,
                "file": str(self.path), "best": self.best}


def _describe(row: dict) -> str:
    """One line for the console.

    >>> r = {"step": 2, "n": 8, **{m: {"mean": 0.25, "ci95": [0.0, 0.5]} for m in METRICS}, "seconds": 3.0}
    >>> _describe(r)
    'validation step 2 (8 items, 3.0 s): accuracy 0.250 [0.000, 0.500]  format 0.250 [0.000, 0.500]  reward 0.250'
    """
    acc, fmt = row["accuracy"], row["format_compliance"]
    return (f"validation step {row['step']} ({row['n']} items, {row['seconds']} s): "
            f"accuracy {acc['mean']:.3f} [{acc['ci95'][0]:.3f}, {acc['ci95'][1]:.3f}]  "
            f"format {fmt['mean']:.3f} [{fmt['ci95'][0]:.3f}, {fmt['ci95'][1]:.3f}]  "
            f"reward {row['total_reward']['mean']:.3f}")
