"""The CLI's errors and refusals (issue 18): user and OS errors are one line and exit 2 (a traceback only with
--debug), messages print literally, config sizes have bounds, a run that cannot train is refused before any
model loads, a preset's missing model and data are named in seconds, and a resumed run's train_loss covers
every step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.helpers import invoke, one_error_line, sets
from vlmrl.common.io import DamagedFileError, write_jsonl_atomic
from vlmrl.config.schema import load_config
from vlmrl.train.stage import total_train_loss

SMALL = ["model.name=tiny:qwen3_vl", "data.num_synthetic=24", "data.holdout_size=4",
         "train.per_device_train_batch_size=4", "train.gradient_accumulation_steps=1"]


# --- printing and OS errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["weird[/x].yaml", "runs[v2]/cfg.yaml"])
def test_messages_with_brackets_print_literally(name):
    result = invoke("config", "validate", name)
    assert result.exit_code == 2, result.output
    assert name in one_error_line(result.output)


def test_a_damaged_middle_line_is_one_line_and_debug_shows_the_traceback(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / ".vlmrl-run").touch()  # a run folder
    (run / "baseline_records.jsonl").write_text('{"id": "a"}\n{"id": tor\n{"id": "b"}\n')
    (run / "after_records.jsonl").write_text('{"id": "a"}\n')
    result = invoke("compare", str(run))
    assert result.exit_code == 2
    line = one_error_line(result.output)
    assert "baseline_records.jsonl:2" in line and "--debug" in line
    result = invoke("--debug", "compare", str(run))
    assert isinstance(result.exception, DamagedFileError)


def test_os_errors_are_one_line_exit_2(tmp_path):
    # run.name is bounded by the config (128 characters); a folder above it is the OS's to refuse
    result = invoke("prepare", "demo", *sets(*SMALL, f"run.output_dir={tmp_path / ('n' * 300)}"))
    assert result.exit_code == 2, result.output
    assert "File name too long" in one_error_line(result.output)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = invoke("prepare", "demo", *sets(*SMALL), "--run-dir", str(blocker / "run"))
    assert result.exit_code == 2 and "Not a directory" in one_error_line(result.output)


def test_a_full_disk_is_one_line_exit_2(tmp_path, monkeypatch):
    import errno

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("vlmrl.common.io.os.fsync", full)  # every crash-safe write fsyncs before its rename
    result = invoke("doctor", str(tmp_path / "run"))
    assert result.exit_code == 2 and "No space left on device" in one_error_line(result.output)
    assert not (tmp_path / "run" / "env.json").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_output_folder_is_one_line_exit_2(tmp_path):
    tmp_path.chmod(0o555)
    try:
        result = invoke("prepare", "demo", *sets(*SMALL), "--run-dir", str(tmp_path / "run"))
    finally:
        tmp_path.chmod(0o755)
    assert result.exit_code == 2 and "Permission denied" in one_error_line(result.output)


# --- bounds -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("setting", [
    "data.image_size=1", "data.image_size=100000", "model.max_seq_length=10000000", "eval.batch_size=100000",
    "train.num_generations=100000", "data.holdout_size=10000000", "train.max_completion_length=1000000",
    "eval.max_new_tokens=1000000", "train.per_device_train_batch_size=100000",
])
def test_config_validate_refuses_sizes_that_exhaust_memory_or_disk(setting):
    result = invoke("config", "validate", "demo", "--set", setting)
    assert result.exit_code == 2 and setting.split("=")[0] in result.output, result.output


def test_unknown_optimizer_is_refused_before_any_model_loads(tmp_path):
    from vlmrl.data.prepare import prepare_data

    config = load_config("demo", [*SMALL, f"run.output_dir={tmp_path}"])
    prepare_data(config, config.run_dir)
    result = invoke("train", "demo", *sets(*SMALL, "train.optim=adamw_nonsense"), "--run-dir", str(config.run_dir))
    assert result.exit_code == 2 and "adamw_nonsense" in one_error_line(result.output)
    assert not (config.run_dir / "train").exists()  # refused while building the trainer's arguments


# --- refusals: nothing to train on ---------------------------------------------------------------------------


def test_prepare_refuses_a_train_set_smaller_than_one_generation_batch(tmp_path):
    # 8 prompts per generation batch (8 completions x 4 micro-steps / 4 per group); 12 items - 6 held out = 6
    args = sets("model.name=tiny:qwen3_vl", "data.num_synthetic=12", "data.holdout_size=6",
                "train.per_device_train_batch_size=8", "train.gradient_accumulation_steps=4",
                "train.num_generations=4")
    result = invoke("prepare", "demo", *args, "--run-dir", str(tmp_path / "run"))
    assert result.exit_code == 2, result.output
    line = one_error_line(result.output)
    assert "6 training items left (6 held out" in line and "fewer than one generation batch (8 prompts" in line
    assert not (tmp_path / "run" / "data" / "summary.json").exists()  # not prepared: `run` will not skip it


@pytest.mark.parametrize("kept", [0, 2])
def test_train_refuses_too_few_items_before_loading_a_model(tmp_path, kept):
    from vlmrl.data.prepare import prepare_data

    config = load_config("demo", [*SMALL, f"run.output_dir={tmp_path}"])
    prepare_data(config, config.run_dir)
    train = config.run_dir / "data" / "train.jsonl"
    write_jsonl_atomic(train, [json.loads(line) for line in train.read_text().splitlines()[:kept]])
    result = invoke("train", "demo", *sets(*SMALL, "train.per_device_train_batch_size=16"),
                    "--run-dir", str(config.run_dir))
    assert result.exit_code == 2, result.output
    line = one_error_line(result.output)
    assert f"{kept} training items, fewer than one generation batch (4 prompts" in line
    assert "run `vlmrl prepare` first" not in line
    assert not (config.run_dir / "base-model").exists() and not (config.run_dir / "train").exists()


# --- a preset's requirements ---------------------------------------------------------------------------------


@pytest.mark.slow  # ~7 s: a `vlmrl run seed` subprocess
@pytest.mark.timeout(120)
def test_run_seed_without_the_hub_fails_in_seconds_naming_what_is_missing(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "empty-hf-home"), COLUMNS="200")
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "vlmrl.cli", "run", "seed", "--set", f"run.output_dir={tmp_path / 'runs'}"],
                          capture_output=True, text=True, env=env, timeout=110, check=False)
    seconds = time.perf_counter() - started
    assert done.returncode == 2, done.stdout + done.stderr
    line = one_error_line(done.stdout + done.stderr)
    config = load_config("seed")
    for needed in (config.model.name, config.data.source, "HF_HUB_OFFLINE", "model.name=/local/folder",
                   "data.source=/local/file"):
        assert needed in line, line
    assert seconds < 60 and not (tmp_path / "runs").exists()


# --- train_loss over a resumed run ----------------------------------------------------------------------------


def test_train_loss_covers_every_step_of_a_resumed_run(tmp_path):
    path = tmp_path / "metrics.jsonl"
    # logging every 2 steps: each logged loss is the mean of its 2 steps; the final row is TRL's own summary
    rows = [{"step": 2, "loss": 1.0}, {"step": 4, "loss": 3.0}, {"step": 5, "loss": 6.0},
            {"step": 5, "train_loss": 6.0, "train_runtime": 1.0}]
    write_jsonl_atomic(path, rows)
    assert total_train_loss(path, 5) == pytest.approx((2 * 1.0 + 2 * 3.0 + 6.0) / 5)
    assert total_train_loss(path, 6) is None  # the rows do not reach the last step: TRL's figure is kept
    write_jsonl_atomic(path, [])
    assert total_train_loss(path, 5) is None
