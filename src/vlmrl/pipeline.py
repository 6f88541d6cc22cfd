"""The stage order, in one place: `vlmrl run` reads top to bottom like the recipe it is.

Stages talk only through files in the run directory. Each stage is skipped when its outputs exist and were
made by this config, so re-running after a crash resumes where it stopped (evaluation and training also
resume *within* the stage). A run directory made by a different config is refused unless `force`; one moved or
copied elsewhere (another run.name or output_dir, same settings) is the same run and resumes. The folder is
claimed for the whole command (vlmrl.run.claim: the lock, the mark, what `--force` removes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from vlmrl.common.io import read_json, write_text_atomic
from vlmrl.config.schema import Config, ConfigError, dump_config, load_config
from vlmrl.run import layout

Say = Callable[[str], None]


@dataclass
class RunOutcome:
    run_dir: Path
    done: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def run_all(config: Config, *, force: bool = False, say: Say = print, progress_factory=None,
            train_progress=None) -> RunOutcome:
    """Run stages 1-8 and the report into `config.run_dir`, holding the folder's claim throughout."""
    from vlmrl.grading.user_rewards import load_rewards
    from vlmrl.run.claim import claimed

    load_rewards(config)  # a reward that cannot be imported fails before anything runs (the call check: in eval)
    run_dir = config.run_dir
    with claimed(run_dir):
        claim_run_dir(config, run_dir, force=force)
        return _run_stages(config, run_dir, say, progress_factory, train_progress)


def _run_stages(config: Config, run_dir: Path, say: Say, progress_factory, train_progress) -> RunOutcome:
    from vlmrl import report
    from vlmrl.common.io import write_json_atomic
    from vlmrl.compare.stage import compare_runs
    from vlmrl.evaluate.stage import evaluate
    from vlmrl.evaluate.visual_control import evaluate_swapped
    from vlmrl.export.stage import export_adapter
    from vlmrl.run.doctor import collect_environment

    outcome = RunOutcome(run_dir)

    def stage(name: str, done: bool, action: Callable[[], object]) -> None:
        if done:
            outcome.skipped.append(name)
            say(f"[skip] {name}: outputs already match this config")
            return
        say(f"[run]  {name}")
        action()
        outcome.done.append(name)

    # 1 environment
    stage("doctor", False, lambda: write_json_atomic(run_dir / layout.ENV, collect_environment(run_dir)))
    # 4 data (2 and 3, model load and LoRA, happen inside the stages that need them)
    stage("prepare", layout.is_prepared(config, run_dir), lambda: _prepare_and_show_drops(config, run_dir, say))
    # 5 baseline evaluation
    stage("eval baseline", layout.eval_done(config, run_dir, "baseline"),
          lambda: evaluate(config, run_dir, "baseline", progress=_progress(progress_factory, "baseline")))
    # 6 training
    stage("train", layout.is_trained(config, run_dir), lambda: retrain(config, run_dir, say, train_progress))
    # 7 evaluation after training, and the paired comparison
    stage("eval after", layout.eval_done(config, run_dir, "after"),
          lambda: evaluate(config, run_dir, "after", progress=_progress(progress_factory, "after")))
    if config.eval.visual_control:  # the same held-out set with images swapped between items, before and after
        stage("eval swapped images",
              all(layout.eval_done(config, run_dir, s + layout.SWAPPED) for s in layout.STAGES),
              lambda: evaluate_swapped(config, run_dir, progress_factory))
    stage("compare", False, lambda: compare_runs(run_dir, seed=config.run.seed))
    # 8 export, then the report
    stage("export", layout.is_exported(config, run_dir), lambda: export_adapter(config, run_dir))
    stage("report", False, lambda: report.write_report(run_dir))
    return outcome


def prepare_with_budget(config: Config, run_dir: Path):
    """Prepare data, counting each prompt's tokens with the model's own processor."""
    from vlmrl.data.prepare import prepare_data

    return prepare_data(config, run_dir, token_counter=prompt_token_counter(config, run_dir))


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


def retrain(config: Config, run_dir: Path, say: Say, progress=None) -> None:
    """Train; a training that finished under another fingerprint (the config's own fingerprint matched, so
    a reward file changed) starts again from step 0, and the old adapter's after-training records go."""
    from vlmrl.train.stage import train

    summary = run_dir / layout.TRAIN_SUMMARY
    stale = summary.exists() and read_json(summary).get("fingerprint") != layout.train_fingerprint(config)
    if stale:
        say("[note] train: the finished training used other rewards (a reward file changed); training again")
    for path in [run_dir / "after_summary.json", run_dir / "after_swapped_summary.json",
                 *run_dir.glob("after_records*.jsonl"), *run_dir.glob("after_swapped_records*.jsonl")]:
        path.unlink(missing_ok=True)  # made with an adapter that is about to be replaced
    train(config, run_dir, resume=not stale, console_callback=say, progress=progress)


def claim_run_dir(config: Config, run_dir: Path, *, force: bool) -> None:
    """Write config.yaml, refusing to reuse a directory that holds a run of a different config, or a folder
    vlmrl did not make (`force` or not). `force` removes only what vlmrl wrote there."""
    from vlmrl.run.claim import RunDirError, ensure_marked, remove_vlmrl_outputs

    try:
        ensure_marked(run_dir)
    except RunDirError as exc:
        raise ConfigError(str(exc)) from None
    path = run_dir / layout.CONFIG
    if path.exists() and not force:
        try:
            previous = load_config(str(path), migrate=True)
        except ConfigError:
            previous = None
        if previous is None or settings_fingerprint(previous) != settings_fingerprint(config):
            raise ConfigError(
                f"{run_dir} holds a run made with a different config ({path}); "
                "choose another run.name, or pass --force to replace what vlmrl wrote there."
            )
    if force:
        remove_vlmrl_outputs(run_dir)
    write_text_atomic(path, dump_config(config))


def settings_fingerprint(config: Config) -> str:
    """The config's fingerprint without where the run lives (run.name, run.output_dir): a run folder moved or
    copied elsewhere is the same run."""
    placed = config.model_copy(deep=True)
    placed.run.name, placed.run.output_dir = "run", "."
    return placed.fingerprint()


def _progress(factory, label: str):
    return factory(label) if factory else None
