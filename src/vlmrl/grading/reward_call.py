"""One call of a reward function, bounded and isolated: whatever the user's code does, the run either gets one
finite number (or None) per completion or stops with one line naming the reward, and the item where one is at
fault.

`call_reward(fn, who, timeout_s=..., prompts=..., completions=..., kwargs=...)`:

- **Its own copies.** The function gets deep copies of the prompts, the completions and every keyword argument
  (the callables TRL passes, `log_extra` and `log_metric`, excepted), so a reward that edits its inputs changes
  neither the next reward's nor `rollouts.jsonl`. The expected length is taken before the call: a reward that
  empties `completions` cannot make a short answer look right.
- **A time limit.** The call runs in a thread of its own; after `timeout_s` seconds (`rewards[].timeout_s`)
  the run stops with `RewardError` and the thread is left behind (a Python thread cannot be stopped; the CLI
  exits at once). None calls the function in the caller's thread, unbounded (for code that needs the main
  thread, such as `signal.alarm`).
- **Checked values.** A list or tuple as long as the completions, each value None (TRL: no reward for this
  completion) or a real number that converts to a finite float. NaN, infinities, `10**400`, bools, strings:
  one line naming the reward, the position and the item's `id`.
- **Every way out is one line.** An exception, `sys.exit()` and `KeyboardInterrupt` raised by the function
  become `RewardError`; a real Ctrl-C (a SIGINT, which the main thread receives) still stops the run.

What a thread cannot bound, and a worker process would (docs/reliability.md says why vlmrl does not use one):
`os._exit()` or a crash in C code ends the whole process; code that holds the GIL in one C call (a
ten-billion-digit integer power) delays the time limit until that call returns; memory is not bounded.
"""

from __future__ import annotations

import contextvars
import copy
import signal
import threading
import traceback
from collections.abc import Callable
from typing import Any

from vlmrl.common.stats import finite
from vlmrl.config.schema import ConfigError


class RewardError(ConfigError):
    """A configured reward that cannot be used; the message names the reward and the problem."""


def call_reward(fn: Callable[..., Any], who: str, *, timeout_s: float | None, prompts: Any, completions: list,
                kwargs: dict[str, Any]) -> list[float | None]:
    """`fn(prompts=..., completions=..., **kwargs)` on copies, within `timeout_s`, its output checked."""
    expected = len(completions)
    ids = kwargs.get("id")
    hooks = {key: value for key, value in kwargs.items() if callable(value)}  # TRL's log_extra / log_metric
    own_prompts, own_completions, own_kwargs = _own_copies(prompts, completions,
                                                           {k: v for k, v in kwargs.items() if k not in hooks})
    out = _bounded(lambda: fn(prompts=own_prompts, completions=own_completions, **own_kwargs, **hooks),
                   who, timeout_s, _source_file(fn))
    return check_values(out, expected, who, ids if isinstance(ids, list | tuple) else None)


def check_values(out: Any, expected: int, who: str, ids: list | tuple | None = None) -> list[float | None]:
    """`out` as a list of floats and Nones, one per completion; RewardError naming the first bad value.

    >>> check_values([1, None, 0.5], 3, "r")
    [1.0, None, 0.5]
    >>> try:
    ...     check_values([1.0, float("nan")], 2, "r", ["a", "b"])
    ... except RewardError as exc:
    ...     print(exc)
    r returned nan (float) for completion 1 (item 'b'); each value must be a finite number, or None for no reward.
    """
    if not isinstance(out, list | tuple):
        raise RewardError(f"{who} returned {type(out).__name__}, not a list of numbers (one per completion).")
    if len(out) != expected:
        raise RewardError(f"{who} returned {len(out)} values for {expected} completions; return one per completion.")
    values: list[float | None] = []
    for position, value in enumerate(out):
        number = _as_finite_float(value)
        if number is None and value is not None:
            item = f" (item {ids[position]!r})" if ids is not None and position < len(ids) else ""
            shown = f"{value!r:.60}" + ("..." if len(repr(value)) > 60 else "")
            raise RewardError(f"{who} returned {shown} ({type(value).__name__}) for completion {position}{item}; each "
                              "value must be a finite number, or None for no reward.")
        values.append(number)
    return values


def _as_finite_float(value: Any) -> float | None:
    """The value as a finite float, else None (a bool is not a number here).

    >>> _as_finite_float(3), _as_finite_float(10**400), _as_finite_float(float("inf")), _as_finite_float(True)
    (3.0, None, None, None)
    """
    return float(value) if finite(value) else None


def _own_copies(prompts: Any, completions: list, kwargs: dict[str, Any]) -> tuple[Any, list, dict[str, Any]]:
    """Deep copies, sharing one memo so an image that is both in a prompt and in `images` is copied once; a
    value that cannot be copied (a handle, a lock) is handed over as it is."""
    memo: dict[int, Any] = {}
    copied_kwargs = {}
    for key, value in kwargs.items():
        try:
            copied_kwargs[key] = copy.deepcopy(value, memo)
        except Exception:  # noqa: BLE001  not copyable: the reward sees the original, as TRL would give it
            copied_kwargs[key] = value
    return copy.deepcopy(prompts, memo), copy.deepcopy(completions, memo), copied_kwargs


def _bounded(call: Callable[[], Any], who: str, timeout_s: float | None, source: str | None) -> Any:
    if timeout_s is None:
        return _in_caller_thread(call, who, source)
    outcome: dict[str, Any] = {}
    # a fresh thread has none of the caller's context variables, grad mode or CUDA device: it gets them
    thread = threading.Thread(target=contextvars.copy_context().run, args=(_in_thread, call, outcome, _torch_state()),
                              daemon=True, name=f"vlmrl-reward-{who[:40]}")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RewardError(f"{who} did not return within {timeout_s:g} s; make it faster, or raise this reward's "
                          "timeout_s (null: no limit). Re-running the same command resumes the run.")
    if "error" in outcome:
        raise _failure(outcome["error"], who, source) from None
    return outcome["value"]


def _in_caller_thread(call: Callable[[], Any], who: str, source: str | None) -> Any:
    """The call where the caller runs; a KeyboardInterrupt is the reward's unless a real SIGINT arrived meanwhile
    (then the user pressed Ctrl-C, and it stops the run as usual)."""
    signals: list[int] = []
    previous = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if callable(previous):
        signal.signal(signal.SIGINT, lambda number, frame: (signals.append(number), previous(number, frame)))
    try:
        return call()
    except KeyboardInterrupt as exc:
        if signals:
            raise
        raise _failure(exc, who, source) from None
    except BaseException as exc:  # noqa: BLE001  SystemExit and any error of the user's code: one line
        raise _failure(exc, who, source) from None
    finally:
        if callable(previous):
            signal.signal(signal.SIGINT, previous)


def _in_thread(call: Callable[[], Any], outcome: dict[str, Any], torch_state: tuple[bool, int | None]) -> None:
    try:
        _set_torch_state(torch_state)
        outcome["value"] = call()
    except BaseException as exc:  # noqa: BLE001  in this thread, SystemExit and KeyboardInterrupt are the reward's
        outcome["error"] = exc


def _torch_state() -> tuple[bool, int | None]:
    """The caller's grad mode and CUDA device (a reward model under `--gpus N` must stay on its rank's GPU)."""
    import torch

    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return torch.is_grad_enabled(), torch.cuda.current_device() if cuda else None


def _set_torch_state(state: tuple[bool, int | None]) -> None:
    import torch

    grad, device = state
    torch.set_grad_enabled(grad)
    if device is not None:
        torch.cuda.set_device(device)


def _failure(exc: BaseException, who: str, source: str | None) -> RewardError:
    if isinstance(exc, RewardError):
        return exc
    if isinstance(exc, SystemExit):
        return RewardError(f"{who} called sys.exit({exc.code!r}); a reward must return its values, not end the run.")
    text = " ".join(str(exc).split())
    where = [frame.lineno for frame in traceback.extract_tb(exc.__traceback__) if frame.filename == source]
    line = f" (line {where[-1]})" if where else ""
    return RewardError(f"{who} raised {type(exc).__name__}{': ' + text[:300] if text else ''}{line}")


def _source_file(fn: Callable[..., Any]) -> str | None:
    fn = getattr(fn, "fn", fn)  # user_rewards' adapter (columns, async) holds the user's function
    code = getattr(fn, "__code__", None) or getattr(type(fn).__call__, "__code__", None)
    return code.co_filename if code is not None else None
