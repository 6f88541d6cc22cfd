"""The math-verify worker: right answers, bounded time whatever the input, any thread, recovery after a kill."""

from __future__ import annotations

import doctest
import json
import logging
import subprocess
import sys
import threading
import time

import pytest

import vlmrl.grading.symbolic
import vlmrl.grading.symbolic_worker
from vlmrl.grading.symbolic import MAX_EXPRESSION_CHARS, _Worker, expressions_equal

# Compared with a number, sympy evaluates this power: about a minute of work on 2 cores, most of it in C.
STUCK = ("2^{10^{10}}", "1")


@pytest.fixture
def fresh_worker(monkeypatch):
    """A worker of the module's own, started anew for the test (settings patched before it starts)."""
    worker = _Worker()
    monkeypatch.setattr(vlmrl.grading.symbolic, "_WORKER", worker)
    vlmrl.grading.symbolic._cached_equal.cache_clear()
    yield worker
    worker.stop()
    vlmrl.grading.symbolic._cached_equal.cache_clear()


def test_equivalences(fresh_worker):
    assert expressions_equal("2\\sqrt{2}", "\\sqrt{8}")
    assert expressions_equal("x^2+2x+1", "(x+1)^2")
    assert not expressions_equal("x^2+2x", "(x+1)^2")
    assert not expressions_equal("", "1")
    assert not expressions_equal("1", "x" * (MAX_EXPRESSION_CHARS + 1))  # too long: never parsed


@pytest.mark.slow
def test_work_past_the_timeout_is_killed(fresh_worker, monkeypatch, caplog):
    monkeypatch.setattr(vlmrl.grading.symbolic, "WORKER_BUDGET_S", 60.0)  # the worker's own timer would not fire
    monkeypatch.setattr(vlmrl.grading.symbolic, "TIMEOUT_S", 1.0)
    assert expressions_equal("\\sqrt{4}", "2")  # started and warm
    first = fresh_worker._proc.pid
    start = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="vlmrl.grading.symbolic"):
        assert expressions_equal(*STUCK) is False
    assert time.perf_counter() - start < 1.0 + 1.0  # the timeout, plus the kill
    assert "stopped after 1.0 s" in caplog.text
    assert fresh_worker._proc is None  # killed ...
    assert expressions_equal("\\sqrt{9}", "3")  # ... and replaced on the next call
    assert fresh_worker._proc.pid != first


def test_slow_python_work_is_stopped_by_the_workers_own_timer(fresh_worker, monkeypatch):
    monkeypatch.setattr(vlmrl.grading.symbolic, "WORKER_BUDGET_S", 0.3)
    assert expressions_equal("\\sqrt{4}", "2")
    first = fresh_worker._proc.pid
    start = time.perf_counter()
    assert expressions_equal("\\sum_{k=1}^{100000} k^{k}", "1") is False
    assert time.perf_counter() - start < vlmrl.grading.symbolic.TIMEOUT_S
    assert fresh_worker._proc.pid == first  # answered by the worker itself, no restart


def test_calls_from_other_threads_at_once(fresh_worker):
    cases = [("\\sqrt{18}", "3\\sqrt{2}", True), ("\\sqrt{18}", "2\\sqrt{3}", False)] * 4
    results: dict[int, bool] = {}

    def run(index: int, pred: str, gold: str) -> None:
        results[index] = vlmrl.grading.symbolic._WORKER.compare(pred, gold)  # uncached: every call reaches the worker

    threads = [threading.Thread(target=run, args=(i, p, g)) for i, (p, g, _) in enumerate(cases)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results == {i: expected for i, (_, _, expected) in enumerate(cases)}


def test_a_worker_that_died_between_calls_is_replaced(fresh_worker):
    assert expressions_equal("\\sqrt{4}", "2")
    fresh_worker._proc.kill()
    fresh_worker._proc.wait()
    assert fresh_worker.compare("\\sqrt{16}", "4") is True


def test_a_worker_that_cannot_start_is_reported_once_and_scores_false(fresh_worker, monkeypatch, tmp_path, caplog):
    script = tmp_path / "broken_worker.py"
    script.write_text('print(\'{"error": "math-verify cannot be imported (ModuleNotFoundError)"}\', flush=True)\n')
    monkeypatch.setattr(vlmrl.grading.symbolic, "_WORKER_SCRIPT", script)
    with caplog.at_level(logging.ERROR, logger="vlmrl.grading.symbolic"):
        assert fresh_worker.compare("\\sqrt{4}", "2") is False
        assert fresh_worker.compare("\\sqrt{9}", "3") is False
    assert caplog.text.count("expression answers cannot be graded") == 1
    assert "ModuleNotFoundError" in caplog.text


def test_a_worker_that_does_not_start_in_time_is_retried_then_given_up(
    fresh_worker, monkeypatch, tmp_path, caplog
):
    script = tmp_path / "silent_worker.py"
    script.write_text("import time\ntime.sleep(30)\n")
    monkeypatch.setattr(vlmrl.grading.symbolic, "_WORKER_SCRIPT", script)
    monkeypatch.setattr(vlmrl.grading.symbolic, "STARTUP_TIMEOUT_S", 0.3)
    with caplog.at_level(logging.WARNING, logger="vlmrl.grading.symbolic"):
        results = [fresh_worker.compare("\\sqrt{4}", "2") for _ in range(vlmrl.grading.symbolic.MAX_FAILED_STARTS + 1)]
    assert results == [False] * (vlmrl.grading.symbolic.MAX_FAILED_STARTS + 1)
    assert caplog.text.count("did not start in 0 s") == vlmrl.grading.symbolic.MAX_FAILED_STARTS - 1
    assert caplog.text.count("expression answers cannot be graded") == 1  # then given up, once
    assert fresh_worker._proc is None  # every silent worker was killed


# --- the worker's side of the protocol ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        ({"gold": "\\sqrt{8}", "pred": "2\\sqrt{2}"}, {"equal": True}),
        ({"gold": "\\sqrt{8}", "pred": "3"}, {"equal": False}),
        ({"gold": "", "pred": "3"}, {"equal": False}),  # nothing to parse in the gold
        ({"gold": 3, "pred": "3"}, {"equal": False, "error": "request needs string gold and pred"}),
        (["not", "a", "dict"], {"equal": False, "error": "request needs string gold and pred"}),
    ],
)
def test_worker_answer(request_, expected):
    assert vlmrl.grading.symbolic_worker.answer(request_, 5.0) == expected


def test_worker_protocol_survives_bad_lines():
    lines = ['{"gold": "\\\\sqrt{8}", "pred": "2\\\\sqrt{2}"}', "not json", "[1]", '{"gold": "1", "pred": "2"}']
    done = subprocess.run(
        [sys.executable, "-P", str(vlmrl.grading.symbolic._WORKER_SCRIPT), "1.0"],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    replies = [json.loads(line) for line in done.stdout.splitlines()]
    assert done.returncode == 0
    assert replies[0] == {"ready": True}
    assert replies[1] == {"equal": True}
    assert replies[2]["equal"] is False and replies[2]["error"].startswith("bad request")
    assert replies[3] == {"equal": False, "error": "request needs string gold and pred"}
    assert replies[4] == {"equal": False}


def test_doctests_pass(fresh_worker):
    result = doctest.testmod(vlmrl.grading.symbolic)
    assert result.attempted > 0 and result.failed == 0
