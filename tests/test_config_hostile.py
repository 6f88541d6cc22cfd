"""Configs a user can get wrong, and hostile ones: each is refused by `vlmrl config validate` and `vlmrl run`
alike, exit 2, one error line, before any stage starts; the `--set` forms a user types keep working.

Covered: `train.trl_overrides` checked against GRPOConfig's field types and refused where vlmrl sets the field
itself (or asks for an absent vLLM); a key given twice in a YAML mapping; an old train field beside its new
name; true/false and numbers kept apart; alias bombs and oversized files bounded, and the values an error
quotes; reward weights bounded; column maps held to vlmrl's roles and clear of TRL's reward arguments;
`run.name` and other text fields bounded.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vlmrl.cli.app import app
from vlmrl.config.load import MAX_CONFIG_BYTES
from vlmrl.config.schema import ConfigError, load_config
from vlmrl.train.args import override_problems

runner = CliRunner()

# --- the refusals, through both commands ----------------------------------------------------------------------

REWARD = "rewards: [{{function: 'trl.rewards:accuracy_reward', columns: {}}}]\n"
# (id, the YAML written to the file, what the one error line must name)
CASES = [
    # trl_overrides checked against GRPOConfig
    ("top_p text", "train:\n  trl_overrides: {top_p: x}\n", "train.trl_overrides.top_p"),
    ("scale_rewards 42", "train:\n  trl_overrides: {scale_rewards: 42}\n", "scale_rewards"),
    ("push_to_hub", "train:\n  trl_overrides: {push_to_hub: true}\n", "--push-to-hub"),
    ("save_strategy", "train:\n  trl_overrides: {save_strategy: 'no'}\n", "train.save_steps"),
    ("generation_kwargs", "train:\n  trl_overrides: {generation_kwargs: {top_k: 5}}\n", "train.temperature"),
    ("remove_unused_columns", "train:\n  trl_overrides: {remove_unused_columns: true}\n",
     "rewards take every data column"),
    # wrong configs accepted silently before
    ("duplicate key", "train:\n  max_steps: 3\n  max_steps: 4\n",  # line 1 of the file is run.output_dir
     "line 4: key 'max_steps' given twice in one mapping (first on line 3)"),
    ("duplicate section", "run: {name: a}\nrun: {name: b}\n", "line 2: key 'run' given twice"),
    ("trl_overrides list", "train:\n  trl_overrides: [1, 2]\n", "train.trl_overrides must be a mapping"),
    ("max_steps true", "train:\n  max_steps: true\n", "train.max_steps: true is not a number"),
    ("load_in_4bit off text", "model:\n  load_in_4bit: 'off'\n", "model.load_in_4bit: 'off' is not true or false"),
    # sizes
    ("alias bomb", "a: &a [" + ",".join(["lol"] * 9) + "]\n" + "".join(
        f"{c}: &{c} [{','.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")), "aliases"),
    ("recursive alias", "a: &a [*a]\n", "alias inside its own anchor"),
    # reward weights, column maps, names
    ("weight 1e308", "rewards: [{name: format, weight: 1.0e+308}]\n", "rewards.0.weight: |weight| must be at most"),
    ("data.columns role", "data:\n  columns: {solution: completions}\n", "data.columns: 'solution' is no column role"),
    ("reward columns onto a TRL argument", REWARD.format("{completions: answer}"), "TRL passes `completions`"),
    ("reward columns from a TRL argument", REWARD.format("{solution: completions}"), "TRL passes `completions`"),
    ("long run.name", f"run:\n  name: {'n' * 1000}\n", "at most 128 printable characters"),
    ("run.name with a tab", "run:\n  name: \"a\\tb\"\n", "run.name='a\\tb'"),
]


def _one_error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in output, output
    return lines[0]


@pytest.mark.parametrize("command", ["config validate", "run"])
@pytest.mark.parametrize(("text", "names"), [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_validate_and_run_refuse_in_one_line(tmp_path, monkeypatch, command, text, names):
    monkeypatch.setattr("vlmrl.pipeline.run_all", lambda *a, **k: pytest.fail("a stage started"))
    path = tmp_path / "c.yaml"
    path.write_text(text if text.startswith("run:") else f"run: {{output_dir: {tmp_path / 'runs'}}}\n{text}")
    result = runner.invoke(app, [*command.split(), str(path)], terminal_width=100_000)
    assert result.exit_code == 2, result.output
    message = result.output
    assert names in " ".join(message.split()), message
    _one_error_line(message)
    assert len(message) < 2_000
    assert not (tmp_path / "runs").exists()


def test_use_vllm_without_vllm_is_refused_naming_vlmrls_own_rollouts(tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    for setting in ("train.trl_overrides.use_vllm=true",):
        for command in (["config", "validate", "demo"], ["run", "demo", "--set", f"run.output_dir={tmp_path}"]):
            result = runner.invoke(app, [*command, "--set", setting], terminal_width=100_000)
            assert result.exit_code == 2, result.output
            line = " ".join(result.output.split())
            assert "vLLM is not installed" in line and "train.rollout" in line, line
            assert not any(tmp_path.iterdir())


# --- trl_overrides against GRPOConfig -------------------------------------------------------------------------


def test_trl_override_values_are_typed_by_grpo_config_and_valid_ones_pass():
    problems = override_problems({"top_p": "x", "top_k": True, "scale_rewards": 42, "beta": "1e-5", "use_cpu": True,
                                  "hub_model_id": "me/x", "eval_strategy": "steps"})
    by_key = {p.split(":")[0].split("=")[0]: p for p in problems}
    assert "GRPOConfig.top_p is float" in by_key["train.trl_overrides.top_p"]
    assert "GRPOConfig.top_k is int" in by_key["train.trl_overrides.top_k"]  # true is not 1
    assert "'group', 'batch', 'none'" in by_key["train.trl_overrides.scale_rewards"]
    assert "write 1.0e-5" in by_key["train.trl_overrides.beta"]  # YAML reads 1e-5 as text
    assert "set by vlmrl" in by_key["train.trl_overrides.use_cpu"]
    assert "--push-to-hub" in by_key["train.trl_overrides.hub_model_id"]
    assert "train.eval_every_steps" in by_key["train.trl_overrides.eval_strategy"]
    assert override_problems({"top_p": 0.9, "top_k": 3, "scale_rewards": "batch", "min_p": 0.1,
                              "repetition_penalty": 1.1, "lr_scheduler_kwargs": {"min_lr": 0.0}}) == []
    assert override_problems({"scale_rewards": False}) == []  # TRL reads false as "none"


# --- what a user types keeps working --------------------------------------------------------------------------


def test_set_overrides_typed_on_the_command_line_still_load():
    config = load_config("demo", ["model.load_in_4bit=true", "train.max_steps=5", "eval.do_sample=false",
                                  "train.learning_rate=1e-5", "train.trl_overrides.top_p=0.9", "run.name=my-run_2"])
    assert config.model.load_in_4bit is True and config.train.max_steps == 5 and config.eval.do_sample is False
    assert config.train.learning_rate == 1e-5 and config.train.trl_overrides["top_p"] == 0.9


def test_a_merge_key_overridden_in_its_mapping_is_not_a_key_given_twice(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  trl_overrides: {beta: 0.04}\n"
                    "model: &m {name: 'tiny:qwen3_vl'}\neval: {<<: {batch_size: 4}, batch_size: 2}\n")
    config = load_config(str(path))
    assert config.train.trl_overrides["beta"] == 0.04 and config.eval.batch_size == 2


# --- sizes and the messages that quote values -----------------------------------------------------------------


def test_an_alias_bomb_is_refused_at_once_in_a_short_message(tmp_path):
    levels = "".join(f"l{i + 1}: &l{i + 1} [{', '.join([f'*l{i}'] * 9)}]\n" for i in range(12))
    path = tmp_path / "bomb.yaml"
    path.write_text(f"train:\n  trl_overrides:\n    x: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n{levels}")
    started = time.perf_counter()
    with pytest.raises(ConfigError, match="once its aliases") as caught:
        load_config(str(path))
    assert time.perf_counter() - started < 1 and len(str(caught.value)) < 500
    with pytest.raises(ConfigError, match="once its aliases"):  # the same through --set
        load_config("demo", ["train.trl_overrides={a: &a [x, x, x, x, x, x, x, x, x, x], b: &b ["
                             + ", ".join(["*a"] * 10) + "], c: &c [" + ", ".join(["*b"] * 10) + "], d: ["
                             + ", ".join(["*c"] * 10) + "], e: [" + ", ".join(["*c"] * 10_000) + "]}"])


def test_a_file_over_the_size_bound_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("train:\n  trl_overrides:\n" + "".join(f"    k{i}: {i}\n" for i in range(MAX_CONFIG_BYTES // 10)))
    with pytest.raises(ConfigError, match=f"at most {MAX_CONFIG_BYTES}"):
        load_config(str(path))


def test_an_error_quotes_a_long_value_cut_short(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  load_in_4bit: '" + "x" * 100_000 + "'\ndata:\n  families: [" + ", ".join(
        [f"'{'y' * 3000}'"] * 200) + "]\n  holdout_size: [" + ", ".join(["1"] * 5000) + "]\n")
    with pytest.raises(ConfigError) as caught:
        load_config(str(path))
    message = str(caught.value)
    assert "model.load_in_4bit" in message and "data.holdout_size" in message and len(message) < 3_000


# --- reward weights, column maps, names -----------------------------------------------------------------------


@pytest.mark.parametrize("weight", ["1.0e+308", "-1.0e+7", ".inf", ".nan"])
def test_an_absurd_or_non_finite_reward_weight_is_refused(weight):
    with pytest.raises(ConfigError, match="rewards.0.weight"):
        load_config("demo", [f"rewards=[{{name: format, weight: {weight}}}]"])
    assert load_config("demo", ["rewards=[{name: format, weight: -1.0e+6}]"]).rewards[0].weight == -1e6


def test_column_maps_keep_to_roles_and_clear_of_trl_arguments():
    for columns in ("{question: q, answer: a, image: img}", "{}"):
        load_config("demo", [f"data.columns={columns}"])
    with pytest.raises(ConfigError, match="'answers' is no column role"):
        load_config("demo", ["data.columns={question: q, answers: a}"])
    spec = load_config("demo", ["rewards=[{function: 'trl.rewards:accuracy_reward', columns: {solution: answer}}]"])
    assert spec.rewards[0].columns == {"solution": "answer"}
    for columns in ("{prompts: question}", "{trainer_state: answer}", "{solution: completion_ids}"):
        with pytest.raises(ConfigError, match="TRL passes"):
            load_config("demo", [f"rewards=[{{function: 'trl.rewards:accuracy_reward', columns: {columns}}}]"])


def test_run_name_and_text_fields_that_become_paths_are_bounded():
    assert load_config("demo", ["run.name=" + "n" * 128]).run.name == "n" * 128
    for override, named in ((f"run.name={'n' * 129}", "run.name"), ('run.name="a\\nb"', "run.name"),
                            ('run.output_dir="runs\\n/x"', "run.output_dir"),
                            ("data.source=" + "s" * 5000, "data.source"),
                            ('model.name="a\\0b"', "model.name"), ("export.llama_cpp_dir=" + "d" * 5000, "cpp_dir")):
        with pytest.raises(ConfigError, match=named) as caught:
            load_config("demo", [override])
        assert len(str(caught.value)) < 1_000


def test_the_run_folder_path_is_where_the_name_says(tmp_path):
    config = load_config("demo", [f"run.output_dir={tmp_path}", "run.name=x.y-z_1 (copy)"])
    assert config.run_dir == Path(tmp_path) / "x.y-z_1 (copy)"
