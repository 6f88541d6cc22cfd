"""Every user error exits 2 in one line; only a bug exits 1, with its traceback (issue 37).

Before: config, data, reward, training, evaluation, comparison and export errors exited 1 (the README promised
2), a full disk met by safetensors or PyTorch's checkpoint writer was a 100-line traceback with exit 1, and
`config validate` said "ok" for a reward file that does not exist. The walk below goes through the CLI's error
paths, one per kind of user error, and checks the code and the single `error:` line of each.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import invoke, one_error_line, sets
from vlmrl.common.io import read_json, read_jsonl
from vlmrl.config.schema import load_config
from vlmrl.data.prepare import prepare_data
from vlmrl.run import layout
from vlmrl.run.claim import MARKER

SMALL = ["model.name=tiny:qwen3_vl", "data.num_synthetic=24", "data.holdout_size=4",
         "train.per_device_train_batch_size=4", "train.gradient_accumulation_steps=1"]


def claimed_by_another_config(tmp_path: Path) -> None:
    from vlmrl.pipeline import claim_run_dir, settings_fingerprint

    config = load_config("demo", [*SMALL, f"run.output_dir={tmp_path}", "run.name=r", "train.learning_rate=0.1"])
    claim_run_dir(config, config.run_dir, force=False)
    layout.mark_finished(config.run_dir, settings_fingerprint(config))  # a finished run: only --force replaces it


def reward_config(tmp_path: Path, entry: str) -> str:
    path = tmp_path / "rewards.yaml"
    path.write_text(f"run: {{output_dir: {tmp_path / 'runs'}}}\nrewards:\n  - {entry}\n")
    return str(path)


# Each case: (what it is, the command for a tmp_path, a text the line must hold). Every one exited 1 or said "ok".
CASES: list[tuple[str, Callable[[Path], list[str]], str]] = [
    ("config: unknown field", lambda t: ["config", "show", "demo", *sets("train.no_such_field=1")], "no_such_field"),
    ("config validate: missing reward file",
     lambda t: ["config", "validate", reward_config(t, "{function: 'gone.py:f'}")], "no such file"),
    ("config validate: reward with TRL's arguments missing",
     lambda t: (Path(t / "r.py").write_text("def f(completions):\n    return []\n"),
                ["config", "validate", reward_config(t, "{function: 'r.py:f'}")])[1], "wrong signature"),
    ("data: a file that is not JSON",
     lambda t: (Path(t / "rows.json").write_text("{not json"),
                ["prepare", "demo", *sets(*SMALL, f"data.source={t / 'rows.json'}"), "--run-dir", str(t / "run")])[1],
     "not valid JSON"),
    ("reward: missing file, at `vlmrl run`", lambda t: ["run", reward_config(t, "{function: 'gone.py:f'}")],
     "no such file"),
    ("train: no prepared data", lambda t: ["train", "demo", *sets(*SMALL), "--run-dir", str(t / "run")],
     "no training set"),
    ("eval: no prepared data", lambda t: ["eval", "demo", *sets(*SMALL), "--run-dir", str(t / "run")],
     "no held-out set"),
    ("compare: no records", lambda t: (Path(t / "run").mkdir(), ["compare", str(t / "run")])[1], "run"),
    ("export: nothing trained", lambda t: ["export", "demo", *sets(*SMALL, f"run.output_dir={t}")], "adapter"),
    ("report: no such run folder", lambda t: ["report", str(t / "absent")], "no such run directory"),
    ("run: another config's folder", lambda t: (claimed_by_another_config(t), ["run", "demo", *sets(
        *SMALL, f"run.output_dir={t}", "run.name=r")])[1], "different config"),
    ("paths: a run folder vlmrl did not make",
     lambda t: ((t / "mine").mkdir(), (t / "mine" / "notes.txt").write_text("x"),
                ["prepare", "demo", *sets(*SMALL), "--run-dir", str(t / "mine")])[2], "not a vlmrl run folder"),
    ("OS: a name too long", lambda t: ["prepare", "demo", *sets(*SMALL, f"run.output_dir={t / ('n' * 300)}")],
     "File name too long"),
]


@pytest.mark.parametrize(("what", "command", "says"), CASES, ids=[case[0] for case in CASES])
def test_every_user_error_exits_2_in_one_line(tmp_path, monkeypatch, what, command, says):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("vlmrl.models.loading.load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    result = invoke(*command(tmp_path))
    assert result.exit_code == 2, result.output
    one_error_line(result.output)  # a config's problems follow it, one indented line each
    assert says in " ".join(result.output.split()), result.output


@pytest.mark.parametrize("failure", [
    RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"),  # safetensors
    RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"),  # torch.save
    OSError(errno.EROFS, os.strerror(errno.EROFS), "/runs/demo/comparison.json"),
], ids=["safetensors-full", "torch-save-full", "read-only"])
def test_a_full_or_read_only_disk_is_one_line_exit_2_however_a_library_reports_it(tmp_path, monkeypatch, failure):
    """Before: a full disk during export was a 103-line traceback and exit 1."""
    def write(*args, **kwargs):
        raise failure

    monkeypatch.setattr("vlmrl.compare.stage.compare_runs", write)
    (tmp_path / MARKER).touch()  # a run folder
    result = invoke("compare", str(tmp_path))
    assert result.exit_code == 2, result.output
    assert "re-run the same command: it resumes where it stopped" in one_error_line(result.output)


def test_a_bug_exits_1_with_its_traceback(tmp_path, monkeypatch):
    def bug(*args, **kwargs):
        return 1 / 0

    monkeypatch.setattr("vlmrl.compare.stage.compare_runs", bug)
    (tmp_path / MARKER).touch()  # a run folder
    result = invoke("compare", str(tmp_path))
    assert result.exit_code == 1 and isinstance(result.exception, ZeroDivisionError)


def test_ctrl_c_exits_130_in_one_line(tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("vlmrl.compare.stage.compare_runs", interrupted)
    (tmp_path / MARKER).touch()  # a run folder
    result = invoke("compare", str(tmp_path))
    assert result.exit_code == 130 and "re-run the same command" in one_error_line(result.output)


def test_the_libraries_real_write_failures_are_recognised():
    """safetensors and torch.save, writing past a size limit (RLIMIT_FSIZE: EFBIG, which goes the same way
    through both as the ENOSPC of a full disk), in a child process."""
    script = (
        "import os, resource, signal, sys, tempfile, torch\n"
        "from safetensors.torch import save_file\n"
        "from vlmrl.cli.errors import disk_failure\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        "folder, tensors = tempfile.mkdtemp(), {'w': torch.zeros(100_000)}\n"
        "for write in (lambda: save_file(tensors, folder + '/a.safetensors'), lambda: torch.save(tensors, folder + '/a.pt')):\n"
        "    try:\n"
        "        write()\n"
        "    except Exception as exc:\n"
        "        print(disk_failure(exc) is not None)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.stdout.split() == ["True", "True"], done.stdout + done.stderr


REWARD = '''
import os, time


def patient(completions, trainer_state=None, **kwargs):
    if os.environ.get("VLMRL_TEST_BLOCK") and trainer_state is not None and trainer_state.global_step >= 1:
        time.sleep(30)  # a reward stuck on a lock or a socket, from the second step on
    return [float(len(c[0]["content"]) % 3) for c in completions]
'''


@pytest.mark.slow  # ~5 s: three runs
def test_a_reward_timeout_and_a_full_disk_mid_training_are_one_line_exit_2_and_the_run_resumes(tmp_path, monkeypatch):
    """Before: the reward stalled the run forever; the checkpoint writer's full disk was a traceback."""
    import torch

    (tmp_path / "r.py").write_text(REWARD)
    config_file = tmp_path / "c.yaml"
    config_file.write_text(
        f"run: {{name: run, output_dir: {tmp_path}}}\nmodel: {{name: 'tiny:qwen3_vl'}}\n"
        "data: {num_synthetic: 24, holdout_size: 4}\n"
        "train: {max_completion_length: 8, max_steps: 2, per_device_train_batch_size: 4, save_steps: 1}\n"
        "rewards:\n  - {function: 'r.py:patient', timeout_s: 1}\n")
    config = load_config(str(config_file))
    prepare_data(config, config.run_dir)
    train = ["train", str(config_file)]

    monkeypatch.setenv("VLMRL_TEST_BLOCK", "1")
    result = invoke(*train)
    assert result.exit_code == 2, result.output
    assert "rewards[0] (function: r.py:patient): patient did not return within 1 s" in one_error_line(result.output)
    monkeypatch.delenv("VLMRL_TEST_BLOCK")

    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):  # what torch.save raises on a full disk (measured on a full tmpfs)
        if "checkpoint-2" in str(f):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    result = invoke(*train)
    assert result.exit_code == 2, result.output
    assert "writing failed: [enforce fail at inline_container.cc:672]" in one_error_line(result.output)
    monkeypatch.setattr(torch, "save", real_save)

    result = invoke(*train)  # the same command, once the disk has room: it resumes
    assert result.exit_code == 0, result.output
    summary = read_json(config.run_dir / layout.TRAIN_SUMMARY)
    assert (summary["resumed_from_step"], summary["steps"]) == (1, 2)
    assert [r["step"] for r in read_jsonl(config.run_dir / layout.METRICS) if "train_runtime" not in r] == [1, 2]
