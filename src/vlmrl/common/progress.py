"""Progress a person can read: training's step, ETA, reward, format rate and seconds per step, and a count for
the slow preparation steps (data, image normalisation, building the demo policy).

On a terminal, training is a rich progress bar that redraws in place; anywhere else (a log file, CI, a pipe)
each logged step is one plain line: no colour codes, no carriage returns, never wrapped, so `grep step` on a
log gives one row per step. Stage progress (`Ticker`) goes to whatever sink the CLI set (`set_sink`), at most
every few seconds, and is silent for library callers that set none.

The training display itself is a trainer callback, `vlmrl.train.callbacks.TrainProgress` (this module imports no
transformers: the CLI sets the sink at start-up). Left out: progress for evaluation (the CLI draws that bar itself) and a distributed view (rank 0 reports).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

Say = Callable[[str], None]
_sink: Say | None = None


def set_sink(say: Say | None) -> None:
    """Where `Ticker` lines go (None: nowhere)."""
    global _sink
    _sink = say


def clock(seconds: float) -> str:
    """H:MM:SS.

    >>> clock(3725.4), clock(9)
    ('1:02:05', '0:00:09')
    """
    seconds = max(0, round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def step_line(step: int, max_steps: int, seconds_per_step: float | None, logs: dict, format_rate: float | None) -> str:
    """One plain progress line for a logged training step.

    >>> step_line(2, 4, 1.5, {"reward": 0.4123, "loss": 0.01}, 0.75)
    'step 2/4 (50%)  eta 0:00:03  1.50 s/step  reward 0.412  format 0.75  loss 0.0100'
    >>> step_line(1, 4, None, {}, None)
    'step 1/4 (25%)  eta ?  ? s/step  reward ?  format ?'
    """
    pct = f"{100 * step / max_steps:.0f}%" if max_steps > 0 else "?"
    eta = clock((max_steps - step) * seconds_per_step) if seconds_per_step is not None and max_steps > 0 else "?"
    rate = f"{seconds_per_step:.2f}" if seconds_per_step is not None else "?"
    reward = f"{logs['reward']:.3f}" if "reward" in logs else "?"
    fmt = f"{format_rate:.2f}" if format_rate is not None else "?"
    line = f"step {step}/{max_steps} ({pct})  eta {eta}  {rate} s/step  reward {reward}  format {fmt}"
    return line + (f"  loss {logs['loss']:.4f}" if "loss" in logs else "")


class Ticker:
    """Counts a slow loop and reports `label: done/total (eta)` every `every` seconds and at the end.

    >>> lines = []
    >>> set_sink(lines.append)
    >>> t = Ticker("images", 3, every=0)
    >>> for _ in range(3): t.advance()
    >>> set_sink(None)
    >>> lines[-1].startswith("images: 3/3")
    True
    """

    def __init__(self, label: str, total: int, *, every: float = 5.0):
        self.label, self.total, self.every = label, total, every
        self.done = 0
        self._started = self._last = time.perf_counter()

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if _sink is None or (now - self._last < self.every and self.done < self.total):
            return
        self._last = now
        elapsed = now - self._started
        eta = clock(elapsed / self.done * (self.total - self.done)) if self.done else "?"
        _sink(f"{self.label}: {self.done}/{self.total}  elapsed {clock(elapsed)}  eta {eta}")


def counter(label: str, *, every: float = 5.0) -> Callable[[int, int], None]:
    """A `(done, total)` callback that feeds a Ticker, for loops that report their own counts."""
    ticker: list[Ticker] = []

    def update(done: int, total: int) -> None:
        if not ticker:
            ticker.append(Ticker(label, total, every=every))
        ticker[0].advance(done - ticker[0].done)

    return update


class EvalProgress:
    """Evaluation progress, `(done, total, tokens)` per batch: a rich bar with tokens/s on a terminal, else a
    plain line every few seconds and at the end."""

    def __init__(self, console: Any, label: str, *, every: float = 5.0):
        self.console, self.label, self.every = console, label, every
        self.rich = console.is_terminal
        self._bar: Any = None
        self._task: Any = None
        self._started: float | None = None
        self._last = 0.0

    def __call__(self, done: int, total: int, tokens: int) -> None:
        now = time.perf_counter()
        if self._started is None:
            self._started = self._last = now
            if self.rich:
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    TextColumn,
                    TimeElapsedColumn,
                )

                self._bar = Progress(TextColumn(f"eval {self.label}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TextColumn("{task.fields[rate]}"), console=self.console)
                self._bar.start()
                self._task = self._bar.add_task("eval", total=total, rate="")
        elapsed = max(now - self._started, 1e-6)
        rate = f"{tokens / elapsed:.1f} tok/s"
        if self._bar is not None:
            self._bar.update(self._task, completed=done, rate=rate)
            if done >= total:
                self._bar.stop()
        elif done >= total or now - self._last >= self.every:
            self._last = now
            self.console.print(f"eval {self.label}: {done}/{total}  elapsed {clock(elapsed)}  {rate}",
                               highlight=False, markup=False, soft_wrap=True)
