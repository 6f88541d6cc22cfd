"""The CLI surface: commands listed, doctor works without a GPU, config errors exit 2."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from vlmrl.cli import app

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


def test_config_show_seed_prints_the_recipe():
    result = runner.invoke(app, ["config", "show", "seed"])
    assert result.exit_code == 0
    assert "importance" not in result.output  # our field is `algorithm`, mapped to TRL later
    assert "algorithm: gspo" in result.output and "learning_rate: 5.0e-06" in result.output


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
