"""Config: presets load, the seed preset is the write-up's recipe, bad configs fail clearly."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from vlmrl.config.schema import PRESETS, ConfigError, load_config, validate_config


@pytest.mark.parametrize("preset", PRESETS)
def test_every_shipped_preset_loads(preset):
    config = load_config(preset)
    assert config.run.name == preset


def test_seed_preset_is_the_write_up_recipe_field_for_field():
    c = load_config("seed")
    assert c.model.name == "unsloth/Qwen3-VL-8B-Instruct-unsloth-bnb-4bit" and c.model.load_in_4bit
    assert (c.lora.r, c.lora.alpha, c.lora.attention, c.lora.mlp, c.lora.vision) == (16, 16, True, True, False)
    t = c.train
    assert (t.learning_rate, t.trl_value("lr_scheduler_type"), t.optim) == (5e-6, "cosine", "adamw_8bit")
    assert (t.per_device_train_batch_size, t.gradient_accumulation_steps, t.num_generations) == (8, 4, 4)
    assert (t.max_completion_length, t.num_train_epochs, t.max_grad_norm) == (1024, 1.0, 0.1)
    assert (t.algorithm, t.loss_type) == ("gspo", "dr_grpo")
    assert [(r.name, r.weight) for r in c.rewards] == [("format", 0.3), ("correctness", 1.0)]
    # the write-up's, passed to TRL as they are
    assert t.trl_overrides == {"lr_scheduler_type": "cosine", "mask_truncated_completions": False}
    d = c.data
    assert (d.source, d.split, d.holdout_size, d.image_size, d.resize) == ("AI4Math/MathVista", "testmini", 100, 512, "squash")


def test_gspo_paper_preset():
    t = load_config("gspo-paper").train
    assert (t.loss_type, t.trl_value("epsilon"), t.trl_value("epsilon_high"), t.trl_value("beta")) == (
        "grpo", 3e-4, 4e-4, 0.0)
    # four optimizer steps per generation batch
    assert t.steps_per_generation // t.gradient_accumulation_steps == 4


def test_override_applies_and_is_typed():
    c = load_config("demo", ["train.learning_rate=1e-5", "run.name=x", "data.families=[bar_value]"])
    assert c.train.learning_rate == 1e-5 and c.run.name == "x" and c.data.families == ["bar_value"]


def test_misspelt_key_is_named_with_a_suggestion():
    with pytest.raises(ConfigError) as err:
        load_config("demo", ["train.learnin_rate=1e-5"])
    assert "train.learnin_rate" in str(err.value) and "train.learning_rate" in str(err.value)


def test_unknown_section_is_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"trian": {"learning_rate": 1e-5}}))
    with pytest.raises(ConfigError, match="'trian'.*did you mean 'train'"):
        load_config(str(path))


def test_wrong_type_names_field():
    with pytest.raises(ConfigError, match="train.learning_rate"):
        load_config("demo", ["train.learning_rate=fast"])


def test_generation_batch_must_hold_whole_groups():
    with pytest.raises(ConfigError, match="not divisible by num_generations=3"):
        load_config("seed", ["train.num_generations=3"])


def test_trls_reward_weights_are_refused_with_the_rewards_list():
    with pytest.raises(ConfigError) as info:
        load_config("seed", ["train.reward_weights=[0.5, 2.0]"])
    message = str(info.value)
    assert "\n" not in message and "the top-level `rewards:` list" in message
    assert "{name: format, weight: 0.5}, {name: correctness, weight: 2.0}" in message


def test_vllm_with_vision_lora_is_contradictory():
    with pytest.raises(ConfigError, match="vLLM cannot serve LoRA on vision layers"):
        load_config("seed", ["train.trl_overrides.use_vllm=true", "lora.vision=true"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match="mapping"):
        validate_config([1, 2])


def test_fingerprint_changes_with_the_section_it_covers():
    a, b = load_config("demo"), load_config("demo", ["train.learning_rate=3e-3"])
    assert a.fingerprint("data") == b.fingerprint("data")
    assert a.fingerprint("train") != b.fingerprint("train")


def test_a_relative_data_source_in_a_config_file_is_beside_the_file(tmp_path, monkeypatch):
    folder = tmp_path / "task"
    folder.mkdir()
    (folder / "rows.jsonl").write_text("{}\n")
    (folder / "config.yaml").write_text("data:\n  source: rows.jsonl\n")
    monkeypatch.chdir(tmp_path)
    assert load_config(str(folder / "config.yaml")).data.source == str((folder / "rows.jsonl").resolve())
    # given on the command line it stays relative to the current folder; a hub id is left alone
    assert load_config(str(folder / "config.yaml"), ["data.source=other.jsonl"]).data.source == "other.jsonl"
    (folder / "hub.yaml").write_text("data:\n  source: AI4Math/MathVista\n")
    assert load_config(str(folder / "hub.yaml")).data.source == "AI4Math/MathVista"


def test_the_loading_side_is_importable_alone_and_its_doctests_pass():
    """vlmrl.config.load sits below vlmrl.config.schema (no cycle): a fresh interpreter imports it alone."""
    import doctest
    import subprocess
    import sys

    import vlmrl.config.load

    result = doctest.testmod(vlmrl.config.load)
    assert result.attempted > 0 and result.failed == 0
    # the package's own import pins the CPU kernels (vlmrl.common.cpu_numerics, os alone): nothing else comes in
    alone = ('vlmrl.config', 'vlmrl.config.load', 'vlmrl.common', 'vlmrl.common.cpu_numerics')
    probe = ("import sys, vlmrl.config.load; "
             f"print(sorted(m for m in sys.modules if m.startswith('vlmrl.') and m not in {alone!r}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert vlmrl.config.load.ConfigError is ConfigError and vlmrl.config.load.PRESETS is PRESETS


# --- train.trl_overrides ---------------------------------------------------------------------------------------


def test_the_trl_values_vlmrl_sets_keep_their_ranges_in_trl_overrides():
    """beta, epsilon, epsilon_high, num_iterations, warmup_ratio and lr_scheduler_type in train.trl_overrides are
    checked for type and range, each error named by its entry; a --set mapping adds to the preset's entries."""
    from vlmrl.config.schema import dump_config

    config = load_config("demo", ["train.trl_overrides={beta: 0.04, epsilon: 3.0e-4}"])
    assert (config.train.trl_value("beta"), config.train.trl_value("epsilon_high")) == (0.04, None)
    shown = yaml.safe_load(dump_config(config, changed_only=True))  # what `vlmrl config show` prints
    assert shown["train"]["trl_overrides"] == {**load_config("demo").train.trl_overrides, "beta": 0.04, "epsilon": 3e-4}
    assert load_config("demo", ["train.trl_overrides.epsilon=1"]).train.trl_overrides["epsilon"] == 1.0  # a float
    assert load_config("gspo-paper", ["train.trl_overrides={top_p: 0.9}"]).train.trl_overrides == {
        "epsilon": 3e-4, "epsilon_high": 4e-4, "beta": 0.0, "lr_scheduler_type": "cosine", "top_p": 0.9}
    for override, named in (("train.trl_overrides.epsilon=0", "train.trl_overrides.epsilon: Input should be greater than 0"),
                            ("train.trl_overrides.beta=-1", "train.trl_overrides.beta: Input should be greater than"),
                            ("train.trl_overrides.num_iterations=0", "train.trl_overrides.num_iterations"),
                            ("train.trl_overrides.warmup_ratio=1.0",
                             "train.trl_overrides.warmup_ratio: Input should be less than 1"),
                            ("train.trl_overrides.epsilon_high=0.1",
                             "train.trl_overrides.epsilon_high=0.1 must be >= epsilon=0.2")):
        with pytest.raises(ConfigError) as info:
            load_config("demo", [override])
        assert [line for line in str(info.value).splitlines() if named in line], str(info.value)


def test_a_field_of_an_earlier_development_version_is_an_unknown_key():
    """No migration: a renamed or removed field is refused like any unknown key, with the closest valid one."""
    with pytest.raises(ConfigError, match="unknown key 'train.beta'"):
        load_config("demo", ["train.beta=0.04"])
    with pytest.raises(ConfigError, match="unknown key 'export.gguf_quantization'"):
        load_config("demo", ["export.gguf_quantization=q8_0"])


# --- schema_version -------------------------------------------------------------------------------------------


def run_folder(tmp_path: Path, text: str) -> Path:
    from vlmrl.run.claim import MARKER

    folder = tmp_path / "run"
    folder.mkdir(parents=True)
    (folder / MARKER).touch()
    (folder / "config.yaml").write_text(text)
    return folder


def test_a_run_folders_config_carries_the_schema_version_and_one_without_it_is_refused(tmp_path):
    from vlmrl.config.load import SCHEMA_VERSION
    from vlmrl.config.schema import dump_config

    written = dump_config(load_config("demo"))
    assert written.startswith(f"schema_version: {SCHEMA_VERSION}\n")  # the first line of every run's config.yaml
    assert load_config(str(run_folder(tmp_path / "a", written) / "config.yaml"), run_folder=True) == load_config("demo")
    for text, found in (("run: {name: old}\n", "no schema_version"),
                        ("schema_version: 99\nrun: {name: old}\n", "schema_version 99")):
        path = run_folder(tmp_path / found.replace(" ", "_"), text) / "config.yaml"
        with pytest.raises(ConfigError) as info:
            load_config(str(path), run_folder=True)
        message = str(info.value)
        assert "\n" not in message and message.startswith(f"{path}: {found}, this vlmrl reads schema_version 1")
        assert "another run.name" in message and "--force" in message
    # a config file of one's own may leave it out, but not name another version
    own = tmp_path / "own.yaml"
    own.write_text("run: {name: mine}\n")
    assert load_config(str(own)).schema_version == SCHEMA_VERSION
    own.write_text("schema_version: 2\n")
    with pytest.raises(ConfigError, match="schema_version 2, this vlmrl reads schema_version 1: delete the line"):
        load_config(str(own))


def test_the_cli_refuses_a_run_folder_without_a_schema_version_in_one_line_exit_2(tmp_path):
    from typer.testing import CliRunner

    from vlmrl.cli.app import app

    folder = run_folder(tmp_path, "run: {name: old}\n")
    for command in (["config", "show", str(folder)], ["run", "demo", "--set", f"run.output_dir={tmp_path}",
                                                      "--set", "run.name=run"]):
        result = CliRunner().invoke(app, command, terminal_width=100_000)
        assert result.exit_code == 2, result.output
        line = " ".join(result.output.split())
        assert "no schema_version, this vlmrl reads schema_version 1" in line and "another run.name" in line, line
    assert (folder / "config.yaml").read_text() == "run: {name: old}\n"  # nothing rewritten


# --- fingerprints ---------------------------------------------------------------------------------------------


def test_every_field_is_classified_for_the_fingerprints():
    """Each field of the schema either decides some stage's outputs (STAGE_FIELDS) or none (NO_OUTPUT_FIELDS),
    never both, and neither list names a field that is gone: a field added to a section fails here until it is
    classified in vlmrl.config.fingerprints."""
    from vlmrl.config.fingerprints import NO_OUTPUT_FIELDS, RESUMABLE_FIELDS, STAGE_FIELDS, schema_fields
    from vlmrl.config.schema import Config

    fields = schema_fields(Config)
    listed = {path for paths in STAGE_FIELDS.values() for path in paths}
    unclassified = [f for f in fields if f not in listed and f not in NO_OUTPUT_FIELDS]
    assert not unclassified, (f"classify {unclassified} in vlmrl.config.fingerprints: a stage's list in STAGE_FIELDS "
                              "(its value decides that stage's outputs) or NO_OUTPUT_FIELDS (with why it decides none)")
    assert not [f for f in fields if f in listed and f in NO_OUTPUT_FIELDS]
    assert not [f for f in [*listed, *NO_OUTPUT_FIELDS] if f not in fields], "a listed field is not in the schema"
    assert all(len(set(paths)) == len(paths) for paths in STAGE_FIELDS.values())
    assert all(f in STAGE_FIELDS["train"] or f.rpartition(".")[0] in STAGE_FIELDS["train"] for f in RESUMABLE_FIELDS)


def _prints(config) -> dict[str, str]:
    from vlmrl.config.fingerprints import STAGE_FIELDS
    from vlmrl.run.layout import (
        checkpoint_fingerprint,
        eval_fingerprint,
        export_fingerprint,
        train_fingerprint,
    )

    return {**{stage: config.fingerprint(stage) for stage in STAGE_FIELDS}, "all": config.fingerprint(),
            "train_fingerprint": train_fingerprint(config), "checkpoint": checkpoint_fingerprint(config),
            "export_fingerprint": export_fingerprint(config), "eval_fingerprint": eval_fingerprint(config)}


@pytest.mark.parametrize(("override", "changed"), [
    ("data.holdout_size=7", {"data", "train", "all", "train_fingerprint", "checkpoint", "export_fingerprint"}),
    ("contract=think", {"data", "eval", "all", "train_fingerprint", "checkpoint", "export_fingerprint",
                        "eval_fingerprint"}),
    ("model.dtype=bfloat16", {"eval", "train", "all", "train_fingerprint", "checkpoint", "export_fingerprint",
                             "eval_fingerprint"}),
    ("eval.max_new_tokens=7", {"eval", "all", "eval_fingerprint"}),
    ("lora.r=8", {"train", "all", "train_fingerprint", "checkpoint", "export_fingerprint"}),
    ("train.trl_overrides.beta=0.04", {"train", "all", "train_fingerprint", "checkpoint", "export_fingerprint"}),
    ("train.rollout.prompt_bucket=32", {"train", "all", "train_fingerprint", "checkpoint", "export_fingerprint"}),
    # a change a resumed training may make: the training runs on from its checkpoints
    ("train.max_steps=9", {"train", "all", "train_fingerprint", "export_fingerprint"}),
    ("train.trl_overrides.logging_steps=5", {"train", "all", "train_fingerprint", "export_fingerprint"}),
    ("health.stop_on_gibberish_steps=3", {"train", "all", "train_fingerprint", "export_fingerprint"}),
    ("export.gguf=f16", {"export", "all", "export_fingerprint"}),
    ("rewards=[{name: format, weight: 0.5}, {name: correctness}]",
     {"rewards", "all", "train_fingerprint", "checkpoint", "export_fingerprint"}),
    # decides no stage's output: no fingerprint moves
    ("run.name=elsewhere", set()),
    ("run.output_dir=/tmp/elsewhere", set()),
    ("train.report_to=[tensorboard]", set()),
    ("train.rollout.kernels=false", set()),
    ("health.max_gibberish_rate=0.5", set()),
    ("rewards=[{name: format, weight: 0.3, timeout_s: 5}, {name: correctness}]", set()),
    # vlmrl's own value of a TRL field written out is the same run
    ("train.trl_overrides.epsilon=0.2", set()),
])
def test_a_field_moves_exactly_the_fingerprints_of_the_stages_it_decides(override, changed):
    base = _prints(load_config("demo"))
    after = _prints(load_config("demo", [override]))
    assert {name for name in base if base[name] != after[name]} == changed


def test_a_field_added_to_a_section_changes_no_fingerprint_until_it_is_listed():
    """The schema edit needs no compatibility entry: fingerprints read only the listed fields."""
    from pydantic import Field

    from vlmrl.config.fingerprints import STAGE_FIELDS, fingerprint
    from vlmrl.config.schema import Config, DataConfig, TrainConfig

    class WiderData(DataConfig):
        new_knob: int = Field(3, description="a field added later")

    class WiderTrain(TrainConfig):
        new_switch: bool = Field(False, description="another")

    class Wider(Config):
        data: WiderData = Field(default_factory=WiderData)
        train: WiderTrain = Field(default_factory=WiderTrain)

    for stage in [*STAGE_FIELDS, None]:
        assert fingerprint(Wider(), stage) == fingerprint(Config(), stage)
