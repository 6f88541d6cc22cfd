"""Mathematical equivalence of two answers, through math-verify in a worker process that can always be stopped.

``expressions_equal(pred, gold)`` says whether math-verify (the checker TRL's own ``accuracy_reward`` uses)
finds the two equal: ``\\frac{1}{2}`` = ``0.5``, ``2\\sqrt{2}`` = ``\\sqrt{8}``, ``(x+1)^2`` = ``x^2+2x+1``. It
never raises and always returns within ``TIMEOUT_S`` seconds (plus a one-time start of the worker).

Why a process rather than a call: math-verify bounds its work with ``signal.alarm``, which needs the main
thread (TRL switches the timeout off elsewhere, leaving no bound at all) and whole seconds, and no signal stops
work stuck in one C call: sympy evaluating ``2^{10^{10}}`` computes a 10-billion-bit integer and holds its
thread for a minute or more. A child process is bounded whatever it does: it runs each comparison under its
own sub-second timer (``symbolic_worker.py``), and when even that does not answer, the caller stops waiting
after ``TIMEOUT_S``, kills it, and the next call starts a fresh one. The worker starts on first use (0.5-2 s
of imports; processes that never grade an expression never start it), serves calls from any thread one at a
time, and dies with its parent: the kernel kills it when vlmrl dies (`vlmrl.common.children`), and it exits
at the end of its stdin. A process forked after the worker started gets its own
worker. Answers are cached per (pred, gold): a GRPO group often repeats a completion.

A pathological expression (``2^{10^{10}}`` against ``1``) is stopped by the worker's own timer; with that timer
off it is killed after ``TIMEOUT_S`` (tests/test_symbolic.py exercises both; timings: benchmarks/NOTES.md).

Left out: Windows (``poll`` on pipes), several workers in parallel (one comparison at a time is fast enough for
reward batches). Answers longer than ``MAX_EXPRESSION_CHARS`` are not parsed: the caller decides them.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from vlmrl.common import children

log = logging.getLogger(__name__)

MAX_EXPRESSION_CHARS = 300  # an answer, not a derivation; longer text is never sent to the parser
TIMEOUT_S = 2.0  # the caller's hard bound per comparison
WORKER_BUDGET_S = 1.0  # the worker's own timer per comparison (it answers False itself, no restart needed)
STARTUP_TIMEOUT_S = 60.0  # imports on a loaded 2-core machine
MAX_FAILED_STARTS = 3  # starts that end without a word before expression grading is given up for the process
_WORKER_SCRIPT = Path(__file__).with_name("symbolic_worker.py")


def expressions_equal(pred: str, gold: str) -> bool:
    """Whether math-verify reads ``pred`` and ``gold`` as the same mathematical object (False when unsure).

    >>> expressions_equal("2\\\\sqrt{2}", "\\\\sqrt{8}"), expressions_equal("x^2", "2x")
    (True, False)
    """
    if not isinstance(pred, str) or not isinstance(gold, str):
        return False
    pred, gold = pred.strip(), gold.strip()
    if not pred or not gold or len(pred) > MAX_EXPRESSION_CHARS or len(gold) > MAX_EXPRESSION_CHARS:
        return False
    return _cached_equal(pred, gold)


@functools.lru_cache(maxsize=4096)
def _cached_equal(pred: str, gold: str) -> bool:
    return _WORKER.compare(pred, gold)


def shutdown() -> None:
    """Stop the worker (it restarts on the next comparison)."""
    _WORKER.stop()


class _Worker:
    """One math-verify child process, used by one thread at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._owner = 0  # pid that started _proc: a forked child must not share its pipes
        self._buffer = b""
        self._broken: str | None = None  # why the worker cannot run at all (then every answer is False)
        self._failed_starts = 0

    def compare(self, pred: str, gold: str) -> bool:
        with self._lock:
            if self._broken:
                return False
            request = (json.dumps({"gold": gold, "pred": pred}) + "\n").encode()
            for _attempt in range(2):  # a worker found dead is replaced once; a second death is this input's
                if not self._ensure_started():
                    return False
                started = time.monotonic()
                try:
                    self._proc.stdin.write(request)
                    self._proc.stdin.flush()
                except OSError:
                    self._kill()
                    continue
                line = self._read_line(started + TIMEOUT_S)
                if line is None:  # no answer in time, or it died on this input
                    log.warning("expression comparison stopped after %.1f s: %.60r", TIMEOUT_S, pred)
                    self._kill()
                    return False
                return _reply_equal(line)
            return False

    def stop(self) -> None:
        with self._lock:
            self._kill()

    def _ensure_started(self) -> bool:
        if self._proc is not None and self._owner == os.getpid() and self._proc.poll() is None:
            return True
        if self._proc is not None and self._owner == os.getpid():
            self._kill()
        self._proc, self._buffer = None, b""  # (in a forked child the parent's worker stays the parent's)
        try:
            self._proc = children.popen(  # SIGKILLed if vlmrl dies, even mid-computation
                [sys.executable, "-P", str(_WORKER_SCRIPT), str(WORKER_BUDGET_S)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
        except OSError as exc:
            return self._give_up(f"the worker could not start ({exc})")
        self._owner = os.getpid()
        line = self._read_line(time.monotonic() + STARTUP_TIMEOUT_S)
        if line is None:  # slow or crashed start: maybe passing (a loaded machine), so try again later
            self._kill()
            self._failed_starts += 1
            if self._failed_starts >= MAX_FAILED_STARTS:
                return self._give_up(f"the worker did not start {MAX_FAILED_STARTS} times")
            log.warning(
                "the math-verify worker did not start in %.0f s; answer scored wrong", STARTUP_TIMEOUT_S
            )
            return False
        reply = _json_object(line)
        if reply.get("ready") is not True:  # it says why it cannot run (math-verify missing): that will last
            self._kill()
            return self._give_up(str(reply.get("error", reply)))
        return True

    def _give_up(self, reason: str) -> bool:
        self._broken = reason
        log.error("expression answers cannot be graded and score as wrong: %s", reason)
        return False

    def _read_line(self, deadline: float) -> bytes | None:
        """One line from the worker before ``deadline``; None on timeout or end of output."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        poller = select.poll()  # poll, not select: a training process may hold more than 1024 descriptors
        poller.register(fd, select.POLLIN)
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def _kill(self) -> None:
        proc, self._proc, self._buffer = self._proc, None, b""
        if proc is None or self._owner != os.getpid():
            return
        proc.kill()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - a killed process that does not go away
            pass
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


def _json_object(line: bytes) -> dict:
    try:
        value = json.loads(line)
    except ValueError:
        return {"error": f"unreadable reply {line[:80]!r}"}
    return value if isinstance(value, dict) else {"error": f"unexpected reply {value!r:.80}"}


def _reply_equal(line: bytes) -> bool:
    reply = _json_object(line)
    if "error" in reply:
        log.debug("math-verify could not compare: %s", reply["error"])
    return reply.get("equal") is True


_WORKER = _Worker()
atexit.register(shutdown)
