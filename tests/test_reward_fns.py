"""Rewards from the config: built-ins by name, the user's own functions from a file, refused with one line
before any model loads when they cannot be used, and carried into every record of a run.

The refusals are checked on real held-out items (a synthetic set prepared once for the module) and through
the CLI (`vlmrl train`, `vlmrl eval`, `vlmrl run`), where each must be one red line and exit 2 before a model
is loaded or a checkpoint written.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vlmrl.cli.app import app
from vlmrl.common.io import read_json, read_jsonl
from vlmrl.config.schema import Config, ConfigError, load_config
from vlmrl.data.prepare import prepare_data
from vlmrl.grading.user_rewards import (
    RewardError,
    check_run_rewards,
    load_rewards,
    rewards_fingerprint,
)
from vlmrl.run.layout import train_fingerprint

runner = CliRunner()

SHORTNESS = '''
SEEN = []


def shortness(completions, **kwargs):
    """A length penalty: 1.0 for an empty completion, 0.02 less per character, never below 0."""
    SEEN.append(sorted(kwargs))
    return [max(0.0, 1.0 - 0.02 * len(c[0]["content"])) for c in completions]
'''

BROKEN = {  # reward file body -> what the one-line error must say
    "def f(completions, **kwargs):\n    return [1.0]\n": r"returned 1 values for \d+ completions",
    "def f(completions, **kwargs):\n    return 1.0\n": r"returned float, not a list",
    "def f(completions, **kwargs):\n    return ['good' for _ in completions]\n": r"returned 'good' \(str\)",
    "def f(completions, **kwargs):\n    return [1 / 0 for _ in completions]\n": r"f raised ZeroDivisionError: division by zero",
    "def f(completions):\n    return [0.0 for _ in completions]\n": r"wrong signature \(completions\)",
    "def f(completions, /, **kwargs):\n    return []\n": r"wrong signature \(completions, /, \*\*kwargs\)",
    "def f(completions, solution, **kwargs):\n    return []\n": r"f takes 'solution', which is no column .* "
                                                             r"columns: \{solution: answer\}",
    "f = 3\n": r"is a int, not a function",
    "def g(completions, **kwargs):\n    return []\n": r"has no 'f'",
    "import not_a_module_anywhere\n": r"importing .*broken\.py failed: ModuleNotFoundError: No module named "
                                       r"'not_a_module_anywhere' \(line 1\)",
    "def f(:\n": r"importing .*broken\.py failed: SyntaxError: .* \(line 1\)",
}


def write_config(folder: Path, rewards: str, output_dir: Path, *, extra: str = "") -> Path:
    """A config file in `folder` (the tiny model, a small synthetic set), with this `rewards:` block."""
    path = folder / "config.yaml"
    path.write_text(
        f"run: {{name: r, output_dir: {output_dir}}}\n"
        "model: {name: 'tiny:qwen3_vl'}\n"
        "data: {num_synthetic: 40, holdout_size: 6}\n"
        "eval: {max_new_tokens: 12}\n"
        "train: {max_completion_length: 12, max_steps: 2, per_device_train_batch_size: 8, save_steps: 1}\n"
        f"rewards:\n{rewards}{extra}"
    )
    return path


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """A run folder with prepared synthetic data (no token budget: no model needed)."""
    output = tmp_path_factory.mktemp("rewards_prepared")
    config = load_config(str(write_config(output, "  - {name: format, weight: 0.3}\n", output)))
    prepare_data(config, config.run_dir)
    return config.run_dir


# ---- config ---------------------------------------------------------------------------------------------


def test_default_rewards_are_format_and_correctness_with_the_seed_weights() -> None:
    for preset in ("demo", "seed", "gspo-paper"):
        loaded = load_rewards(load_config(preset))
        assert [(r.name, r.weight) for r in loaded] == [("format_reward", 0.3), ("correctness_reward", 1.0)]
    assert [(r.name, r.weight) for r in Config().rewards] == [("format", 0.3), ("correctness", 1.0)]


@pytest.mark.parametrize(("entry", "message"), [
    ("{weight: 1.0}", "exactly one of `name:`"),
    ("{name: format, function: 'a.py:f'}", "exactly one of `name:`"),
    ("{name: brevity}", "Input should be 'format' or 'correctness'"),
    ("{function: 'a.py'}", "expected `file.py:name`"),
    ("{name: format, weight: .nan}", "finite number"),
])
def test_a_bad_entry_is_refused_when_the_config_loads(entry: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("demo", [f"rewards=[{entry}]"])


def test_the_same_reward_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match="listed twice"):
        load_config("demo", ["rewards=[{name: format}, {name: format, weight: 2.0}]"])


def test_a_function_file_resolves_beside_the_config_and_the_run_copy_still_finds_it(tmp_path: Path) -> None:
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "my_rewards.py").write_text(SHORTNESS)
    path = write_config(tmp_path / "cfg", "  - {function: 'my_rewards.py:shortness', weight: 0.1}\n", tmp_path)
    config = load_config(str(path))
    assert config.rewards[0].resolved == str((tmp_path / "cfg" / "my_rewards.py").resolve())
    # the copy a run writes (run_dir/config.yaml) keeps the resolved path, and fingerprints the same
    from vlmrl.pipeline import claim_run_dir

    claim_run_dir(config, config.run_dir, force=False)
    copy = load_config(str(config.run_dir / "config.yaml"))
    assert copy.rewards[0].resolved == config.rewards[0].resolved
    assert copy.fingerprint() == config.fingerprint()
    assert [r.name for r in load_rewards(copy)] == ["shortness"]


def test_editing_the_reward_file_changes_the_train_fingerprint(tmp_path: Path) -> None:
    (tmp_path / "my_rewards.py").write_text(SHORTNESS)
    config = load_config(str(write_config(tmp_path, "  - {function: 'my_rewards.py:shortness'}\n", tmp_path)))
    before = (rewards_fingerprint(config), train_fingerprint(config))
    (tmp_path / "my_rewards.py").write_text(SHORTNESS.replace("0.02", "0.03"))
    after = (rewards_fingerprint(config), train_fingerprint(config))
    assert before[0] != after[0] and before[1] != after[1]


# ---- loading and the check on held-out items ------------------------------------------------------------


def test_a_user_reward_gets_every_column_trl_passes(prepared: Path, tmp_path: Path) -> None:
    (tmp_path / "my_rewards.py").write_text(SHORTNESS)
    config = load_config(str(write_config(tmp_path, "  - {name: correctness}\n  - {function: 'my_rewards.py:shortness'}\n",
                                          tmp_path)))
    loaded = check_run_rewards(config, prepared)
    assert [r.name for r in loaded] == ["correctness_reward", "shortness"]
    seen = loaded[1].fn.fn.__globals__["SEEN"]
    assert len(seen) == 1  # one call, on a batch of held-out items
    expected = {"id", "question", "answer", "answer_type", "precision", "unit", "choices", "category", "source",
                "images", "prompts", "completion_ids", "trainer_state", "log_extra", "log_metric"}
    assert expected <= set(seen[0])


@pytest.mark.parametrize("body", list(BROKEN))
def test_a_broken_reward_is_one_line_before_training(body: str, prepared: Path, tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text(body)
    config = load_config(str(write_config(tmp_path, "  - {function: 'broken.py:f'}\n", tmp_path)))
    with pytest.raises(RewardError) as info:
        check_run_rewards(config, prepared)
    message = str(info.value)
    assert "\n" not in message and message.startswith("rewards[0] (function: broken.py:f)")
    assert re.search(BROKEN[body], message), message


def test_a_missing_file_and_a_missing_module_are_one_line(tmp_path: Path) -> None:
    config = load_config(str(write_config(tmp_path, "  - {function: 'nowhere.py:f'}\n", tmp_path)))
    with pytest.raises(RewardError, match=r"no such file .*nowhere\.py"):
        load_rewards(config)
    config = load_config("demo", ["rewards=[{function: 'no_such_pkg.rewards:f'}]"])
    with pytest.raises(RewardError, match=r"importing module 'no_such_pkg.rewards' failed: ModuleNotFoundError"):
        load_rewards(config)


def test_a_module_path_function_and_a_name_clash(tmp_path: Path) -> None:
    config = load_config("demo", ["rewards=[{function: 'vlmrl.grading.rewards:format_reward'}, {name: correctness}]"])
    assert [r.name for r in load_rewards(config)] == ["format_reward", "correctness_reward"]
    config = load_config("demo", ["rewards=[{function: 'vlmrl.grading.rewards:format_reward'}, {name: format}]"])
    with pytest.raises(RewardError, match="already taken"):
        load_rewards(config)


# ---- through the CLI: refused before a model loads ------------------------------------------------------


@pytest.mark.parametrize("command", ["train", "eval"])
def test_the_cli_refuses_a_reward_that_raises_before_loading_a_model(command: str, prepared: Path, tmp_path: Path,
                                                                     monkeypatch) -> None:
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("vlmrl.models.loading.load_model", no_model)
    monkeypatch.setattr("vlmrl.evaluate.stage.load_with_adapter", no_model)
    (tmp_path / "broken.py").write_text(next(b for b in BROKEN if "1 / 0" in b))
    config = write_config(tmp_path, "  - {function: 'broken.py:f'}\n", tmp_path)
    args = [command, str(config), "--run-dir", str(prepared), *(["--stage", "baseline"] if command == "eval" else [])]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "f raised ZeroDivisionError" in result.output and "Traceback" not in result.output
    assert not (prepared / "train" / "checkpoints").exists() and not (prepared / "baseline_records.jsonl").exists()


def test_vlmrl_run_refuses_a_missing_reward_file_before_anything_runs(tmp_path: Path) -> None:
    config = write_config(tmp_path, "  - {function: 'gone.py:f'}\n", tmp_path / "runs")
    result = runner.invoke(app, ["run", str(config)])
    assert result.exit_code == 2, result.output
    assert "no such file" in result.output and not (tmp_path / "runs" / "r").exists()


def test_old_reward_weights_in_a_file_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "old.yaml"
    path.write_text("train: {reward_weights: [0.3, 1.0]}\n")
    result = runner.invoke(app, ["config", "validate", str(path)])
    assert result.exit_code == 2
    assert "rewards: [{name: format, weight: 0.3}, {name: correctness, weight: 1.0}]" in " ".join(result.output.split())


# ---- a whole run with a user reward ---------------------------------------------------------------------


@pytest.mark.slow
def test_a_user_reward_reaches_metrics_records_comparison_and_report(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "my_rewards.py").write_text(SHORTNESS)
    rewards = ("  - {name: format, weight: 0.3}\n  - {name: correctness, weight: 1.0}\n"
               "  - {function: 'my_rewards.py:shortness', weight: 1.0}\n")
    config = write_config(tmp_path, rewards, tmp_path / "runs", extra="export: {}\n")
    result = runner.invoke(app, ["run", str(config)])
    run_dir = tmp_path / "runs" / "r"
    assert result.exit_code == 0, result.output
    metrics = read_jsonl(run_dir / "train" / "metrics.jsonl")
    assert any("rewards/shortness/mean" in row for row in metrics)
    for stage in ("baseline", "after"):
        for record in read_jsonl(run_dir / f"{stage}_records.jsonl"):
            expected = max(0.0, 1.0 - 0.02 * len(record["completion"]))
            assert record["rewards"]["shortness"] == pytest.approx(expected)
            assert record["total_reward"] == pytest.approx(
                0.3 * record["format_reward"] + record["correctness_reward"] + expected)
        assert "shortness" in read_json(run_dir / f"{stage}_summary.json")["rewards"]
    shortness = json.loads((run_dir / "comparison.json").read_text())["metrics"]["shortness"]
    assert {"before", "after", "delta", "delta_ci95", "n"} <= set(shortness) and shortness["n"] == 6
    report = (run_dir / "report.html").read_text()
    assert 'data-metric="shortness"' in report and 'data-key="rewards/shortness/mean"' in report
    assert "shortness" in result.output  # the printed before/after table
    rollouts = read_jsonl(run_dir / "train" / "rollouts.jsonl")
    assert all(set(r["rewards"]) == {"format_reward", "correctness_reward", "shortness"} for r in rollouts)

    # an edited reward file: training runs again, the baseline is rescored from its completions (not
    # regenerated), the after records are the new adapter's, and every value follows the new rule
    baseline = [r["completion"] for r in read_jsonl(run_dir / "baseline_records.jsonl")]
    (tmp_path / "my_rewards.py").write_text(SHORTNESS.replace("0.02", "0.05"))
    import vlmrl.evaluate.stage

    loads: list[object] = []
    real_load = vlmrl.evaluate.stage.load_with_adapter
    monkeypatch.setattr("vlmrl.evaluate.stage.load_with_adapter", lambda *a, **k: loads.append(a[-1]) or real_load(*a, **k))
    again = runner.invoke(app, ["run", str(config)])
    assert again.exit_code == 0, again.output
    assert len(loads) == 1 and loads[0] is not None  # a model loaded for the after stage only
    out = " ".join(again.output.split())
    assert "[run] eval baseline" in out and "[run] train" in out and "[skip] prepare" in out
    assert [r["completion"] for r in read_jsonl(run_dir / "baseline_records.jsonl")] == baseline
    for stage in ("baseline", "after"):
        for record in read_jsonl(run_dir / f"{stage}_records.jsonl"):
            assert record["rewards"]["shortness"] == pytest.approx(max(0.0, 1.0 - 0.05 * len(record["completion"])))


def test_the_train_dataset_carries_every_item_column(prepared: Path) -> None:
    """TRL passes each dataset column (all but the prompt) to every reward: they are Item.columns()."""
    from vlmrl.data.items import Item
    from vlmrl.train.stage import build_train_dataset

    dataset = build_train_dataset(prepared)
    rows = read_jsonl(prepared / "data" / "train.jsonl")
    expected = Item.from_json(rows[0]).columns()
    assert set(expected) | {"prompt", "images"} == set(dataset.column_names)
    first = dataset[0]
    assert {key: first[key] for key in expected} == {**expected, "answer": str(expected["answer"])}


def test_doctests_pass() -> None:
    import doctest

    import vlmrl.config.schema
    import vlmrl.grading.user_rewards

    for module in (vlmrl.grading.user_rewards, vlmrl.config.schema):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


# ---- rewards as TRL accepts them ------------------------------------------------------------------------

TRL_STYLE = '''
import asyncio

STATES = []


def by_ids(completion_ids, **kwargs):
    """Reads only the token ids (TRL passes them to every reward)."""
    return [float(len(ids)) for ids in completion_ids]


async def later(completions, **kwargs):
    await asyncio.sleep(0)
    return [1.0 for _ in completions]


def stepped(completions, trainer_state, **kwargs):
    STATES.append(trainer_state.global_step)
    return [0.0 for _ in completions]
'''


def test_signatures_trl_accepts_are_loaded_and_called(prepared: Path, tmp_path: Path) -> None:
    from vlmrl.grading.user_rewards import reward_check

    (tmp_path / "trl_style.py").write_text(TRL_STYLE)
    entries = "".join(f"  - {{function: 'trl_style.py:{name}'}}\n" for name in ("by_ids", "later", "stepped"))
    loaded, checked = reward_check(load_config(str(write_config(tmp_path, entries, tmp_path))), prepared)
    assert [r.name for r in loaded] == ["by_ids", "later", "stepped"]
    assert checked["by_ids"]["well_formed"] > checked["by_ids"]["empty"] == 0.0  # stand-in ids: one per word
    assert checked["later"]["well_formed"] == 1.0  # an async reward, awaited
    assert loaded[2].fn.fn.__globals__["STATES"] == [0]  # a trainer state at step 0 at the check, not None


def test_trl_accuracy_reward_gets_its_solution_column_and_a_seed_run_is_told_it_expects_think(
        prepared: Path, tmp_path: Path, caplog) -> None:
    from vlmrl.grading.user_rewards import reward_check

    entry = "  - {function: 'trl.rewards:accuracy_reward', columns: {solution: answer}}\n"
    config = load_config(str(write_config(tmp_path, entry, tmp_path)))
    with caplog.at_level("WARNING", logger="vlmrl.grading.user_rewards"):
        _, checked = reward_check(config, prepared)
    # a seed answer has no \boxed{}: TRL's reward gives it what it gives an empty completion, and says so once
    assert checked["accuracy_reward"] == {"well_formed": 0.0, "empty": 0.0, "untagged": 0.0, "other_contract": 1.0}
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "no more than an empty one" in warning and "`contract: think`" in warning and "\n" not in warning
    caplog.clear()
    think = load_config(str(write_config(tmp_path, entry, tmp_path, extra="contract: think\n")))
    with caplog.at_level("WARNING", logger="vlmrl.grading.user_rewards"):
        assert reward_check(think, prepared)[1]["accuracy_reward"]["well_formed"] == 1.0
    assert not caplog.records


def test_a_package_beside_the_config_by_module_path_and_one_line_for_its_file_path(prepared: Path,
                                                                                  tmp_path: Path) -> None:
    package = tmp_path / "task_rewards"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "util.py").write_text("def length(c):\n    return float(len(c[0]['content']))\n")
    (package / "scores.py").write_text("from .util import length\n\n\ndef longer(completions, **kwargs):\n"
                                       "    return [length(c) for c in completions]\n")
    config = load_config(str(write_config(tmp_path, "  - {function: 'task_rewards.scores:longer'}\n", tmp_path)))
    assert [r.name for r in check_run_rewards(config, prepared)] == ["longer"]
    config = load_config(str(write_config(tmp_path, "  - {function: 'task_rewards/scores.py:longer'}\n", tmp_path)))
    with pytest.raises(RewardError) as info:
        load_rewards(config)
    assert "\n" not in str(info.value) and "`function: task_rewards.scores:longer`" in str(info.value)


def test_user_rewards_reach_validation_rows_and_tracker_tags() -> None:
    from vlmrl.evaluate.stage import summarize
    from vlmrl.train.validation import tracker_scalars, validation_row

    record = {"correct": True, "mathvista_correct": False, "exact_match": True, "format_ok": True, "format_reward": 2.0,
              "correctness_reward": 2.0, "total_reward": 2.6, "truncated": False, "degenerate": False,
              "generated_tokens": 5, "rewards": {"brevity": -0.5, "hard_bonus": None}}
    row = validation_row(3, summarize([record, {**record, "rewards": {"brevity": 0.0, "hard_bonus": 1.0}}],
                                      stage="validation"), 1.0)
    assert row["rewards"]["brevity"]["mean"] == -0.25 and row["rewards"]["hard_bonus"]["mean"] == 1.0
    tags = tracker_scalars(row)
    assert tags["eval_rewards/brevity/mean"] == -0.25 and tags["eval_accuracy"] == 1.0
