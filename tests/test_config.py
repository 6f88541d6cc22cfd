"""Config: presets load, the seed preset is the write-up's recipe, bad configs fail clearly."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from vlmrl.config.schema import PRESETS, ConfigError, load_config, validate_config

# The demo preset's data before its held-out set grew to 128: the fingerprints recorded by earlier code use them.
OLD_DEMO_DATA = ["data.num_synthetic=480", "data.holdout_size=64"]


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


def test_old_reward_weights_are_refused_with_the_new_form():
    with pytest.raises(ConfigError) as info:
        load_config("seed", ["train.reward_weights=[0.5, 2.0]"])
    message = str(info.value)
    assert "\n" not in message and "replaced by a top-level `rewards:` list" in message
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


# --- fields of earlier releases --------------------------------------------------------------------------------


def test_a_removed_speed_switch_is_refused_naming_where_it_went(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  rollout_stacked: true\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    message = str(info.value)
    assert "\n" not in message and "train.rollout_stacked was removed" in message and "automatically" in message
    with pytest.raises(ConfigError, match="train.rollout_merge was removed: an experiment.*benchmarks/"):
        load_config("demo", ["train.rollout_merge=true"])
    with pytest.raises(ConfigError, match="train.loss_kernels was removed: see train.rollout.kernels"):
        load_config("demo", ["train.loss_kernels=false"])


def test_renamed_and_trl_fields_are_moved(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  fast_generation: never\n  logging_steps: 5\n  generation_backend: hf\n")
    config = load_config(str(path), ["train.prompt_bucket=32"])
    assert (config.train.rollout.fast, config.train.rollout.prompt_bucket) == ("never", 32)
    assert config.train.trl_overrides == {"logging_steps": 5}
    assert load_config("demo", ["train.fast_generation=always"]).train.rollout.fast == "always"  # --set wins


def test_a_run_folder_written_before_keeps_its_fingerprints():
    """A run folder's config.yaml from before `train.rollout` (every field written out, a kernel switched off,
    logging_steps and fast_generation set) loads, and gives the fingerprints that release recorded: the run
    resumes instead of training again. The expected values were computed by the code of commit d9d356d."""
    from vlmrl.run.layout import checkpoint_fingerprint, export_fingerprint, train_fingerprint

    old = Path(__file__).parent / "fixtures" / "config_before_rollout_section.yaml"
    with pytest.raises(ConfigError, match="was removed"):
        load_config(str(old))  # as a config file of one's own: the removed fields are named
    config = load_config(str(old), migrate=True)
    assert config.train.rollout.fast == "never" and config.train.rollout.kernels is False
    assert config.train.trl_overrides == {"logging_steps": 3, "save_total_limit": 2, "mask_truncated_completions": False,
                                          "lr_scheduler_type": "constant", "warmup_ratio": 0.0, "num_iterations": 1,
                                          "epsilon": 0.2, "epsilon_high": None, "beta": 0.0}
    assert config.export.gguf == "off" and "logits_atol" not in config.export.model_dump()
    assert config.fingerprint() == "7ecbb038f25a08d0"
    assert train_fingerprint(config) == "6bfdf509b637c6116ddabed10"
    assert export_fingerprint(config) == "6bfdf509b637c6116ddabed10e6d5b64a"
    assert checkpoint_fingerprint(config) == "01727d15a92a5d11"
    assert config.data_fingerprint() == "6dda366e21ceafff"
    # the presets' runs resume too (the demo's data as they were then: 480 items, 64 held out)
    for preset, extra, expected in (("demo", OLD_DEMO_DATA, "eec369f58bb3ffae6ddabed10"),
                                    ("seed", [], "724298fc143a3bad0f17bed13407")):
        assert train_fingerprint(load_config(preset, extra)) == expected


def test_train_fields_that_were_trl_names_move_to_trl_overrides_with_their_ranges(tmp_path):
    """train.beta, epsilon, epsilon_high, num_iterations, warmup_ratio and lr_scheduler_type of earlier releases
    land in train.trl_overrides (same run, same fingerprint), where their ranges still hold, named by entry."""
    from vlmrl.config.schema import dump_config

    path = tmp_path / "c.yaml"
    path.write_text("train:\n  beta: 0.04\n  epsilon: 3.0e-4\n")
    config = load_config(str(path))
    assert config.train.trl_overrides == {"beta": 0.04, "epsilon": 3e-4}
    assert (config.train.trl_value("beta"), config.train.trl_value("epsilon_high")) == (0.04, None)
    old = load_config("demo", [*OLD_DEMO_DATA, "train.beta=0.04", "train.epsilon=3e-4"])
    assert old.fingerprint() == "90ae550e0a7bfff4"  # computed by the code of commit 2d22fd8
    assert load_config("demo", [*OLD_DEMO_DATA, "train.trl_overrides.beta=0.04",
                                "train.trl_overrides.epsilon=3e-4"]).fingerprint() == "90ae550e0a7bfff4"
    shown = yaml.safe_load(dump_config(config, changed_only=True))  # what `vlmrl config show` prints
    assert shown["train"] == {"trl_overrides": {"beta": 0.04, "epsilon": 3e-4}}
    assert load_config("demo", ["train.epsilon=1"]).train.trl_overrides["epsilon"] == 1.0  # a float, as the field was
    # a --set mapping adds to the preset's entries: gspo-paper keeps its clip range, as when it was train.epsilon
    assert load_config("gspo-paper", ["train.trl_overrides={top_p: 0.9}"]).train.trl_overrides == {
        "epsilon": 3e-4, "epsilon_high": 4e-4, "beta": 0.0, "lr_scheduler_type": "cosine", "top_p": 0.9}
    for override, named in (("train.epsilon=0", "train.trl_overrides.epsilon: Input should be greater than 0"),
                            ("train.trl_overrides.beta=-1", "train.trl_overrides.beta: Input should be greater than"),
                            ("train.num_iterations=0", "train.trl_overrides.num_iterations"),
                            ("train.warmup_ratio=1.0", "train.trl_overrides.warmup_ratio: Input should be less than 1"),
                            ("train.epsilon_high=0.1", "train.trl_overrides.epsilon_high=0.1 must be >= epsilon=0.2")):
        with pytest.raises(ConfigError) as info:
            load_config("demo", [override])
        assert [line for line in str(info.value).splitlines() if named in line], str(info.value)


def test_gguf_and_its_quantization_are_one_field(tmp_path):
    """`export.gguf: true` + `gguf_quantization` of earlier releases become `export.gguf: <weights>` (`none` wrote
    f16), in a config file, a --set and a run folder; the export fingerprints are those the earlier code recorded
    (computed by the code of commit 2d22fd8)."""
    from vlmrl.run.layout import export_fingerprint

    def gguf(export: dict, *overrides: str, migrate: bool = False) -> str:
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump({"export": export}))
        return load_config(str(path), list(overrides), migrate=migrate).export.gguf

    assert gguf({"gguf": True, "gguf_quantization": "q8_0"}) == "q8_0"
    assert gguf({"gguf": True, "gguf_quantization": "none"}) == "f16"
    assert gguf({"gguf": True}) == "q8_0" and gguf({"gguf": False, "gguf_quantization": "q4_k_m"}) == "off"
    assert gguf({"gguf": True, "gguf_quantization": "q4_k_m", "logits_atol": 1e-3}, migrate=True) == "q4_k_m"
    assert gguf({}, "export.gguf=off") == "off" and gguf({"gguf": "f16"}, "export.gguf=false") == "off"
    for old, expected in ((["export.gguf=true", "export.gguf_quantization=none"], "bb184e0e"),
                          (["export.gguf=true", "export.gguf_quantization=q4_k_m"], "1937f995"),
                          (["export.gguf=true"], "223a550d"), ([], "e6d5b64a")):
        assert export_fingerprint(load_config("demo", [*OLD_DEMO_DATA, *old])) == "eec369f58bb3ffae6ddabed10" + expected


def test_export_logits_atol_is_refused_in_a_config_file_and_dropped_in_a_run_folder(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("export:\n  logits_atol: 0.001\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert str(info.value) == (f"{path}: export.logits_atol was removed: the adapter reload check's tolerance is "
                               "fixed (vlmrl.export.merge.LOGITS_ATOL); delete the line.")
    assert "logits_atol" not in load_config(str(path), migrate=True).export.model_dump()  # a run folder's
