"""The CLI surface: commands listed, doctor works without a GPU, config errors exit 2, bench results printed."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from vlmrl.cli.app import app

runner = CliRunner()


def test_help_lists_every_command():
    out = runner.invoke(app, ["--help"], terminal_width=200).output
    for command in ("run", "doctor", "prepare", "eval", "train", "compare", "export", "report", "bench", "config",
                    "tiny-model"):
        assert command in out


def test_doctor_exits_zero_and_writes_env_json(tmp_path):
    result = runner.invoke(app, ["doctor", str(tmp_path)])
    assert result.exit_code == 0, result.output
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["packages"]["torch"] and env["packages"]["trl"]
    assert set(env["backends"]) == {"unsloth", "bitsandbytes", "vllm", "flash-attn"}
    assert isinstance(env["cuda"]["available"], bool)


def test_config_show_seed_prints_the_recipe(tmp_path):
    full = runner.invoke(app, ["config", "show", "seed", "--all"])
    assert full.exit_code == 0
    assert "importance" not in full.output  # our field is `algorithm`, mapped to TRL later
    assert "algorithm: gspo" in full.output and "learning_rate: 5.0e-06" in full.output
    short = runner.invoke(app, ["config", "show", "seed"])
    assert short.exit_code == 0 and len(short.output.splitlines()) <= 60  # one screen
    assert "seed: 3407" in short.output and "load_in_4bit: true" in short.output  # what the preset changes
    assert "learning_rate" not in short.output  # a default
    # the short form is the same config: it loads back to the same fingerprint
    (tmp_path / "short.yaml").write_text(short.output)
    again = runner.invoke(app, ["config", "validate", str(tmp_path / "short.yaml")])
    reference = runner.invoke(app, ["config", "validate", "seed"])
    assert again.output.split("fingerprint")[1] == reference.output.split("fingerprint")[1]


def test_config_validate_misspelt_key_exits_2_naming_it(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  num_generatons: 4\n")
    result = runner.invoke(app, ["config", "validate", str(path)], terminal_width=200)
    assert result.exit_code == 2
    assert "train.num_generatons" in result.output and "num_generations" in result.output


def test_bench_needs_a_gpu_and_one_gpu_per_process(monkeypatch):
    import torch

    result = runner.invoke(app, ["bench"], terminal_width=200)
    if not torch.cuda.is_available():
        assert result.exit_code != 0 and "needs a CUDA GPU" in result.output
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    result = runner.invoke(app, ["bench"], terminal_width=200)
    assert result.exit_code != 0 and "2 GPUs are visible to one process" in result.output
    assert "Traceback" not in result.output
    result = runner.invoke(app, ["bench", "--paths", "plain,fast"], terminal_width=200)
    assert result.exit_code != 0 and "unknown bench path(s) fast" in result.output
    result = runner.invoke(app, ["bench", "--generation-batches", "32,50"], terminal_width=200)
    assert result.exit_code != 0 and "generation batch 50 is not a positive multiple of the 4" in result.output


def test_config_validate_with_a_broken_checker_answers_in_one_line(monkeypatch):
    def broken(config):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr("vlmrl.train.args.training_problems", broken)
    result = runner.invoke(app, ["config", "validate", "demo"], terminal_width=200)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "could not check the training settings: RuntimeError: boom" in result.output
    assert "second line" not in result.output


def test_bench_results_print_as_written_and_a_failed_path_exits_2(tmp_path, capsys):
    from vlmrl.cli.show import show_bench, show_throughput

    (tmp_path / "bench.md").write_text("| path | samples/s |\n| plain | 1.0 |\n")
    show_bench(tmp_path, {"paths": {"plain": {"samples_per_s": 1.0}}})
    assert "| plain | 1.0 |" in capsys.readouterr().out
    with pytest.raises(typer.Exit) as exited:
        show_bench(tmp_path, {"paths": {"plain": {}, "vlmrl": {"error": "CUDA out of memory"}}})
    assert exited.value.exit_code == 2 and "bench path(s) failed: vlmrl" in capsys.readouterr().out
    (tmp_path / "throughput.md").write_text("| batch |\n")
    with pytest.raises(typer.Exit):
        show_throughput(tmp_path, {"rows": [{"path": "vlmrl", "generation_batch": 64, "error": "skipped"}]})
    assert "generation batch(es) failed or skipped: vlmrl at 64" in capsys.readouterr().out


def test_a_plain_folder_named_like_a_preset_does_not_hide_the_preset(tmp_path, monkeypatch):
    """`vlmrl config show demo` in a folder that holds a plain `demo/` folder shows the preset; a folder without
    config.yaml under another name is still refused in one line, and a run folder named `demo` is that run."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").mkdir()
    shown = runner.invoke(app, ["config", "show", "demo", "--all"])
    assert shown.exit_code == 0 and "name: demo" in shown.output, shown.output
    (tmp_path / "other").mkdir()
    refused = runner.invoke(app, ["config", "show", "other"])
    assert refused.exit_code == 2 and "a folder without config.yaml" in refused.output
    (tmp_path / "demo" / "config.yaml").write_text("run: {name: mine, seed: 7}\n")
    run_folder = runner.invoke(app, ["config", "show", "demo", "--all"])
    assert run_folder.exit_code == 0 and "seed: 7" in run_folder.output, run_folder.output
