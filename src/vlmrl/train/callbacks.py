"""Training records and health monitors, as `transformers` callbacks around TRL's trainer.

- `MetricsRecorder` -> `train/metrics.jsonl`: every logged metric, one line per logging step, with the training's
  wall-clock seconds (`elapsed_s`) and the completion tokens generated so far (`rollout_tokens`), both counted on
  across a resume, so learning can be read against time and rollout cost, not only steps.
- `RolloutRecorder` -> `train/rollouts.jsonl`: every completion of every generation batch (item id, text, each
  reward, advantage, length, truncated), so an item's learning history can be followed.
- `TimeBudget`: `train.time_budget_minutes`, training stopped (and a checkpoint saved) once that much time is spent.
- `HealthMonitor`   -> `train/health.jsonl`: per-step gibberish / format / truncation / zero-variance rates and
  NaN checks, against the thresholds in `config.health`; crossing one warns, NaN/Inf saves and stops; and the
  rollout engine's mismatch with the loss pass (`vlmrl.engine.rollout.mismatch.MismatchWatch`: a jump or drift warns).
  Divergence stops in one line naming its cause: a non-finite loss or gradient norm, trainable weights that are
  not finite or beyond `WEIGHT_LIMIT` after an optimizer step, and (`divergence_line`, for the train stage) the
  errors a blown-up step raises later (non-finite sampling probabilities, an optimizer update that overflows).

Rollouts are read from TRL's own per-batch log (`trainer._logs`, filled for every generation batch whether or
not completions are printed) plus three columns our wrapped format reward adds through TRL's `log_extra`
hook: the item id, the completion length and whether it was truncated. Only the main process writes.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from vlmrl.common.io import append_jsonl, read_jsonl, write_jsonl_atomic
from vlmrl.common.progress import Say, step_line
from vlmrl.common.stats import finite
from vlmrl.contract import completion_text
from vlmrl.engine.rollout.mismatch import MismatchWatch
from vlmrl.grading.rewards import format_reward, is_degenerate
from vlmrl.run import layout

log = logging.getLogger(__name__)


def trim_records_after(run_dir: Path, step: int) -> None:
    """Drop record lines past `step` (written after the checkpoint a resume starts from), so a resumed run
    neither duplicates nor keeps rows from steps that are about to be re-done. An end-of-training summary row
    (`train_runtime`) goes too: the resumed run writes its own."""
    for name in (layout.METRICS, layout.ROLLOUTS, layout.HEALTH, layout.VALIDATION):
        path = run_dir / name
        if path.exists():
            rows = read_jsonl(path)
            kept = [r for r in rows if r.get("step", 0) <= step and "train_runtime" not in r]
            if len(kept) != len(rows) or path.read_bytes()[-1:] != b"\n":
                write_jsonl_atomic(path, kept)


ELAPSED = "elapsed_s"  # wall-clock seconds of training up to this logged step, earlier sessions of a resume included
ROLLOUT_TOKENS = "rollout_tokens"  # completion tokens generated up to this step (every process, every rollout)


class MetricsRecorder(TrainerCallback):
    """Every logged metric to metrics.jsonl (the console line per step is `TrainProgress`'s, below). Each step's
    row (and so the trackers, which see the same logs) also gets ELAPSED and, given the RolloutRecorder, ROLLOUT_TOKENS;
    a resumed run continues both from the last row kept (the rows past its checkpoint are trimmed before)."""

    def __init__(self, path: Path, recorder: RolloutRecorder | None = None):
        self.path = path
        self.recorder = recorder
        self._started: float | None = None
        self._seconds, self._tokens = 0.0, 0

    def on_train_begin(self, args, state, control, **kwargs):
        rows = [r for r in read_jsonl(self.path) if "train_runtime" not in r] if self.path.exists() else []
        last = rows[-1] if rows else {}
        self._seconds = float(last.get(ELAPSED) or 0.0) if finite(last.get(ELAPSED)) else 0.0
        self._tokens = int(last.get(ROLLOUT_TOKENS) or 0) - (self.recorder.tokens_generated if self.recorder else 0)
        self._started = time.perf_counter()

    def elapsed(self) -> float:
        """Wall-clock seconds of training so far, earlier sessions of a resume included (0 before it begins)."""
        return 0.0 if self._started is None else self._seconds + time.perf_counter() - self._started

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "train_runtime" not in logs and self._started is not None:
            logs[ELAPSED] = round(self.elapsed(), 3)
            if self.recorder is not None:
                logs[ROLLOUT_TOKENS] = self._tokens + self.recorder.tokens_generated
        if not (state.is_world_process_zero and logs):
            return
        append_jsonl(self.path, [{"step": state.global_step, "epoch": state.epoch, **logs}])


class TimeBudget(TrainerCallback):
    """`train.time_budget_minutes`: stop at the first optimizer step that ends past `seconds` of training, by the
    MetricsRecorder's clock (so a resumed run's earlier sessions count), and save a checkpoint there. Every process
    stops at the same step (the verdict is agreed across them)."""

    def __init__(self, seconds: float, clock: MetricsRecorder):
        self.seconds = seconds
        self.clock = clock
        self.stopped_at: int | None = None  # the step it stopped training at; None: it did not

    def on_step_end(self, args, state, control, model=None, **kwargs):
        spent = self.clock.elapsed() >= self.seconds and state.global_step < state.max_steps
        device = next(model.parameters()).device if model is not None else "cpu"
        if _any_process(spent, device):
            control.should_training_stop = True
            control.should_save = True
            self.stopped_at = state.global_step


class _RecordingReward:
    """A reward function that also reports id, length and truncation of each completion to TRL's log."""

    def __init__(self, fn: Callable[..., list[float]], recorder: RolloutRecorder):
        self.fn = fn
        self.recorder = recorder
        self.__name__ = fn.__name__  # TRL names reward columns after the function

    def __call__(self, completions, completion_ids=None, log_extra=None, **kwargs) -> list[float]:
        rewards = self.fn(completions=completions, completion_ids=completion_ids, log_extra=log_extra, **kwargs)
        if log_extra is not None and completion_ids is not None:
            stop = self.recorder.stop_ids
            limit = self.recorder.max_length
            log_extra("id", list(kwargs.get("id") or [None] * len(completions)))
            log_extra("length", [len(ids) for ids in completion_ids])
            log_extra("truncated", [bool(ids) and len(ids) >= limit and ids[-1] not in stop for ids in completion_ids])
        self.recorder.batches_scored += 1
        return rewards


class RolloutRecorder(TrainerCallback):
    def __init__(self, path: Path, contract: str = "seed"):
        self.path = path
        self.contract = contract  # the format its rows are checked against (when format_reward is not a reward)
        self.trainer: Any = None
        self.stop_ids: set[int] = set()
        self.max_length = 0
        self.batches_scored = 0
        self.batches_written = 0
        self.last_batch: list[dict] = []
        self.tokens_generated = 0  # completion tokens of every rollout written so far (all processes)

    def wrap(self, fn: Callable[..., list[float]]) -> _RecordingReward:
        return _RecordingReward(fn, self)

    def attach(self, trainer: Any) -> None:
        self.trainer = trainer
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        self.stop_ids = set(getattr(trainer, "eos_token_ids", None) or [tokenizer.eos_token_id])
        if tokenizer.pad_token_id is not None:
            self.stop_ids.add(tokenizer.pad_token_id)
        self.max_length = trainer.max_completion_length

    def on_substep_end(self, args, state, control, **kwargs):
        self._flush(state, step=state.global_step + 1)  # the optimizer step these rollouts feed

    def on_step_end(self, args, state, control, **kwargs):
        self._flush(state, step=state.global_step)  # already counted here

    def _flush(self, state, *, step: int) -> None:
        if self.trainer is None or self.batches_scored == self.batches_written:
            return
        self.batches_written = self.batches_scored
        logs = self.trainer._logs
        rewards = {name: list(values) for name, values in logs["rewards"].items()}
        extra = {name: list(values) for name, values in logs["extra"].items()}
        rows = []
        for i, completion in enumerate(logs["completion"]):
            text = completion_text(completion) or ""
            rows.append(
                {
                    "step": step,
                    "id": extra.get("id", [None] * (i + 1))[i],
                    "completion": text,
                    "rewards": {name: values[i] for name, values in rewards.items()},
                    "advantage": logs["advantages"][i],
                    "length": extra.get("length", [None] * (i + 1))[i],
                    "truncated": extra.get("truncated", [None] * (i + 1))[i],
                    "degenerate": is_degenerate(text),
                }
            )
            if "sampling" in extra:  # dynamic sampling (vlmrl.train.dynamic_sampling): what became of the group
                rows[-1].update(sampling=extra["sampling"][i], sampling_round=extra["sampling_round"][i])
        self.tokens_generated += sum(r["length"] for r in rows if isinstance(r["length"], int))
        self.last_batch = rows
        if state.is_world_process_zero:
            append_jsonl(self.path, rows)


MAX_FP16_OVERFLOWS = 8  # skipped fp16 steps in a row before a halt: each halves the scale, 2^8 in all
WEIGHT_LIMIT = 1e6  # |trainable weight| beyond this after a step is a blown-up update (LoRA's entries sit far below 1)
# a reward's log_metric("loss", nan): TRL logs an all-NaN metric as None, and a metric replaces the trainer's loss
REWARD_LOSS = ("a reward logged a non-finite metric named 'loss' through log_metric, which replaces the trainer's "
               "loss; give that metric another name")
# (what torch says, what it means) for the errors a blown-up step raises in the next step
DIVERGED = (("probability tensor contains either `inf`, `nan` or element < 0",
             "the policy's sampling probabilities are not finite (inf/nan): its weights blew up"),
            ("value cannot be converted to type float without overflow", "the optimizer's update overflowed"))


def too_high(learning_rate: float | None) -> str:
    """The likely cause of a divergence, and what to change."""
    now = f" (now {learning_rate:g})" if isinstance(learning_rate, float | int) else ""
    return f"learning rate too high? lower train.learning_rate{now}, or clip harder with a smaller train.max_grad_norm"


def trainable_weight_peak(model: Any) -> float:
    """The largest |value| among `model`'s trainable weights on this process (nan or inf when one is not finite)."""
    peaks = [p.detach().abs().amax().float() for p in model.parameters() if p.requires_grad and p.numel()]
    if not peaks:
        return 0.0
    return torch.stack([p.to(peaks[0].device) for p in peaks]).amax().item()


def _any_process(flag: bool, device: Any) -> bool:
    """`flag` on any process (FSDP shards the weights: every process must stop alike, or the others wait forever)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    value = torch.tensor([float(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def divergence_line(exc: BaseException, step: int, learning_rate: float) -> str | None:
    """One line for an error a diverged training raises (None: not one of those), naming the cause and the fix.

    >>> divergence_line(RuntimeError("value cannot be converted to type float without overflow"), 3, 1e300)[:62]
    "training diverged at step 3: the optimizer's update overflowed"
    """
    text = str(exc)
    for sign, cause in DIVERGED:
        if sign in text:
            return f"training diverged at step {step}: {cause}; {too_high(learning_rate)}."
    return None


class HealthMonitor(TrainerCallback):
    """Per-step health of the policy: warns on thresholds, stops on NaN/Inf or persistent gibberish."""

    def __init__(self, config: Any, path: Path, console: Callable[[str], None] | None = None):
        self.config = config
        self.path = path
        self.console = console
        self.recorder: RolloutRecorder | None = None
        self.halted: str | None = None
        self.warning_count = 0
        self._gibberish_streak = 0
        self._overflow_streak = 0  # fp16 steps in a row whose gradients overflowed (the loss scaler skipped them)
        self._mismatch = MismatchWatch()  # the rollout engine against the loss pass (vlmrl.engine.rollout.mismatch)
        self._weights: str | None = None  # the trainable weights' state after this step's update, when broken

    def attach(self, recorder: RolloutRecorder) -> None:
        self.recorder = recorder

    def on_step_end(self, args, state, control, model=None, **kwargs):
        """After the optimizer step, before the next generation samples from the weights it wrote."""
        if model is None:
            return control
        peak = trainable_weight_peak(model)
        bad = not math.isfinite(peak) or peak > WEIGHT_LIMIT
        if _any_process(bad, next(model.parameters()).device):
            self._weights = (f"non-finite trainable weights ({peak:g})" if not math.isfinite(peak) else
                             f"trainable weights blew up (|w| up to {peak:.3g}, beyond {WEIGHT_LIMIT:g})" if bad
                             else "trainable weights blew up on another process")
            # on_log, next, says it, unless a non-finite loss or gradient norm of the same step is the cause
            self.halted = f"{self._weights} after the update; {too_high(getattr(args, 'learning_rate', None))}"
            control.should_training_stop = True
            control.should_save = False  # not even a scheduled one: these weights are no state to resume
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "train_runtime" in logs:  # the end-of-training summary, not a step
            return control
        row: dict[str, Any] = {"step": state.global_step}
        batch = self.recorder.last_batch if self.recorder else []
        row.update(batch_health(batch, group_size=args.num_generations, weights=args.reward_weights,
                                contract=self.recorder.contract if self.recorder else "seed"))
        for key in ("loss", "grad_norm"):
            if key in logs:
                row[key] = logs[key]
        warnings = self._check(row, fp16=bool(getattr(args, "fp16", False))) + self._mismatch.check(logs)
        warnings += [self._weights] if self._weights else []  # found at the step's end (on_step_end)
        row["warnings"] = warnings
        if fatal := [w for w in warnings if w.startswith("non-finite") and w != self._weights]:
            cause = (REWARD_LOSS if "loss" in logs and logs["loss"] is None and fatal[0].startswith("non-finite loss")
                     else "" if "cannot recover" in fatal[0] else too_high(getattr(args, "learning_rate", None)))
            self.halted = f"{fatal[0]}; {cause}" if cause else fatal[0]
            control.should_save = True
            control.should_training_stop = True
        if self.config.stop_on_gibberish_steps and self._gibberish_streak >= self.config.stop_on_gibberish_steps:
            self.halted = (f"gibberish rate above {self.config.max_gibberish_rate} for {self._gibberish_streak} "
                           "steps: the policy is collapsing")
            control.should_save = True
            control.should_training_stop = True
        if self.halted:
            row["halted"] = self.halted
        if state.is_world_process_zero:
            append_jsonl(self.path, [row])
            for warning in warnings:
                self.warning_count += 1
                if self.console:
                    self.console(f"[health] step {state.global_step}: {warning}")
                else:
                    log.warning("step %d: %s", state.global_step, warning)
        return control

    def _check(self, row: dict, *, fp16: bool = False) -> list[str]:
        c = self.config
        warnings = []
        overflow = fp16 and not finite(row.get("grad_norm", 0.0)) and finite(row.get("loss", 0.0))
        self._overflow_streak = self._overflow_streak + 1 if overflow else 0
        if overflow:  # fp16: accelerate's loss scaler skipped the update and lowers its scale; weights unchanged
            row["fp16_overflow"] = True
            warnings.append(f"fp16 overflow: the loss scaler skipped this step's update ({self._overflow_streak} in a row)")
        for key in ("loss", "grad_norm"):
            if key in row and not finite(row[key]) and not (overflow and key == "grad_norm"):
                warnings.append(f"non-finite {key} ({row[key]})")
        if self._overflow_streak >= MAX_FP16_OVERFLOWS:
            warnings.append(f"non-finite grad_norm in {self._overflow_streak} fp16 steps in a row: the loss scaler "
                            "cannot recover (try model.dtype=bfloat16 on a card that has it)")
        if row.get("n"):
            if row["gibberish_rate"] > c.max_gibberish_rate:
                warnings.append(f"gibberish rate {row['gibberish_rate']:.2f} > {c.max_gibberish_rate}")
                self._gibberish_streak += 1
            else:
                self._gibberish_streak = 0
            if row["format_rate"] < c.min_format_rate:
                warnings.append(f"format compliance {row['format_rate']:.2f} < {c.min_format_rate}")
            if row["truncation_rate"] > c.max_truncation_rate:
                warnings.append(f"truncation rate {row['truncation_rate']:.2f} > {c.max_truncation_rate}")
            if row["zero_variance_groups"] > c.max_zero_variance_groups:
                warnings.append(f"zero-variance groups {row['zero_variance_groups']:.2f} > {c.max_zero_variance_groups}")
        return warnings


def reward_never_varied(health_path: Path) -> bool:
    """Every recorded step's every group scored its completions alike (health.jsonl's zero_variance_groups 1.0):
    every advantage was zero, so nothing trained. False when no step recorded a batch."""
    rows = [r for r in read_jsonl(health_path) if r.get("n")] if health_path.exists() else []
    return bool(rows) and all(r.get("zero_variance_groups") == 1.0 for r in rows)


def nothing_learned_line(contract: str) -> str:
    """The one line said when no reward varied: why nothing trained, and what to change."""
    return ("train: no reward varied within any group at any step (zero-variance groups 1.00), so every advantage "
            "was zero and nothing trained: the adapter is unchanged from its initialisation. Use a reward that "
            "varies between a prompt's completions (partial credit), and check that the policy writes the answer "
            f"form the rewards read (contract: {contract}; see {layout.ROLLOUTS}).")


def batch_health(rows: list[dict], *, group_size: int, weights: list[float] | None = None,
                 contract: str = "seed") -> dict:
    """Rates over one generation batch of rollout rows (consecutive `group_size` rows share a prompt); the
    format rate is the share of completions well-formed under `contract`."""
    if not rows:
        return {"n": 0}
    n = len(rows)
    weights = weights or [1.0] * len(rows[0]["rewards"])
    # TRL logs a None reward as NaN and leaves it out of the total: so do we
    totals = [sum(w * v for w, v in zip(weights, r["rewards"].values()) if finite(v)) for r in rows]
    # the format rate is about the completions, whether or not format_reward is one of the configured rewards
    formats = [r["rewards"]["format_reward"] if "format_reward" in r["rewards"]
               else format_reward([r.get("completion") or ""], contract=contract)[0] for r in rows]
    groups = [totals[i : i + group_size] for i in range(0, n, group_size)]
    lengths = [r["length"] for r in rows if r.get("length") is not None]
    mean_total = sum(totals) / n
    return {
        "n": n,
        "gibberish_rate": sum(r["degenerate"] for r in rows) / n,
        "format_rate": sum(f == 2.0 for f in formats) / n,
        "truncation_rate": sum(bool(r.get("truncated")) for r in rows) / n,
        "mean_length": sum(lengths) / len(lengths) if lengths else None,
        "zero_variance_groups": sum(max(g) == min(g) for g in groups) / len(groups),
        "reward_mean": mean_total,
        "reward_std": math.sqrt(sum((t - mean_total) ** 2 for t in totals) / n),
    }


class TrainProgress(TrainerCallback):
    """Rich bar on a terminal console, else one `step_line` per logged step through `say`."""

    def __init__(self, console: Any = None, say: Say | None = None, recorder: Any = None):
        self.console = console
        self.say = say
        self.recorder = recorder  # a RolloutRecorder: its last batch gives the format rate
        self.rich = console is not None and console.is_terminal
        self._bar: Any = None
        self._task: Any = None
        self._started = 0.0
        self._first_step = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self._started, self._first_step = time.perf_counter(), state.global_step
        if self.rich and state.is_world_process_zero:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[line]}"), console=self.console, transient=False)
            self._bar.start()
            self._task = self._bar.add_task("train", total=state.max_steps, completed=state.global_step, line="")

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if not state.is_world_process_zero or "train_runtime" in logs:
            return
        done = state.global_step - self._first_step
        per_step = (time.perf_counter() - self._started) / done if done > 0 else None
        # a value TRL logs as null (an all-NaN metric) or a reward's odd one is shown as nan, never a traceback
        shown = {k: v if isinstance(v, numbers.Real) else math.nan for k, v in logs.items() if k in ("reward", "loss")}
        line = step_line(state.global_step, state.max_steps, per_step, shown, self._format_rate(args))
        if self._bar is not None:
            self._bar.update(self._task, completed=state.global_step, line=line.split(")", 1)[-1].strip())
        elif self.say:
            self.say(line)

    def on_train_end(self, args, state, control, **kwargs):
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def _format_rate(self, args) -> float | None:
        rows = getattr(self.recorder, "last_batch", None)
        contract = getattr(self.recorder, "contract", "seed")
        return batch_health(rows, group_size=args.num_generations, contract=contract).get("format_rate") if rows else None
