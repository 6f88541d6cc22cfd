"""Only vlmrl's folders are written, and nothing made from old inputs is kept.

- A user's folder is never adopted, written or cleaned (`--force` included), whatever names it holds; an empty
  one is. A data source inside the run folder is refused.
- `vlmrl report` and `vlmrl compare` check the mark and refuse links out of the folder, as the stage commands do.
- Every done-check names its inputs: a new adapter (a `--no-resume` training run by its own command) makes the
  evaluation after training and the export stale, however the config fingerprints agree.
- After an error and a config fix, `vlmrl run` redoes what the change affects, without `--force`; a finished
  run of another config still needs it.

No model is loaded: the run folders here hold hand-written stand-ins for each stage's outputs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.helpers import flat, invoke, sets
from vlmrl.common.io import read_jsonl, write_json_atomic, write_jsonl_atomic
from vlmrl.config.schema import ConfigError, dump_config, load_config
from vlmrl.pipeline import _drop_stale_records, _settings, claim_run_dir, retrain, settings_fingerprint
from vlmrl.run import layout
from vlmrl.run.claim import MARKER, RunDirError, claimed, ensure_marked

SMALL = ["model.name=tiny:qwen3_vl", "data.num_synthetic=24", "data.holdout_size=2", "eval.batch_size=2",
         "train.per_device_train_batch_size=4", "train.gradient_accumulation_steps=1"]


def config_at(output_dir: Path, *extra: str, name: str = "run"):
    return load_config("demo", [*SMALL, f"run.output_dir={output_dir}", f"run.name={name}", *extra])


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --- a user's folder --------------------------------------------------------------------------------------------


def users_project(parent: Path) -> Path:
    """`proj/` as a user writes it: their own config.yaml and data/ (every name one vlmrl also writes)."""
    proj = parent / "proj"
    (proj / "data").mkdir(parents=True)
    (proj / "config.yaml").write_text("# my notes on the experiment\nmodel: {name: tiny:qwen3_vl}\n")
    (proj / "data" / "quiz.jsonl").write_text('{"question": "mine"}\n')
    (proj / "data" / "train.jsonl").write_text('{"question": "also mine"}\n')
    return proj


def test_a_users_folder_with_vlmrl_names_is_never_adopted_nor_cleaned_by_force(tmp_path):
    proj = users_project(tmp_path)
    before = tree(proj)
    result = invoke("run", "demo", *sets(*SMALL, f"run.output_dir={tmp_path}", "run.name=proj"), "--force")
    assert result.exit_code == 2, result.output
    assert "not a vlmrl run folder" in flat(result.output) and "Traceback" not in result.output
    source = proj / "data" / "train.jsonl"  # as the data source, without --force: still not written
    result = invoke("run", "demo", *sets(*SMALL, f"run.output_dir={tmp_path}", "run.name=proj", f"data.source={source}"))
    assert result.exit_code == 2 and "not a vlmrl run folder" in flat(result.output), result.output
    assert tree(proj) == before and not (proj / MARKER).exists()
    with pytest.raises(RunDirError, match="not a vlmrl run folder"):
        ensure_marked(proj)


def test_an_empty_folder_is_adopted(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert ensure_marked(empty) and (empty / MARKER).is_file()


def test_a_data_source_inside_the_run_folder_is_refused_in_one_line(tmp_path):
    config = config_at(tmp_path)
    with claimed(config.run_dir):
        pass  # a marked run folder
    (config.run_dir / "mine.jsonl").write_text('{"question": "q"}\n')
    inside = config_at(tmp_path, f"data.source={config.run_dir / 'mine.jsonl'}")
    with pytest.raises(ConfigError, match="lies inside the run folder"):
        claim_run_dir(inside, inside.run_dir, force=True)
    result = invoke("prepare", "demo", *sets(*SMALL, f"data.source={config.run_dir / 'mine.jsonl'}"),
                    "--run-dir", str(config.run_dir))
    assert result.exit_code == 2, result.output
    assert [line for line in result.output.splitlines() if line.startswith("error:")] and "lies inside" in flat(
        result.output) and "Traceback" not in result.output
    assert not (config.run_dir / "config.yaml").exists()


# --- report and compare -----------------------------------------------------------------------------------------


def test_report_and_compare_refuse_a_folder_vlmrl_did_not_make(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "report.html").write_text("<h1>mine</h1>")
    (site / "comparison.json").write_text('{"mine": true}')
    (site / "baseline_records.jsonl").write_text('{"id": "a"}\n')
    (site / "after_records.jsonl").write_text('{"id": "a"}\n')
    before = tree(site)
    for command in ("report", "compare"):
        result = invoke(command, str(site))
        assert result.exit_code == 2 and "not a vlmrl run folder" in flat(result.output), result.output
    outside = tmp_path / "etc"  # a folder elsewhere, reached through a link
    outside.mkdir()
    (tmp_path / "link").symlink_to(outside)
    result = invoke("report", str(tmp_path / "link"))
    assert result.exit_code == 2 and "not a vlmrl run folder" in flat(result.output), result.output
    assert tree(site) == before and list(outside.iterdir()) == []


def test_report_refuses_a_link_out_of_a_marked_run_and_writes_a_marked_one(tmp_path):
    run = tmp_path / "run"
    ensure_marked(run)
    target = tmp_path / "passwd"
    target.write_text("root:x:0:0\n")
    (run / "report.html").symlink_to(target)
    result = invoke("report", str(run))
    assert result.exit_code == 2 and "outside the run folder" in flat(result.output), result.output
    assert target.read_text() == "root:x:0:0\n"
    with pytest.raises(RunDirError, match="outside the run folder"):  # the stage commands' claim too
        ensure_marked(run)
    (run / "report.html").unlink()
    result = invoke("report", str(run))
    assert result.exit_code == 0 and (run / "report.html").stat().st_size > 1000, result.output


# --- done-checks name their inputs ------------------------------------------------------------------------------


def fake_run(tmp_path: Path, *extra: str):
    """A run folder as `vlmrl run` leaves it, with stand-ins for every stage's outputs, stages.json included."""
    config = config_at(tmp_path, *extra)
    run = config.run_dir
    ensure_marked(run)
    (run / "config.yaml").write_text(dump_config(config))
    items = [{"id": "a", "prompt": "p"}, {"id": "b", "prompt": "q"}]
    write_jsonl_atomic(run / layout.HOLDOUT, items)
    write_jsonl_atomic(run / layout.TRAIN_ITEMS, items)
    write_json_atomic(run / layout.DATA_SUMMARY, {"fingerprint": config.data_fingerprint()})
    new_adapter(run, b"weights of the first training")
    write_json_atomic(run / layout.TRAIN_SUMMARY, {"fingerprint": layout.train_fingerprint(config), "steps": 2})
    layout.record_stage(config, run, "train", done=True)
    for stage in layout.STAGES:
        evaluated(config, stage)
    (run / layout.ADAPTER).mkdir()
    (run / layout.ADAPTER / layout.ADAPTER_CONFIG).write_text("{}")
    write_json_atomic(run / layout.EXPORT, {"fingerprint": layout.export_fingerprint(config), "all_passed": True})
    layout.record_stage(config, run, "export", done=True)
    return config, run


def new_adapter(run: Path, weights: bytes) -> None:
    final = run / layout.FINAL
    final.mkdir(parents=True, exist_ok=True)
    (final / layout.ADAPTER_CONFIG).write_text('{"r": 8}')
    (final / "adapter_model.safetensors").write_bytes(weights)


def evaluated(config, stage: str, *, record: bool = True) -> None:
    run = config.run_dir
    write_jsonl_atomic(run / layout.records_file(stage), [{"id": i, "generation": _settings(config, run, stage)}
                                                          for i in ("a", "b")])
    write_json_atomic(run / layout.summary_file(stage), {"n": 2, "rewards_fingerprint": layout.rewards_fingerprint(config),
                                                         "provenance": {"finished_at": time.time_ns()}})
    if record:
        layout.record_stage(config, run, stage, done=True)


def done(config) -> dict[str, bool]:
    run = config.run_dir
    return {"baseline": layout.eval_done(config, run, "baseline"), "train": layout.is_trained(config, run),
            "after": layout.eval_done(config, run, "after"), "export": layout.is_exported(config, run)}


def test_a_new_adapter_makes_the_evaluation_after_training_and_the_export_stale(tmp_path):
    """`vlmrl run`, `vlmrl train --no-resume`, `vlmrl run`: before, the last run skipped eval after and export."""
    config, run = fake_run(tmp_path)
    assert done(config) == {"baseline": True, "train": True, "after": True, "export": True}
    new_adapter(run, b"weights of a training run again from step 0")  # same config, so the same fingerprints
    write_json_atomic(run / layout.TRAIN_SUMMARY, {"fingerprint": layout.train_fingerprint(config), "steps": 2})
    assert done(config) == {"baseline": True, "train": True, "after": False, "export": False}
    assert layout.stage_changes(config, run, "after") == ["the adapter"]
    said: list[str] = []
    _drop_stale_records(config, run, "after", _settings(config, run, "after"), said.append)  # before it runs again
    assert said == ["[note] after: the adapter changed since its records were made; evaluating again"]
    assert not (run / "after_records.jsonl").exists() and not (run / "after_summary.json").exists()
    evaluated(config, "after", record=False)  # evaluated again by `vlmrl eval --stage after`: stages.json not told
    assert layout.eval_done(config, run, "after")


def test_eval_after_on_its_own_does_not_resume_the_records_of_an_earlier_adapter(tmp_path, monkeypatch):
    """`vlmrl run`, `vlmrl train --no-resume`, `vlmrl eval --stage after`: before, the old adapter's records were
    taken as done (their settings held the adapter's path only) and the summary was rebuilt from them."""
    from vlmrl.evaluate.stage import EvalError, evaluate

    config, run = fake_run(tmp_path)
    monkeypatch.setattr("vlmrl.evaluate.stage.reward_check", lambda config, run_dir: ([], {}))
    monkeypatch.setattr("vlmrl.evaluate.stage.adapter_base_problem", lambda *args: None)
    monkeypatch.setattr("vlmrl.evaluate.stage.load_with_adapter", lambda *a: pytest.fail("a model was loaded"))
    new_adapter(run, b"weights of a training run again from step 0")  # same path, same config
    with pytest.raises(EvalError, match="holds records of another adapter: the files of train/final changed"):
        evaluate(config, run, "after")
    assert [r["id"] for r in read_jsonl(run / "after_records.jsonl")] == ["a", "b"]  # refused, not rebuilt
    said: list[str] = []  # `vlmrl run` deletes them, naming the adapter once
    _drop_stale_records(config, run, "after", _settings(config, run, "after"), said.append)
    assert said == ["[note] after: the adapter changed since its records were made; evaluating again"]


def test_without_stages_json_outputs_older_than_their_inputs_are_stale(tmp_path):
    """A run folder from before stages.json, or a stage run by its own command: file times decide."""
    config, run = fake_run(tmp_path)
    (run / layout.STAGES_FILE).unlink()
    assert done(config) == {"baseline": True, "train": True, "after": True, "export": True}
    new_adapter(run, b"newer weights")
    later = (run / layout.EXPORT).stat().st_mtime_ns + 10**9
    os.utime(run / layout.FINAL / "adapter_model.safetensors", ns=(later, later))
    assert done(config) == {"baseline": True, "train": True, "after": False, "export": False}
    write_jsonl_atomic(run / layout.HOLDOUT, [{"id": "a", "prompt": "p"}, {"id": "c", "prompt": "r"}])
    assert not layout.eval_done(config, run, "baseline")


def test_new_data_makes_the_baseline_and_the_training_stale(tmp_path):
    config, run = fake_run(tmp_path)
    write_jsonl_atomic(run / layout.TRAIN_ITEMS, [{"id": "c", "prompt": "r"}])
    write_jsonl_atomic(run / layout.HOLDOUT, [{"id": "a", "prompt": "p"}, {"id": "d", "prompt": "s"}])
    assert done(config) == {"baseline": False, "train": False, "after": False, "export": True}
    assert layout.stage_changes(config, run, "train") == ["the training set (data/train.jsonl)",
                                                          "the held-out set (data/holdout.jsonl)"]


def fake_train(calls: list[bool]):
    def train(config, run_dir, *, resume=True, console_callback=None, progress=None):
        calls.append(resume)
    return train


def test_a_retrain_names_what_changed(tmp_path, monkeypatch):
    """Before: after a `--no-resume` training at another learning rate, `run` said a reward file changed."""
    config, run = fake_run(tmp_path)
    other = config_at(tmp_path, "train.learning_rate=0.0005")
    write_json_atomic(run / layout.TRAIN_SUMMARY, {"fingerprint": layout.train_fingerprint(other), "steps": 2})
    calls: list[bool] = []
    monkeypatch.setattr("vlmrl.train.stage.train", fake_train(calls))
    said: list[str] = []
    retrain(config, run, said.append)
    assert said == [(f"[note] train: the finished training in {run / layout.TRAIN} is not this config's: its model, "
                     "lora, data or train settings differ from this config's; training again from step 0")]
    assert calls == [False]  # from step 0: the earlier training is moved aside
    (tmp_path / "r.py").write_text("def r(completions, **kw):\n    return [0.0] * len(completions)\n")
    rewarded = config_at(tmp_path, f"rewards=[{{function: '{tmp_path / 'r.py'}:r'}}]")
    write_json_atomic(run / layout.TRAIN_SUMMARY, {"fingerprint": layout.train_fingerprint(config), "steps": 2})
    assert layout.train_change(rewarded, run) == "it used other rewards (a reward entry or the file behind it changed)"
    said.clear()
    retrain(rewarded, run, said.append)  # stages.json knows the last training's inputs: it names the part
    assert said == [("[note] train: the rewards (an entry or the file behind one) changed since the last training; "
                     "training again from step 0")]
    said.clear()
    retrain(config, run, said.append, fresh=True)
    assert said == ["[note] train: --no-resume; training again from step 0"] and calls[-1] is False


# --- a config change after an error -----------------------------------------------------------------------------


def test_an_unfinished_run_takes_a_changed_config_and_a_finished_one_needs_force(tmp_path):
    config = config_at(tmp_path)
    claim_run_dir(config, config.run_dir, force=False)
    (config.run_dir / "baseline_records.jsonl").write_text('{"id": "x"}\n')  # stopped at the baseline
    fixed = config_at(tmp_path, "eval.max_new_tokens=64", "train.learning_rate=0.0005")
    assert claim_run_dir(fixed, fixed.run_dir, force=False) == ["eval.max_new_tokens", "train.learning_rate"]
    assert load_config(str(config.run_dir / "config.yaml")).eval.max_new_tokens == 64
    layout.mark_finished(config.run_dir, settings_fingerprint(fixed))  # `vlmrl run` got to its end
    with pytest.raises(ConfigError, match="holds a finished run made with a different config.*--force"):
        claim_run_dir(config, config.run_dir, force=False)
    assert claim_run_dir(fixed, fixed.run_dir, force=False) == []  # the same config resumes
    claim_run_dir(config, config.run_dir, force=True)
    assert not (config.run_dir / "baseline_records.jsonl").exists()


def test_changed_generation_settings_redo_the_evaluations_records_and_all(tmp_path):
    _, run = fake_run(tmp_path)
    longer = config_at(tmp_path, "eval.max_new_tokens=64")
    assert not any(layout.eval_done(longer, run, s) for s in layout.STAGES)
    said: list[str] = []
    _drop_stale_records(longer, run, "baseline", _settings(longer, run, "baseline"), said.append)
    assert said == [("[note] baseline: its settings, the generation settings changed since its records were made; "
                     "evaluating again")]
    assert not (run / "baseline_records.jsonl").exists()
    # a reward changed and nothing else: the records stay (the evaluation rescores them)
    (tmp_path / "r.py").write_text("def r(completions, **kw):\n    return [0.0] * len(completions)\n")
    rewarded = config_at(tmp_path, f"rewards=[{{function: '{tmp_path / 'r.py'}:r'}}]")
    assert not layout.eval_done(rewarded, run, "after")
    _drop_stale_records(rewarded, run, "after", _settings(rewarded, run, "after"), said.append)
    assert len(read_jsonl(run / "after_records.jsonl")) == 2


def test_run_takes_run_dir_and_no_resume(tmp_path):
    mine = users_project(tmp_path)
    result = invoke("run", "demo", *sets(*SMALL), "--run-dir", str(mine), "--no-resume")
    assert result.exit_code == 2, result.output
    assert f"{mine} exists and is not a vlmrl run folder" in flat(result.output)


def test_the_report_names_its_inputs_and_follows_a_later_export(tmp_path, monkeypatch):
    """Before: `vlmrl export --set export.merged_16bit=true` after a run left report.html showing the old export."""
    from vlmrl.export.stage import ExportError
    from vlmrl.report import is_current, write_report

    _, run = fake_run(tmp_path)
    write_report(run)
    assert is_current(run) and 'name="vlmrl-inputs"' in (run / "report.html").read_text()

    def export_adapter(config, run_dir, source=None):
        write_json_atomic(run_dir / layout.EXPORT, {"fingerprint": "merged", "all_passed": False,
                                                    "checks": [{"name": "merged_16bit_reload", "passed": False}]})
        raise ExportError("export verification failed (merged_16bit_reload)")

    monkeypatch.setattr("vlmrl.export.stage.export_adapter", export_adapter)
    (run / "env.json").write_text("{}")  # a file the page read as absent now exists
    assert not is_current(run)
    result = invoke("export", "demo", *sets(*SMALL, "export.merged_16bit=true"), "--run-dir", str(run))
    assert result.exit_code == 2 and f"refreshed {run / 'report.html'}" in flat(result.output), result.output
    assert is_current(run) and "merged_16bit_reload" in (run / "report.html").read_text()
