"""Child processes that die with vlmrl: a kill -9 of vlmrl leaves no converter or worker running, and so none
writing into a run folder after its lock (vlmrl.run.claim) is released.

`popen(argv, **kwargs)` is `subprocess.Popen` whose child asks the kernel (Linux `prctl(PR_SET_PDEATHSIG)`) to
SIGKILL it when vlmrl dies, however it dies. The kernel ties that signal to the *thread* that forked the child,
not the process, so every child is forked by one thread that lives as long as the process (a child started
from a short-lived thread, such as a reward call bounded by a timeout, would otherwise be killed when that
thread ends). `run(argv, **kwargs)` is `subprocess.run` on top of it.

Left out: other systems (macOS, Windows have no parent-death signal; there `popen` is plain Popen and a child
ends when it notices, e.g. at the end of its stdin), and grandchildren a child starts on its own (a child that
must take them along starts them the same way, or in its own process group).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import queue
import signal
import subprocess
import sys
import threading
from typing import Any

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def popen(argv: list[str], **kwargs: Any) -> subprocess.Popen:
    """`subprocess.Popen(argv, **kwargs)`, the child SIGKILLed when this process dies (Linux)."""
    if _prctl() is None or "preexec_fn" in kwargs:
        return subprocess.Popen(argv, **kwargs)
    return _Forker.get().popen(argv, kwargs)


def run(argv: list[str], *, timeout: float | None = None, **kwargs: Any) -> subprocess.CompletedProcess:
    """`subprocess.run` (output captured as text) through `popen`: the child dies with this process."""
    kwargs.setdefault("stdout", subprocess.PIPE)
    kwargs.setdefault("stderr", subprocess.PIPE)
    kwargs.setdefault("text", True)
    with popen(argv, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:  # a timeout, Ctrl-C: the child goes too, as with subprocess.run
            proc.kill()
            proc.wait()
            raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _prctl() -> Any:
    """libc's prctl on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):
        return None


class _Forker:
    """The one thread that forks every child of this process, so their parent-death signal outlives any
    caller's thread. A process forked from this one gets its own forker (threads do not survive a fork)."""

    _instance: _Forker | None = None
    _guard = threading.Lock()

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._prctl = _prctl()
        threading.Thread(target=self._serve, name="vlmrl-forker", daemon=True).start()

    @classmethod
    def get(cls) -> _Forker:
        with cls._guard:
            if cls._instance is None or cls._instance._pid != os.getpid():
                cls._instance = _Forker()
            return cls._instance

    def popen(self, argv: list[str], kwargs: dict) -> subprocess.Popen:
        answer: queue.SimpleQueue = queue.SimpleQueue()
        self._requests.put((argv, kwargs, answer))
        ok, value = answer.get()
        if not ok:
            raise value
        return value

    def _serve(self) -> None:
        while True:
            argv, kwargs, answer = self._requests.get()
            try:
                child = subprocess.Popen(argv, preexec_fn=self._die_with_parent, **kwargs)  # noqa: PLW1509 (two calls)
                answer.put((True, child))
            except BaseException as exc:  # noqa: BLE001  handed back to the caller, who raises it
                answer.put((False, exc))

    def _die_with_parent(self) -> None:
        # runs in the child between fork and exec: two system calls, nothing that takes a lock
        self._prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != self._pid:  # the parent died before the signal was armed
            os._exit(1)
