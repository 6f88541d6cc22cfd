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
  exits at once, ending the process itself when the call started threads Python would wait for at exit:
  `left_behind`). None calls the function in the caller's thread, unbounded (for code that needs the main
  thread, such as `signal.alarm`).
- **Checked values.** A list or tuple (or a 1-D numpy array or torch tensor, as TRL takes) as long as the
  completions, each value None (TRL: no reward for this completion) or a real number within +-`MAX_REWARD`
  (1e9). NaN, infinities, `1e308`, `10**400`, bools, strings: one line naming the reward, the position and
  the item's `id`.
- **Every way out is one line.** An exception, `sys.exit()` and `KeyboardInterrupt` raised by the function
  become `RewardError`; a real Ctrl-C (a SIGINT, which the main thread receives) still stops the run.
- **The import too.** `bounded_import` runs a reward module's import under the same time limit, and turns
  `os._exit()` called there into `RewardError` (user_rewards says every other failure in one line).

What a thread cannot bound, and a worker process would (docs/reliability.md says why vlmrl does not use one):
`os._exit()` or a crash in C code ends the whole process; code that holds the GIL in one C call (a
ten-billion-digit integer power) delays the time limit until that call returns; memory is not bounded.
"""

from __future__ import annotations

import contextvars
import copy
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

from vlmrl.common.stats import finite
from vlmrl.config.schema import ConfigError


class RewardError(ConfigError):
    """A configured reward that cannot be used; the message names the reward and the problem."""


# The largest reward taken: far above any sensible score, small enough that, times the
# config's largest weight (1e6), TRL's float32 statistics over a batch (its group std squares the totals) and
# vlmrl's means stay finite.
MAX_REWARD = 1e9
_LEFT_BEHIND: list[threading.Thread] = []  # threads started by calls that ran past their limit


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
    """`out` as a list of floats and Nones, one per completion; RewardError naming the first bad value. A 1-D
    numpy array or torch tensor (which TRL accepts too) counts as the list of its values.

    >>> check_values([1, None, 0.5], 3, "r")
    [1.0, None, 0.5]
    >>> try:
    ...     check_values([1.0, 1e308], 2, "r", ["a", "b"])
    ... except RewardError as exc:
    ...     print(exc)
    r returned 1e+308 (float) for completion 1 (item 'b'); each value must be a finite number within +-1,000,000,000, or None for no reward.
    """
    out = _as_list(out, who)
    if len(out) != expected:
        raise RewardError(f"{who} returned {len(out)} values for {expected} completions; return one per completion.")
    values: list[float | None] = []
    for position, value in enumerate(out):
        number = _as_finite_float(value)
        if number is None and value is not None:
            item = f" (item {ids[position]!r})" if ids is not None and position < len(ids) else ""
            shown = f"{value!r:.60}" + ("..." if len(repr(value)) > 60 else "")
            raise RewardError(f"{who} returned {shown} ({type(value).__name__}) for completion {position}{item}; each "
                              f"value must be a finite number within +-{MAX_REWARD:,.0f}, or None for no reward.")
        values.append(number)
    return values


def _as_list(out: Any, who: str) -> list | tuple:
    """A list or tuple as it is; a numpy array or a torch tensor of one dimension as the list of its values."""
    if isinstance(out, list | tuple):
        return out
    module = type(out).__module__.split(".")[0]
    if module in ("numpy", "torch") and hasattr(out, "tolist") and hasattr(out, "ndim"):
        if out.ndim == 1:
            return out.detach().cpu().tolist() if module == "torch" else out.tolist()
        raise RewardError(f"{who} returned a {out.ndim}-D {type(out).__name__} of shape {tuple(out.shape)}; return "
                          "one value per completion (a list, or a 1-D array or tensor).")
    raise RewardError(f"{who} returned {type(out).__name__}, not a list of numbers (one per completion).")


def _as_finite_float(value: Any) -> float | None:
    """The value as a finite float within +-MAX_REWARD, else None (a bool is not a number here); a numpy or
    torch scalar counts as its value.

    >>> _as_finite_float(3), _as_finite_float(10**400), _as_finite_float(float("inf")), _as_finite_float(True)
    (3.0, None, None, None)
    """
    if type(value).__module__.split(".")[0] in ("numpy", "torch") and getattr(value, "ndim", None) == 0:
        value = value.item()
    return float(value) if finite(value) and abs(value) <= MAX_REWARD else None


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
    late = (f"{who} did not return within {timeout_s:g} s; make it faster, or raise this reward's timeout_s "
            "(null: no limit). Re-running the same command resumes the run.")

    def attempt() -> tuple[bool, Any]:  # the reward's own exceptions returned: a Ctrl-C while waiting stays one
        try:
            return True, call()
        except BaseException as exc:  # noqa: BLE001  SystemExit and any error of the user's code: one line
            return False, exc

    returned, value = in_own_thread(attempt, timeout_s, late, name=f"vlmrl-reward-{who[:40]}")
    if not returned:
        raise _failure(value, who, source) from None
    return value


def in_own_thread(call: Callable[[], Any], timeout_s: float, late: str, *, name: str) -> Any:
    """`call()` in a daemon thread joined for `timeout_s` seconds: its value, or whatever it raised (SystemExit,
    KeyboardInterrupt, GeneratorExit included) re-raised here, or RewardError(`late`) when it is still running.
    A call left running is noted with the threads it started meanwhile (`left_behind`)."""
    outcome: dict[str, Any] = {}
    before = set(threading.enumerate())
    # a fresh thread has none of the caller's context variables, grad mode or CUDA device: it gets them
    thread = threading.Thread(target=contextvars.copy_context().run, args=(_in_thread, call, outcome, _torch_state()),
                              daemon=True, name=name)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        _LEFT_BEHIND.extend(t for t in threading.enumerate() if t not in before and t is not thread)
        raise RewardError(late)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


class _ExitCalled(BaseException):
    """`os._exit(code)` called by the code under `bounded_import`, raised in its place."""


_importing = threading.local()  # set in the thread that runs a bounded import


def bounded_import(load: Callable[[], Any], who: str, timeout_s: float | None) -> tuple[Any, BaseException | None]:
    """`load()` (a reward module's import) bounded as a reward call is: in a thread of its own for `timeout_s`
    seconds (None: in the caller's thread, unbounded), `os._exit` raising in its place meanwhile (in this
    process and that thread only: a child it forks, or another thread, exits as ever). Returns (value, None)
    or (None, whatever `load` raised); RewardError past the limit or for `os._exit`. A crash in C code still
    ends the process."""
    real_exit, pid = os._exit, os.getpid()

    def exit_here(code: int) -> None:
        if os.getpid() == pid and getattr(_importing, "on", False):
            raise _ExitCalled(code)
        real_exit(code)

    def run() -> tuple[Any, BaseException | None]:
        _importing.on = True
        try:
            return load(), None
        except BaseException as exc:  # noqa: BLE001  any way out of the user's import, returned to be said
            return None, exc
        finally:
            _importing.on = False

    late = (f"{who} did not finish within {timeout_s:g} s (the reward's timeout_s); import less at the top of the "
            "file (load heavy things on the first call), or raise timeout_s (null: no limit)." if timeout_s else "")
    os._exit = exit_here
    try:
        value, error = run() if timeout_s is None else in_own_thread(run, timeout_s, late, name="vlmrl-reward-import")
    finally:
        if os._exit is exit_here:
            os._exit = real_exit
    if isinstance(error, _ExitCalled):
        raise RewardError(f"{who} called os._exit({error.args[0]!r}); a reward file must define its functions, "
                          "not end the process.")
    if timeout_s is None and isinstance(error, KeyboardInterrupt):
        raise error  # in the caller's thread: Ctrl-C
    return value, error


def left_behind() -> list[threading.Thread]:
    """The threads started by a reward (or a reward file's import) that ran past its time limit, still alive.
    Python may wait for them at exit (a ThreadPoolExecutor's workers are joined, daemon or not, and so are
    `asyncio.to_thread`'s), so the CLI ends the process itself once its line is out."""
    return [thread for thread in _LEFT_BEHIND if thread.is_alive()]


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


def _in_thread(call: Callable[[], Any], outcome: dict[str, Any],
               torch_state: tuple[bool, int | None] | None) -> None:
    try:
        _set_torch_state(torch_state)
        outcome["value"] = call()
    except BaseException as exc:  # noqa: BLE001  in this thread, SystemExit and KeyboardInterrupt are the reward's
        outcome["error"] = exc


def _torch_state() -> tuple[bool, int | None] | None:
    """The caller's grad mode and CUDA device (a reward model under `--gpus N` must stay on its rank's GPU); None
    when torch is not imported yet (the defaults then hold, and a call need not import it)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return torch.is_grad_enabled(), torch.cuda.current_device() if cuda else None


def _set_torch_state(state: tuple[bool, int | None] | None) -> None:
    if state is None:
        return
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
