"""The run folder (issue 18): one command at a time, only folders vlmrl made, `--force` deletes only vlmrl's files,
a moved or copied run resumes, and two concurrent `vlmrl run` leave exactly one run's records.

Fast tests use `vlmrl.run.claim` and `claim_run_dir` directly; the end-to-end ones run the CLI on a tiny
random-weight model with two training steps (`quick`), the same settings for every run so runs can resume.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.helpers import quick_args, quick_config
from vlmrl.cli.app import app
from vlmrl.common.io import read_json, read_jsonl
from vlmrl.config.schema import ConfigError, load_config
from vlmrl.pipeline import claim_run_dir
from vlmrl.run.claim import LOCK, MARKER, RunDirError, claimed, ensure_marked, remove_vlmrl_outputs

HOLDOUT, STEPS = 4, 2
QUICK = [
    "model.name=tiny:qwen3_vl", "data.num_synthetic=24", f"data.holdout_size={HOLDOUT}", "eval.batch_size=4",
    "eval.max_new_tokens=8", "train.max_completion_length=8", f"train.max_steps={STEPS}", "train.save_steps=1",
    "train.per_device_train_batch_size=4", "train.gradient_accumulation_steps=1",
]


# --- the claim ----------------------------------------------------------------------------------------------


def test_a_claimed_folder_refuses_a_second_claim_naming_the_holder(tmp_path):
    run = tmp_path / "run"
    with claimed(run):
        assert (run / MARKER).is_file()
        assert (run / LOCK).read_text().strip() == str(os.getpid())
        # the same process again stands for another command: refused, because flock is per open file
        os.environ.pop("VLMRL_RUN_CLAIM")
        with pytest.raises(RunDirError, match=rf"in use by another vlmrl command \(pid {os.getpid()}\)"), claimed(run):
            pass
    with claimed(run):  # released when the holder's block ends
        pass


def test_a_second_process_is_refused_at_once_while_the_first_holds_the_folder(tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", ("import sys, time; from pathlib import Path; from vlmrl.run.claim import claimed\n"
                                f"with claimed(Path({str(run)!r})):\n    print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.perf_counter()
        result = CliRunner().invoke(app, ["prepare", "demo", "--run-dir", str(run)], terminal_width=300)
        assert time.perf_counter() - started < 20
        assert result.exit_code == 2, result.output
        assert f"in use by another vlmrl command (pid {holder.pid})" in " ".join(result.output.split())
        assert "Traceback" not in result.output and not (run / "data").exists()
    finally:
        holder.kill()
        holder.wait()
    with claimed(run):  # a killed holder leaves no stale claim
        pass


def test_ranks_launched_by_a_claiming_process_share_its_claim(tmp_path, monkeypatch):
    run = tmp_path / "run"
    with claimed(run):
        env = dict(os.environ)  # what `--gpus N` hands to the ranks it launches
    monkeypatch.setenv("VLMRL_RUN_CLAIM", env["VLMRL_RUN_CLAIM"])
    with claimed(run), claimed(run):  # no lock taken: the launcher holds it
        pass
    monkeypatch.delenv("VLMRL_RUN_CLAIM")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with claimed(tmp_path / "rank1-never-creates"):  # rank 0 claims for a bare `accelerate launch`
        pass
    assert not (tmp_path / "rank1-never-creates").exists()


# --- the mark and --force -----------------------------------------------------------------------------------


def test_a_folder_vlmrl_did_not_make_is_neither_written_nor_deleted(tmp_path):
    config = quick_config(tmp_path, base=QUICK)
    config.run_dir.mkdir(parents=True)
    (config.run_dir / "thesis.tex").write_text("years of work")
    (config.run_dir / "data").mkdir()
    (config.run_dir / "data" / "mine.csv").write_text("1,2")
    before = sorted(p.relative_to(config.run_dir) for p in config.run_dir.rglob("*"))
    for force in (False, True):
        with pytest.raises(ConfigError, match="not a vlmrl run folder.*thesis.tex"):
            claim_run_dir(config, config.run_dir, force=force)
        result = CliRunner().invoke(app, [*quick_args(tmp_path, base=QUICK), *(["--force"] if force else [])], terminal_width=300)
        assert result.exit_code == 2 and "not a vlmrl run folder" in result.output, result.output
    with pytest.raises(RunDirError):
        remove_vlmrl_outputs(config.run_dir)
    doctor = CliRunner().invoke(app, ["doctor", str(config.run_dir)], terminal_width=300)
    assert doctor.exit_code != 0 and "not a vlmrl run folder" in doctor.output, doctor.output
    assert sorted(p.relative_to(config.run_dir) for p in config.run_dir.rglob("*")) == before


def test_force_removes_only_what_vlmrl_wrote(tmp_path):
    config = quick_config(tmp_path, base=QUICK)
    claim_run_dir(config, config.run_dir, force=False)
    run = config.run_dir
    for name in ("baseline_records.jsonl", "baseline_records.rank1.jsonl", "comparison.json", ".env.json.ab12.tmp"):
        (run / name).write_text("{}\n")
    (run / "gguf").mkdir()  # export.gguf's folder
    (run / "gguf" / "model-f16.gguf").write_bytes(b"GGUF")
    (run / "train" / "checkpoints").mkdir(parents=True)
    (run / "notes.txt").write_text("mine")
    (run / "plots").mkdir()
    other = quick_config(tmp_path, "train.learning_rate=0.01", base=QUICK)
    claim_run_dir(other, run, force=True)
    assert sorted(p.name for p in run.iterdir()) == sorted([MARKER, "config.yaml", "notes.txt", "plots"])
    assert load_config(str(run / "config.yaml")).train.learning_rate == 0.01


def test_only_empty_folders_are_adopted(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert ensure_marked(empty) and (empty / MARKER).is_file()
    legacy = tmp_path / "legacy"  # looks like a run written before the mark existed: not adopted, the fix named
    (legacy / "data").mkdir(parents=True)
    (legacy / "data" / "summary.json").write_text("{}")
    (legacy / "config.yaml").write_text("run: {}\n")
    with pytest.raises(RunDirError, match=f"touch {legacy / MARKER}"):
        ensure_marked(legacy)
    assert not (legacy / MARKER).exists()
    only_data = tmp_path / "only-data"  # a folder named like ours holds someone's data: not adopted
    (only_data / "data").mkdir(parents=True)
    with pytest.raises(RunDirError):
        ensure_marked(only_data)
    assert not ensure_marked(tmp_path / "missing", create=False) and not (tmp_path / "missing").exists()


# --- end to end ---------------------------------------------------------------------------------------------


def _vlmrl(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "vlmrl.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "300"}, **kw)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_concurrent_runs_leave_exactly_one_runs_records(tmp_path):
    first, second = _vlmrl(*quick_args(tmp_path, base=QUICK)), _vlmrl(*quick_args(tmp_path, base=QUICK))
    outputs = [p.communicate(timeout=550)[0] for p in (first, second)]
    codes = [p.returncode for p in (first, second)]
    refused = [i for i, out in enumerate(outputs) if "in use by another vlmrl command" in out]
    assert len(refused) == 1, outputs
    assert codes[refused[0]] == 2 and "Traceback" not in outputs[refused[0]]
    # the tiny random model earns no reward, so export (rightly) fails: the run gets that far, no further
    winner = outputs[1 - refused[0]]
    assert codes[1 - refused[0]] in (0, 2) and "[run]  compare" in winner, winner
    run = tmp_path / "demo"
    for stage in ("baseline", "after"):
        ids = [r["id"] for r in read_jsonl(run / f"{stage}_records.jsonl")]
        assert len(ids) == HOLDOUT == len(set(ids))
    steps = [r["step"] for r in read_jsonl(run / "train" / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, STEPS + 1))
    assert set(Counter(r["step"] for r in read_jsonl(run / "train" / "rollouts.jsonl"))) == set(steps)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("moved")
    result = CliRunner().invoke(app, quick_args(out, base=QUICK), terminal_width=300)
    assert "[run]  compare" in result.output, result.output
    return out / "demo"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_copied_run_folder_resumes_as_the_same_run(finished_run, tmp_path):
    copy = tmp_path / "elsewhere" / "renamed"
    shutil.copytree(finished_run, copy)
    (copy / "after_summary.json").unlink()  # something left to do after the move
    before = read_jsonl(copy / "after_records.jsonl")
    result = CliRunner().invoke(app, quick_args(copy.parent, f"run.name={copy.name}", base=QUICK), terminal_width=300)
    out = result.output
    assert "different config" not in out, out
    for stage in ("prepare", "eval baseline", "train"):
        assert f"[skip] {stage}" in out, out
    assert read_jsonl(copy / "after_records.jsonl") == before  # kept: the adapter path inside is relative
    assert before[0]["generation"]["adapter"] == "train/final"
    assert load_config(str(copy / "config.yaml")).run.name == "renamed"
    assert str(finished_run) not in (copy / "after_summary.json").read_text()
    if (copy / "export.json").exists():
        assert not Path(read_json(copy / "export.json")["adapter_dir"]).is_absolute()
