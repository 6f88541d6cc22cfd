"""RL makes the demo policy better, not just different.

From the same warm-started demo policy, seed and held-out set:
  - GSPO and GRPO each raise held-out mean reward and format compliance by a margin whose 95% paired
    bootstrap interval excludes zero;
  - a control run with the correctness reward's sign flipped (rewards: format 0.0, correctness -1.0) ends with lower
    held-out accuracy than before training and than the GSPO run: the correctness signal is used. The format
    weight is off in the control because the format reward alone raises accuracy (answers become extractable,
    and some are right by chance): with [0.3, -1.0] that pull masked the flipped signal (0.141 vs 0.125).

These run `vlmrl run` as `make run` does (a subprocess, the CPU kernels pinned: the suite's own process runs
the host's fastest ones), through every stage on the CPU, about a minute or two each. Marked slow; CI runs them.
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


ROOT = Path(__file__).resolve().parents[1]
# GRPO and the control train for half the demo's steps (the rate still decays to 0): enough for what they show,
# and the suite's time
HALF = "train.max_steps=40"


def _run(tmp_root, env: dict, name: str, *overrides: str) -> dict:
    """`vlmrl run demo` as a user's shell runs it (the CPU kernels pinned); its comparison and its stdout."""
    sets = [arg for value in (f"run.output_dir={tmp_root}", f"run.name={name}", *overrides) for arg in ("--set", value)]
    done = subprocess.run([sys.executable, "-m", "vlmrl.cli", "run", "demo", *sets], env=env, capture_output=True,
                          text=True, timeout=1800, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return _outcome(Path(tmp_root) / name, done.stdout)


def _outcome(run_dir: Path, stdout: str) -> dict:
    return {**json.loads((run_dir / "comparison.json").read_text()), "stdout": stdout}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, demo_run):
    """The default run (GSPO: `make run`'s, shared with the e2e test), GRPO and the sign-flipped control, all from
    the same demo policy build, seed and held-out set."""
    assert demo_run["result"].returncode == 0, demo_run["result"].stdout[-3000:] + demo_run["result"].stderr[-3000:]
    root = tmp_path_factory.mktemp("learning")
    return {
        "gspo": _outcome(demo_run["run_dir"], demo_run["result"].stdout),
        "grpo": _run(root, demo_run["env"], "grpo", "train.algorithm=grpo", "train.loss_type=grpo", HALF),
        "control": _run(root, demo_run["env"], "control", "train.algorithm=gspo", HALF,
                        "rewards=[{name: format, weight: 0.0}, {name: correctness, weight: -1.0}]"),
    }


@pytest.mark.parametrize("algorithm", ["gspo", "grpo"])
def test_rl_raises_held_out_reward_and_format(runs, algorithm):
    metrics = runs[algorithm]["metrics"]
    for name in ("total_reward", "format_compliance"):
        lo, hi = metrics[name]["delta_ci95"]
        print(f"{algorithm} {name}: {metrics[name]['before']:.3f} -> {metrics[name]['after']:.3f} [{lo:+.3f}, {hi:+.3f}]")
        assert metrics[name]["delta"] > 0 and lo > 0, f"{algorithm}: {name} did not rise significantly: {metrics[name]}"


def test_flipped_correctness_sign_lowers_accuracy(runs):
    control = runs["control"]["metrics"]["accuracy"]
    gspo = runs["gspo"]["metrics"]["accuracy"]
    print(f"accuracy before {control['before']:.3f}; after GSPO {gspo['after']:.3f}; after control {control['after']:.3f}")
    # Same starting policy and held-out items, so the baselines are identical.
    assert control["before"] == gspo["before"] > 0
    assert control["after"] < control["before"]
    assert control["after"] < gspo["after"]
    correctness = runs["control"]["metrics"]["correctness_reward"]
    assert correctness["after"] < correctness["before"]


def _printed_table(stdout: str) -> str:
    """The before/after table and its flips line, as `vlmrl run` printed them."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "before -> after (" in line)
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("wrong to right:"))
    return "\n".join(lines[start : end + 1])


def _lines(table: str) -> list[str]:
    return [line.rstrip() for line in table.strip("\n").splitlines()]


def test_readme_shows_the_recorded_demo_table():
    """The README's example is, digit for digit, the table that `make run` printed in the committed spread record
    (the pinned kernels, seed 0: benchmarks/results/cpu_demo_spread.json), not one typed in."""
    block = re.search(r"<!-- demo-table -->\n```\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
    assert block, "README.md has no demo table block (<!-- demo-table --> then a ``` block)"
    record = json.loads((ROOT / "benchmarks" / "results" / "cpu_demo_spread.json").read_text())
    made = next(run for run in record["runs"] if run["kernels"] == "pinned" and run["seed"] == 0)
    assert _lines(made["table"]) == _lines(block.group(1)), "README.md's demo table is not the record's:\n" + made["table"]
    assert made["accuracy"]["mcnemar_p"] < 0.05


def test_the_demo_raises_accuracy_significantly_here(runs):
    """`make run` on the machine running the suite, whatever its kernels print digit by digit: held-out accuracy
    rises with McNemar p < 0.05 and its 95% interval above zero (printed with -s beside the README's)."""
    accuracy = runs["gspo"]["metrics"]["accuracy"]
    print(_printed_table(runs["gspo"]["stdout"]))
    assert accuracy["mcnemar_p"] < 0.05 and accuracy["delta_ci95"][0] > 0, accuracy


def test_the_cpu_warm_start_curve_rises_without_collapse(runs, monkeypatch, vlmrl_cache):
    """The demo policy's warm-start checks (greedy answers on figures kept apart), written beside the policy:
    the structure, once learned, stays learned, and accuracy never falls back by more than the checks' noise."""
    from vlmrl.models.demo import demo_policy_dir, recipe_for

    monkeypatch.delenv("VLMRL_CPU_KERNELS")  # the folder of the pinned kernels' build, which the runs used
    monkeypatch.setenv("VLMRL_CACHE", str(vlmrl_cache))
    info = json.loads((demo_policy_dir(recipe_for("demo-policy", 0)) / "demo_policy.json").read_text())
    checks = info["reading_checks"]
    assert len(checks) == info["recipe"]["sft_steps"] // info["recipe"]["check_every"]
    tolerance = 4 / info["recipe"]["check_items"]  # a few items of the check set
    for earlier, later in itertools.pairwise(checks):
        assert later["format_rate"] >= earlier["format_rate"] - tolerance, checks
        assert later["greedy_accuracy"] >= earlier["greedy_accuracy"] - tolerance, checks
    assert checks[-1]["format_rate"] > 0.5 and checks[-1]["greedy_accuracy"] > 0, checks
