"""User rewards are bounded and isolated (issue 37): a reward that blocks is stopped at its `timeout_s` in one
line naming it; `sys.exit()`, `KeyboardInterrupt`, NaN, infinities and `10**400` are one line naming the reward
and the item; each reward gets its own copies of completions and keyword arguments, and a reward that empties
its list cannot pass the length check. Each case below passed silently, hung or crashed before.
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.helpers import reward_batch
from vlmrl.cli.app import app
from vlmrl.config.schema import load_config
from vlmrl.data.prepare import prepare_data
from vlmrl.grading.user_rewards import RewardError, load_rewards
from vlmrl.run.layout import checkpoint_fingerprint, train_fingerprint

REWARDS = '''
import sys, threading, time

SEEN = []


def slow(completions, **kwargs):
    time.sleep(60)
    return [0.0] * len(completions)


def leave(completions, **kwargs):
    sys.exit(0)


def leave_3(completions, **kwargs):
    sys.exit(3)


def interrupt(completions, **kwargs):
    raise KeyboardInterrupt


def nan(completions, **kwargs):
    return [0.0] * (len(completions) - 1) + [float("nan")]


def inf(completions, **kwargs):
    return [float("-inf")] + [0.0] * (len(completions) - 1)


def huge(completions, **kwargs):
    return [10**400] * len(completions)


def boolean(completions, **kwargs):
    return [True] * len(completions)


def empties(completions, **kwargs):
    completions.clear()
    return []


def vandal(prompts, completions, answer, **kwargs):
    completions[0][0]["content"] = "text the model never wrote"
    completions.append(completions[0])
    answer[0] = "rewritten gold"
    prompts[0][0]["content"][-1]["text"] = "another question"
    return [0.0] * (len(completions) - 1)


def observer(prompts, completions, answer, **kwargs):
    SEEN.append((completions[0][0]["content"], len(completions), answer[0], prompts[0][0]["content"][-1]["text"],
                 threading.current_thread() is threading.main_thread()))
    return [1.0] * len(completions)
'''


def config_with(tmp_path: Path, *rewards: str):
    """The demo config with these `rewards:` entries (YAML flow mappings), its reward file beside it."""
    (tmp_path / "r.py").write_text(REWARDS)
    entries = "".join(f"  - {entry}\n" for entry in rewards)
    path = tmp_path / "config.yaml"
    path.write_text(f"run: {{name: r, output_dir: {tmp_path}}}\nmodel: {{name: 'tiny:qwen3_vl'}}\n"
                    f"data: {{num_synthetic: 24, holdout_size: 4}}\nrewards:\n{entries}")
    return load_config(str(path))


def test_a_reward_that_blocks_is_stopped_at_its_time_limit_in_one_line(tmp_path):
    """Before: `time.sleep(60)` (or a lock, a socket) stalled the run forever, with no message."""
    (reward,) = load_rewards(config_with(tmp_path, "{function: 'r.py:slow', timeout_s: 0.3}"))
    started = time.perf_counter()
    with pytest.raises(RewardError) as info:
        reward.fn(**reward_batch(log_extra=True))
    assert time.perf_counter() - started < 5
    assert str(info.value) == ("rewards[0] (function: r.py:slow): slow did not return within 0.3 s; make it faster, "
                               "or raise this reward's timeout_s (null: no limit). Re-running the same command "
                               "resumes the run.")


@pytest.mark.parametrize(("function", "message"), [
    ("leave", r"leave called sys.exit\(0\); a reward must return its values, not end the run\.$"),
    ("leave_3", r"leave_3 called sys.exit\(3\)"),
    ("interrupt", r"interrupt raised KeyboardInterrupt \(line \d+\)$"),
    ("nan", r"nan returned nan \(float\) for completion 2 \(item 'item-2'\); each value must be a finite number"),
    ("inf", r"inf returned -inf \(float\) for completion 0 \(item 'item-0'\)"),
    ("huge", r"huge returned 1000000000\d+\.\.\. \(int\) for completion 0 \(item 'item-0'\)"),
    ("boolean", r"boolean returned True \(bool\) for completion 0"),
    ("empties", r"empties returned 0 values for 3 completions"),
])
def test_every_way_out_of_a_reward_is_one_line_naming_it(tmp_path, function, message):
    """Before: sys.exit(0) ended `vlmrl run` with exit 0, NaN and inf were accepted, 10**400 was a traceback, and
    emptying `completions` passed because the length was measured after the call."""
    for limit in ("", ", timeout_s: null"):  # in a thread of its own, and in the caller's
        (reward,) = load_rewards(config_with(tmp_path, f"{{function: 'r.py:{function}'{limit}}}"))
        with pytest.raises(RewardError) as info:
            reward.fn(**reward_batch(log_extra=True))
        line = str(info.value)
        assert "\n" not in line and line.startswith(f"rewards[0] (function: r.py:{function}): ")
        assert __import__("re").search(message, line), line


def test_each_reward_gets_its_own_copies(tmp_path):
    """Before: a reward that edited `completions` or a column changed what the next reward saw and what
    rollouts.jsonl recorded (TRL logs the very list the rewards get)."""
    loaded = load_rewards(config_with(tmp_path, "{function: 'r.py:vandal'}", "{function: 'r.py:observer'}"))
    given = reward_batch(log_extra=True)
    for reward in loaded:
        reward.fn(**given)
    assert given == {**reward_batch(), "log_extra": given["log_extra"]}  # the caller's objects are untouched
    seen = loaded[1].fn.fn.__globals__["SEEN"]
    assert seen == [("<SOLUTION>0</SOLUTION>", 3, "0", "question 0", False)]


def test_a_reward_without_a_time_limit_runs_in_the_callers_thread(tmp_path):
    (reward,) = load_rewards(config_with(tmp_path, "{function: 'r.py:observer', timeout_s: null}"))
    assert reward.fn(**reward_batch(2, log_extra=True)) == [1.0, 1.0]
    assert reward.fn.fn.__globals__["SEEN"][-1][-1] is (threading.current_thread() is threading.main_thread())


def test_the_time_limit_is_in_no_fingerprint(tmp_path):
    """Raising timeout_s after a timeout must resume the run, not start it over."""
    default = config_with(tmp_path, "{name: format}")
    raised = config_with(tmp_path, "{name: format, timeout_s: 600}")
    assert raised.rewards[0].timeout_s == 600 and default.rewards[0].timeout_s == 60
    assert (default.fingerprint(), train_fingerprint(default), checkpoint_fingerprint(default)) == (
        raised.fingerprint(), train_fingerprint(raised), checkpoint_fingerprint(raised))
    with pytest.raises(Exception, match="timeout_s"):
        config_with(tmp_path, "{name: format, timeout_s: 0}")


def test_sys_exit_in_a_reward_is_exit_2_not_a_silent_exit_0(tmp_path, monkeypatch):
    """Before: `sys.exit(0)` in a reward made `vlmrl train` (and `vlmrl run`, after the baseline) exit 0."""
    config = config_with(tmp_path, "{function: 'r.py:leave'}")
    prepare_data(config, config.run_dir)
    monkeypatch.setattr("vlmrl.models.loading.load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    result = CliRunner().invoke(app, ["train", str(tmp_path / "config.yaml")], terminal_width=300)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert lines == [("error: rewards[0] (function: r.py:leave): leave called sys.exit(0); a reward must return its "
                      "values, not end the run.")]


def test_check_values_keeps_none_and_real_numbers() -> None:
    from vlmrl.grading.reward_call import check_values

    assert check_values((0, None, 2.5, math.pi), 4, "r") == [0.0, None, 2.5, math.pi]


def test_doctests_pass() -> None:
    import doctest

    import vlmrl.grading.reward_call

    assert doctest.testmod(vlmrl.grading.reward_call).failed == 0
