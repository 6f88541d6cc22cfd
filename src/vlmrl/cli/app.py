"""The `vlmrl` command line: one small command per stage, plus run / doctor / config / bench / tiny-model.

Only argument handling lives here: each command parses and checks its options, calls one stage function and
hands the result to a `show_*` of vlmrl.cli.show. Console output (rich) lives in the cli modules only; stage
functions return dataclasses and write files. Every command that takes a config accepts a preset name or a
YAML path plus `--set section.field=value`. Beside it: cli_show (what the commands print), cli_errors (one
line and an exit code per failure), cli_launch (--gpus / --nodes), cli_help (help and --version), cli_benchmark
(`vlmrl bench`).
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from vlmrl.cli import show
from vlmrl.cli.benchmark import bench
from vlmrl.cli.errors import Commands, check_needs, fail, guarded, set_debug
from vlmrl.cli.errors import claimed as _claimed
from vlmrl.cli.help import HELP, Arch, Stage, Strategy, print_version
from vlmrl.cli.launch import AddressOpt, GpusOpt, NodeRankOpt, NodesOpt, PortOpt, StrategyOpt
from vlmrl.cli.launch import claimed_on_host_0 as _claimed_on_host_0
from vlmrl.cli.launch import nodes as _nodes
from vlmrl.cli.launch import one_process_only as _one_process_only
from vlmrl.cli.launch import relaunch_if_asked as _relaunch_if_asked
from vlmrl.cli.launch import stage_argv as _stage_argv
from vlmrl.cli.show import console, eval_progress, say
from vlmrl.config.schema import PRESETS, Config, ConfigError, dump_config, load_config
from vlmrl.run import layout

app = typer.Typer(
    cls=Commands,
    add_completion=False,
    no_args_is_help=True,
    context_settings=HELP,
    help="Reinforcement learning (GRPO / GSPO) for vision-language models on visual math, measured honestly.",
)
config_app = typer.Typer(no_args_is_help=True, context_settings=HELP, help="Show or validate a configuration.")
app.add_typer(config_app, name="config")

ConfigArg = Annotated[str | None, typer.Argument(
    help=f"Preset ({', '.join(PRESETS)}), YAML file or run folder (its config.yaml); default demo.")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="Override a field: section.field=value (repeatable).")]
RunDirOpt = Annotated[Path | None, typer.Option("--run-dir", help="Run directory (default: <output_dir>/<name>).")]


def _config(source: str | None, overrides: list[str] | None, run_dir: Path | None = None) -> Config:
    """A preset, a YAML file, or a run folder (its config.yaml; the run then lives in that folder). A preset's
    name is the preset unless a run folder of that name is here (a plain folder `demo` does not hide `demo`)."""
    if source is not None and Path(source).is_dir() and not (source in PRESETS
                                                            and not (Path(source) / layout.CONFIG).is_file()):
        if not (Path(source) / layout.CONFIG).is_file():
            fail(f"{source}: a folder without config.yaml; give a preset, a YAML file or a run folder.", 2)
        run_dir = run_dir or Path(source)
        source = str(Path(source) / layout.CONFIG)
    try:
        config = load_config(source, overrides, run_folder=_in_run_folder(source))
    except ConfigError as exc:
        fail(str(exc), 2)
    if run_dir is not None:
        config.run.output_dir = str(run_dir.parent)
        config.run.name = run_dir.name
    return config


def _names_a_preset(source: str | None) -> bool:
    """Whether `_config` reads `source` as a preset (none given: the demo), not as a file or a run folder."""
    return source is None or (source in PRESETS and not (Path(source) / layout.CONFIG).is_file())


def _in_run_folder(source: str | None) -> bool:
    """A run folder's own config.yaml (vlmrl's mark beside it): it must carry this vlmrl's schema_version."""
    from vlmrl.run.claim import MARKER

    return source is not None and Path(source).name == layout.CONFIG and (Path(source).parent / MARKER).is_file()


@app.callback()
def _main(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show the traceback of an error instead of one line.")] = False,
    version: Annotated[bool, typer.Option("--version", callback=print_version, is_eager=True,
                                          help="Print the vlmrl version (and git commit in a checkout), then exit.")] = False,
) -> None:
    from vlmrl.common.progress import set_sink

    set_debug(debug)
    set_sink(say)  # preparation and the demo-policy build report their progress here
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not verbose:
        # Weight-loading and shard-writing bars from transformers would interleave with our own progress.
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        # bitsandbytes warns on import that an optional CPU kernel package is missing (it falls back on its own)
        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", category=FutureWarning)  # library deprecation notes, not the user's


@app.command()
def doctor(
    run_dir: Annotated[Path | None, typer.Argument(help="Write env.json into this run directory.")] = None,
    config_source: Annotated[str | None, typer.Option("--config", help="Also predict this config's GPU memory.")] = None,
    set_: SetOpt = None,
    prompt_tokens: Annotated[int, typer.Option(help="Prompt length (image tokens included) for the prediction.")] = 384,
    gpus: Annotated[int, typer.Option("--gpus", min=1, help="With --config: predict each GPU's peak in a run of N "
                                      "GPUs (vlmrl train --gpus N).")] = 1,
    strategy: Annotated[Strategy, typer.Option("--strategy", help="With --gpus N: what the run shards (ddp: "
                                               "nothing; fsdp / zero3: the weights; zero2: LoRA optimizer state).")
                        ] = Strategy.ddp,
) -> None:
    """Stage 1: versions, GPU, optional backends, free disk (exit 0 on a CPU-only machine); with --config, a
    memory preflight."""
    from vlmrl.common.io import write_json_atomic
    from vlmrl.preflight.doctor import collect_environment

    env = collect_environment(run_dir or ".")
    show.show_environment(env)
    if config_source is not None:
        show.show_preflight(_config(config_source, set_), env, prompt_tokens, gpus=gpus, strategy=str(strategy))
    if run_dir is not None:
        with _claimed(Path(run_dir)):  # a folder vlmrl did not make is refused, never written into
            write_json_atomic(Path(run_dir) / layout.ENV, env)
        console.print(f"wrote {Path(run_dir) / 'env.json'}", markup=False)


@config_app.command("show")
def config_show(source: ConfigArg = None, set_: SetOpt = None,
                all_: Annotated[bool, typer.Option("--all", help="Every field, defaults included.")] = False) -> None:
    """Print the resolved configuration (preset or file, plus overrides): the fields that differ from their
    defaults, or with --all every field (as the run folder's config.yaml holds it)."""
    config = _config(source, set_)
    if not all_:
        console.print("# fields that differ from their defaults; --all prints every field", markup=False)
    console.print(dump_config(config, changed_only=not all_), highlight=False, markup=False, end="")


@config_app.command("validate")
def config_validate(source: Annotated[str, typer.Argument(help="YAML file or preset.")], set_: SetOpt = None) -> None:
    """Validate a configuration as training would (names TRL and transformers know, trackers installed); exit 2
    with one line per problem when it is not usable."""
    config = _config(source, set_)
    _refuse_untrainable(source, config)
    console.print(f"ok: {source} is valid (fingerprint {config.fingerprint()})", markup=False)


def _refuse_untrainable(source: str, config: Config) -> None:
    """Exit 2 with one line per problem training would find (`vlmrl.train.args.validation_problems`): what
    `config validate` refuses, `run` refuses before its first stage."""
    from vlmrl.train.args import validation_problems

    if problems := validation_problems(config):
        fail(f"{source}: not trainable\n" + "\n".join(f"  {p}" for p in problems), 2)


@app.command("tiny-model")
def tiny_model(
    arch: Annotated[Arch, typer.Option(help="Architecture of the tiny model.")] = Arch.qwen3_vl,
    out: Annotated[Path, typer.Option(help="Folder to write the model into.")] = Path("tiny-model"),
    seed: Annotated[int, typer.Option(help="Weight seed.")] = 0,
) -> None:
    """Build an offline random-weight VLM (real transformers config, small tokenizer) as a HF folder."""
    from vlmrl.models.tiny import build_tiny_model, tiny_model_summary

    path = build_tiny_model(arch, out, seed=seed)
    show.show_tiny_model(path, tiny_model_summary(path))


@app.command()
def run(
    source: ConfigArg = None,
    set_: SetOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Replace a finished run of another config in the run "
                                        "folder (deletes only what vlmrl wrote there).")] = False,
    run_dir: RunDirOpt = None,
    resume: Annotated[bool, typer.Option("--resume/--no-resume", help="--no-resume: train again from step 0 (the "
                                         "earlier training is moved aside), and redo what follows it.")] = True,
) -> None:
    """Every stage in order into one run directory (skips stages done with this config and these inputs; after a
    config change, redoes the stages it affects)."""
    from vlmrl.pipeline import run_all

    _one_process_only("run")
    config = _config(source, set_, run_dir)
    _refuse_untrainable(source or "demo", config)
    check_needs(config)
    console.print(f"vlmrl run: [bold]{escape(config.run.name)}[/bold] -> {escape(str(config.run_dir))}")
    if _names_a_preset(source) and not (resume and layout.is_trained(config, config.run_dir)):
        show.show_preset_note(config)  # once, before the stages (a rank of training says nothing more)
    started = time.perf_counter()
    from vlmrl.train.callbacks import TrainProgress

    outcome = guarded(lambda: run_all(config, force=force, resume=resume, say=say, progress_factory=eval_progress,
                                      train_progress=TrainProgress(console, say)))
    show.show_run_done(outcome.run_dir, time.perf_counter() - started)


@app.command()
def prepare(source: ConfigArg = None, set_: SetOpt = None, run_dir: RunDirOpt = None) -> None:
    """Stage 4: data manifests, normalised images, held-out split, drop report."""
    from vlmrl.pipeline import prepare_with_budget

    _one_process_only("prepare")
    config = _config(source, set_, run_dir)
    check_needs(config, gpu=False)
    with _claimed(config.run_dir):
        result = guarded(lambda: prepare_with_budget(config, config.run_dir))
    show.show_prepared(config.run_dir)
    return result


@app.command("eval")
def eval_(
    source: ConfigArg = None,
    set_: SetOpt = None,
    run_dir: RunDirOpt = None,
    stage: Annotated[Stage, typer.Option(help="baseline: no adapter; after: the trained adapter.")] = Stage.baseline,
    adapter: Annotated[Path | None, typer.Option(help="Adapter folder (default for after: train/final).")] = None,
    gpus: GpusOpt = 1,
    strategy: StrategyOpt = Strategy.ddp,
    nodes: NodesOpt = 1,
    node_rank: NodeRankOpt = None,
    main_address: AddressOpt = None,
    main_port: PortOpt = None,
) -> None:
    """Stages 5 and 7: evaluate the held-out set, one record per item (sharded across --gpus N processes)."""
    from vlmrl.common.distributed import is_main_process
    from vlmrl.evaluate.stage import evaluate

    config = _config(source, set_, run_dir)  # a bad config fails here, before any process is launched
    where = _nodes(nodes, node_rank, main_address, main_port)
    check_needs(config)
    main = is_main_process()
    with _claimed_on_host_0(config.run_dir, where):  # held by this process for the ranks it launches
        _relaunch_if_asked(gpus, strategy, [*_stage_argv("eval", source, set_, run_dir), "--stage", stage,
                                            *(["--adapter", str(adapter)] if adapter else [])], where)
        result = guarded(lambda: evaluate(config, config.run_dir, stage, adapter=adapter,
                                          progress=eval_progress(stage) if main else None))
    if main:
        show.show_eval(stage, result)


@app.command()
def train(
    source: ConfigArg = None,
    set_: SetOpt = None,
    run_dir: RunDirOpt = None,
    resume: Annotated[bool, typer.Option("--resume/--no-resume", help="Continue from the last checkpoint.")] = True,
    gpus: GpusOpt = 1,
    strategy: StrategyOpt = Strategy.ddp,
    nodes: NodesOpt = 1,
    node_rank: NodeRankOpt = None,
    main_address: AddressOpt = None,
    main_port: PortOpt = None,
) -> None:
    """Stage 6: GRPO / GSPO through TRL's GRPOTrainer (data-parallel across --gpus N processes)."""
    from vlmrl.common.distributed import is_main_process
    from vlmrl.train.stage import train as train_stage

    config = _config(source, set_, run_dir)  # a bad config fails here, before any process is launched
    where = _nodes(nodes, node_rank, main_address, main_port)
    check_needs(config, gpus=gpus * where.count, strategy=str(strategy))  # the memory check is per GPU
    from vlmrl.train.callbacks import TrainProgress

    with _claimed_on_host_0(config.run_dir, where):  # held by this process for the ranks it launches
        _relaunch_if_asked(gpus, strategy, [*_stage_argv("train", source, set_, run_dir),
                                            *([] if resume else ["--no-resume"])], where)
        if is_main_process() and _names_a_preset(source) and not (resume and layout.is_trained(config, config.run_dir)):
            show.show_preset_note(config)
        result = guarded(lambda: train_stage(config, config.run_dir, resume=resume, console_callback=say,
                                             progress=TrainProgress(console, say)))
    if is_main_process() and not result.already_done:
        show.show_trained(result, config.run_dir)


@app.command()
def compare(
    run_dir: Annotated[Path, typer.Argument(help="Run directory.")] = Path("runs/demo"),
    visual_control: Annotated[bool, typer.Option(
        "--visual-control", help="First evaluate the held-out set with images swapped between items, before and "
        "after training (skipped when done), and report the visual gain.")] = False,
) -> None:
    """Stage 7: before/after diff with paired statistics."""
    from vlmrl.compare.stage import compare_runs

    _ours(run_dir)  # a folder vlmrl did not make, or a link out of it, is refused before anything is read
    seed = 0
    if visual_control:
        from vlmrl.evaluate.visual_control import evaluate_swapped

        config = _config(str(run_dir), None, run_dir)
        check_needs(config)
        seed = config.run.seed
        with _claimed(config.run_dir, create=False):
            guarded(lambda: evaluate_swapped(config, config.run_dir, eval_progress))
    elif (run_dir / layout.CONFIG).is_file():  # the seed the run's own compare stage used
        seed = _config(str(run_dir), None, run_dir).run.seed
    result = guarded(lambda: compare_runs(run_dir, seed=seed))
    show.show_comparison(result.path)
    _refresh_report(run_dir)


@app.command()
def export(
    source: ConfigArg = None,
    set_: SetOpt = None,
    run_dir: RunDirOpt = None,
    adapter: Annotated[Path | None, typer.Option(help="Adapter folder to export (default: train/final).")] = None,
    push_to_hub: Annotated[str | None, typer.Option("--push-to-hub", help="Upload adapter/ to this hub repo id "
                                                    "after a verified export (huggingface_hub; needs a token).")] = None,
    private: Annotated[bool, typer.Option("--private", help="With --push-to-hub: create the repo private.")] = False,
) -> None:
    """Stage 8: save and verify the adapter (optional merges and GGUF; see docs/export.md)."""
    from vlmrl.export import stage as export_stage

    _one_process_only("export")
    config = _config(source, set_, run_dir)
    with _claimed(config.run_dir, create=False):
        try:
            show.show_export_checks(guarded(lambda: export_stage.export_adapter(config, config.run_dir, source=adapter)))
        finally:  # export.json changed, passed or not: the page that shows it follows
            _refresh_report(config.run_dir)
    if push_to_hub:
        url = guarded(lambda: export_stage.push_to_hub(config.run_dir, push_to_hub, private=private))
        console.print(f"uploaded {config.run_dir / 'adapter'} to {push_to_hub}: {url}", highlight=False)


@app.command()
def report(run_dir: Annotated[Path, typer.Argument(help="Run directory.")] = Path("runs/demo")) -> None:
    """Write report.html for a run directory."""
    from vlmrl.report import write_report

    if not run_dir.is_dir():
        fail(f"{run_dir}: no such run directory")
    _ours(run_dir)
    console.print(f"wrote {write_report(run_dir)}", markup=False)


def _refresh_report(run_dir: Path) -> None:
    """Rewrite a run's report.html, when it has one, if a file the page read has changed since."""
    from vlmrl import report

    if (run_dir / layout.REPORT).is_file() and not report.is_current(run_dir):
        console.print(f"refreshed {report.write_report(run_dir)}", markup=False)


def _ours(run_dir: Path) -> None:
    """`compare` and `report` write into a run without claiming it: the mark and the links are checked instead."""
    from vlmrl.run.claim import require_mark

    guarded(lambda: require_mark(run_dir))


app.command()(bench)  # vlmrl.cli.benchmark


if __name__ == "__main__":
    app()
