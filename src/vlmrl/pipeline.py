"""The stage order, in one place: `vlmrl run` reads top to bottom like the recipe it is.

Stages talk only through files in the run directory. Each stage is skipped when its outputs exist and were
made by this config from the inputs the folder holds now (vlmrl.run.layout's done-checks), so re-running after
a crash resumes where it stopped (evaluation and training also resume *within* the stage), and nothing
downstream of a new training or new data is ever kept. After a config change, the same command redoes exactly
the stages whose settings or inputs changed: an evaluation's stale records are deleted, an earlier training is
moved aside (`train.replaced-*`). Only a *finished* run (every stage done) of another config is refused unless
`force`; one moved or copied elsewhere (another run.name or output_dir, same settings) is the same run and
resumes. The folder is claimed for the whole command (vlmrl.run.claim: the lock, the mark, what `--force` removes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from vlmrl.common.io import write_text_atomic
from vlmrl.config.load import SchemaVersionError
from vlmrl.config.schema import Config, ConfigError, dump_config, load_config
from vlmrl.run import layout

Say = Callable[[str], None]


@dataclass
class RunOutcome:
    run_dir: Path
    done: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def run_all(config: Config, *, force: bool = False, resume: bool = True, say: Say = print, progress_factory=None,
            train_progress=None) -> RunOutcome:
    """Run stages 1-8 and the report into `config.run_dir`, holding the folder's claim throughout. `resume`
    False: train again from step 0 (the earlier training is moved aside), and so everything after it."""
    from vlmrl.grading.user_rewards import load_rewards
    from vlmrl.run.claim import claimed

    load_rewards(config)  # a reward that cannot be imported fails before anything runs (the call check: in eval)
    run_dir = config.run_dir
    with claimed(run_dir):
        if changed := claim_run_dir(config, run_dir, force=force):
            say(f"[note] the config changed since this folder's last run ({_listed(changed)}); the stages it "
                "affects run again")
        outcome = _run_stages(config, run_dir, say, progress_factory, train_progress, resume)
        layout.mark_finished(run_dir, settings_fingerprint(config))
        return outcome


def _run_stages(config: Config, run_dir: Path, say: Say, progress_factory, train_progress,
                resume: bool = True) -> RunOutcome:
    from vlmrl import report
    from vlmrl.common.io import write_json_atomic
    from vlmrl.compare.stage import compare_runs
    from vlmrl.evaluate.stage import evaluate
    from vlmrl.evaluate.visual_control import evaluate_swapped
    from vlmrl.export.stage import export_adapter
    from vlmrl.models.loading import adapter_files_problem
    from vlmrl.preflight.doctor import collect_environment

    outcome = RunOutcome(run_dir)

    def stage(name: str, done: bool, action: Callable[[], object], recorded: tuple[str, ...] = ()) -> None:
        if done:
            outcome.skipped.append(name)
            say(f"[skip] {name}: outputs already match this config and its inputs")
            return
        say(f"[run]  {name}")
        action()  # which records stages.json's entries as started, once it has judged what the old ones say
        for key in recorded:
            layout.record_stage(config, run_dir, key, done=True)
        outcome.done.append(name)

    def started(*keys: str) -> None:  # partial outputs from here on belong to these inputs
        for key in keys:
            layout.record_stage(config, run_dir, key, done=False)

    def evaluation(key: str) -> tuple[bool, Callable[[], object]]:
        settings = _settings(config, run_dir, key)

        def run() -> None:
            _drop_stale_records(config, run_dir, key, settings, say)
            started(key)
            evaluate(config, run_dir, key, progress=_progress(progress_factory, key))
        return layout.eval_done(config, run_dir, key, settings), run

    # 1 environment
    stage("doctor", False, lambda: write_json_atomic(run_dir / layout.ENV, collect_environment(run_dir)))
    # 4 data (2 and 3, model load and LoRA, happen inside the stages that need them)
    stage("prepare", layout.is_prepared(config, run_dir), lambda: _prepare_and_show_drops(config, run_dir, say))
    # 5 baseline evaluation
    stage("eval baseline", *evaluation("baseline"), ("baseline",))
    # 6 training
    # a damaged train/final (a kill or a full disk mid-save) is not done: training rebuilds it
    trained = layout.is_trained(config, run_dir) and adapter_files_problem(run_dir / layout.FINAL) is None
    stage("train", resume and trained,
          lambda: retrain(config, run_dir, say, train_progress, fresh=not resume, started=started), ("train",))
    # 7 evaluation after training, and the paired comparison
    stage("eval after", *evaluation("after"), ("after",))
    if config.eval.visual_control:  # the same held-out set with images swapped between items, before and after
        swapped = tuple(s + layout.SWAPPED for s in layout.STAGES)

        def swap() -> None:
            for key in swapped:
                _drop_stale_records(config, run_dir, key, _settings(config, run_dir, key), say)
            started(*swapped)
            evaluate_swapped(config, run_dir, progress_factory)
        stage("eval swapped images",
              all(layout.eval_done(config, run_dir, key, _settings(config, run_dir, key)) for key in swapped),
              swap, swapped)
    stage("compare", False, lambda: compare_runs(run_dir, seed=config.run.seed))
    # 8 export, then the report
    stage("export", layout.is_exported(config, run_dir),
          lambda: (started("export"), export_adapter(config, run_dir)), ("export",))
    stage("report", False, lambda: report.write_report(run_dir))
    return outcome


def _settings(config: Config, run_dir: Path, key: str) -> dict:
    """The generation settings an evaluation's records must carry (`evaluate`'s own, swap seed included)."""
    from vlmrl.evaluate.stage import generation_settings

    settings = generation_settings(config, run_dir / layout.FINAL if key.startswith("after") else None, run_dir)
    if key.endswith(layout.SWAPPED):
        settings["image_swap_seed"] = config.run.seed
    return settings


def _drop_stale_records(config: Config, run_dir: Path, key: str, settings: dict, say: Say) -> None:
    """Before an evaluation runs: delete its records and summary when they were made from other inputs or
    settings (an earlier adapter, another held-out set, other generation settings), so the evaluation makes
    them again instead of resuming them. Records of the same inputs are kept (resumed, or rescored when only
    a reward changed)."""
    records, summary = run_dir / layout.records_file(key), run_dir / layout.summary_file(key)
    shards = sorted(run_dir.glob(f"{key}_records.rank*.jsonl"))
    if not (records.exists() or shards or summary.exists()):
        return
    from vlmrl.evaluate.stage import only_the_adapter_differs

    why = layout.stage_changes(config, run_dir, key)
    if (made := layout.records_settings(run_dir, key)) not in (None, settings):
        why.append("the adapter" if only_the_adapter_differs(made, settings) else "the generation settings")
    if not why and not layout.made_from_current_inputs(config, run_dir, key, partial=True):
        why.append("an input newer than its records")
    if why:
        say(f"[note] {key}: {_listed(why)} changed since its records were made; evaluating again")
        for path in [records, summary, *shards]:
            path.unlink(missing_ok=True)


def _listed(parts: list[str]) -> str:
    return ", ".join(dict.fromkeys(parts))


def prepare_with_budget(config: Config, run_dir: Path):
    """Prepare data, counting each prompt's tokens with the model's own processor."""
    from vlmrl.data.prepare import prepare_data
    from vlmrl.run.claim import mark_if_new

    check_source_outside(config, run_dir)
    mark_if_new(run_dir)  # before the token counter, which may build a tiny base model inside it
    return prepare_data(config, run_dir, token_counter=prompt_token_counter(config, run_dir))


def check_source_outside(config: Config, run_dir: Path) -> None:
    """Refuse a data source inside the run folder the run writes (preparing rewrites `data/` there)."""
    source = Path(config.data.source)
    if config.data.source == "synthetic" or not source.exists():  # a hub id, not a path
        return
    inside = Path(run_dir).resolve()
    where = source.resolve()
    if where == inside or inside in where.parents:
        raise ConfigError(f"data.source={config.data.source} lies inside the run folder {run_dir}, which this run "
                          "writes (data/ is rewritten there); move the data out, or choose another run.name.")


def _prepare_and_show_drops(config: Config, run_dir: Path, say: Say) -> None:
    """Prepare, then say the drop table (each reason, its count, an example, the fix): drops are never silent."""
    from vlmrl.data.drops import drop_lines

    result = prepare_with_budget(config, run_dir)
    for line in drop_lines(result.summary.get("drops") or [], result.input_rows):
        say(line)


def prompt_token_counter(config: Config, run_dir: Path):
    from transformers import AutoProcessor

    from vlmrl.engine.rollout.generation import count_prompt_tokens
    from vlmrl.models.loading import resolve_model_source

    processor = AutoProcessor.from_pretrained(resolve_model_source(config.model.name, run_dir, config.run.seed))
    return lambda prompt, images: count_prompt_tokens(processor, prompt, images)


def retrain(config: Config, run_dir: Path, say: Say, progress=None, *, fresh: bool = False,
            started: Callable[[str], None] | None = None) -> None:
    """Train. It starts again from step 0 (the earlier training moved aside) when `fresh`, when its settings or
    data changed since the last training (stages.json), or when what train/ holds is another training's (a
    finished one, or checkpoints); the console says which. Else it resumes. The old adapter's after-training
    records go."""
    from vlmrl.train.resume import checkpoints_of, holds_own_checkpoint
    from vlmrl.train.stage import train

    why = layout.stage_changes(config, run_dir, "train")
    if why:
        why = [f"{_listed(why)} changed since the last training"]
    elif not holds_own_checkpoint(run_dir / layout.CHECKPOINTS, layout.checkpoint_fingerprint(config)):
        if change := layout.train_change(config, run_dir):
            why = [f"the finished training in {run_dir / layout.TRAIN} is not this config's: {change}"]
        elif checkpoints_of(run_dir / layout.CHECKPOINTS):
            why = [f"{run_dir / layout.CHECKPOINTS} holds another training's checkpoints"]
    if fresh:
        why = why or ["--no-resume"]
    if why:
        say(f"[note] train: {why[0]}; training again from step 0")
    if started:
        started("train")
    for path in [run_dir / "after_summary.json", run_dir / "after_swapped_summary.json",
                 *run_dir.glob("after_records*.jsonl"), *run_dir.glob("after_swapped_records*.jsonl")]:
        path.unlink(missing_ok=True)  # made with an adapter that is about to be replaced
    train(config, run_dir, resume=not why, console_callback=say, progress=progress)


def claim_run_dir(config: Config, run_dir: Path, *, force: bool) -> list[str]:
    """Write config.yaml, refusing a folder vlmrl did not make (`force` or not), a data source inside the
    folder, and a folder holding a *finished* run of another config unless `force` (which removes only what
    vlmrl wrote there). An unfinished run of another config (stopped by an error the new config fixes) is
    taken over: the done-checks redo what the change affects. Returns the config fields that changed."""
    from vlmrl.run.claim import RunDirError, ensure_marked, remove_vlmrl_outputs

    try:
        ensure_marked(run_dir)
    except RunDirError as exc:
        raise ConfigError(str(exc)) from None
    check_source_outside(config, run_dir)
    path = run_dir / layout.CONFIG
    changed: list[str] = []
    if path.exists() and not force:
        try:
            previous = load_config(str(path), run_folder=True)
        except SchemaVersionError:  # another version's run folder: its line says what to do
            raise
        except ConfigError:
            raise ConfigError(f"{run_dir} holds a config.yaml vlmrl cannot read ({path}); choose another "
                              "run.name, or pass --force to replace what vlmrl wrote there.") from None
        if settings_fingerprint(previous) != settings_fingerprint(config):
            if layout.run_finished(run_dir, settings_fingerprint(previous)):
                raise ConfigError(
                    f"{run_dir} holds a finished run made with a different config ({path}); "
                    "choose another run.name, or pass --force to replace what vlmrl wrote there."
                )
            changed = changed_fields(previous, config)
    if force:
        remove_vlmrl_outputs(run_dir)
    write_text_atomic(path, dump_config(config))
    return changed


def changed_fields(before: Config, after: Config) -> list[str]:
    """The dotted names of the fields that differ (where the run lives left out).

    >>> from vlmrl.config.schema import load_config
    >>> changed_fields(load_config("demo"), load_config("demo", ["train.learning_rate=0.5", "run.name=x"]))
    ['train.learning_rate']
    """
    old, new = _flat(before.model_dump(mode="json")), _flat(after.model_dump(mode="json"))
    return [k for k in dict.fromkeys([*old, *new])
            if old.get(k) != new.get(k) and k not in ("run.name", "run.output_dir")]


def _flat(data: dict, prefix: str = "") -> dict:
    flat: dict = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def settings_fingerprint(config: Config) -> str:
    """The fingerprint of every field that decides a stage's output (vlmrl.config.fingerprints): where the run
    lives (run.name, run.output_dir) is not one, so a run folder moved or copied elsewhere is the same run."""
    return config.fingerprint()


def _progress(factory, label: str):
    return factory(label) if factory else None
