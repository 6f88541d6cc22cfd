"""The `vlmrl` command line: one small command per stage, plus run / doctor / config / bench / tiny-model.

Console output (rich) lives here and only here; stage functions return dataclasses and write files.
Every command that takes a config accepts a preset name or a YAML path plus `--set section.field=value`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from vlmrl.config import PRESETS, Config, ConfigError, dump_config, load_config

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Reinforcement learning (GRPO / GSPO) for vision-language models on visual math, measured honestly.",
)
config_app = typer.Typer(no_args_is_help=True, help="Show or validate a configuration.")
app.add_typer(config_app, name="config")
console = Console()

ConfigArg = Annotated[Optional[str], typer.Argument(help=f"Preset ({', '.join(PRESETS)}) or YAML file; default demo.")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="Override a field: section.field=value (repeatable).")]
RunDirOpt = Annotated[Optional[Path], typer.Option("--run-dir", help="Run directory (default: <output_dir>/<name>).")]


def _fail(message: str, code: int = 1) -> None:
    console.print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(code)


def _config(source: str | None, overrides: list[str] | None, run_dir: Path | None = None) -> Config:
    try:
        config = load_config(source, overrides)
    except ConfigError as exc:
        _fail(str(exc), 2)
    if run_dir is not None:
        config.run.output_dir = str(run_dir.parent)
        config.run.name = run_dir.name
    return config


def _not_implemented(command: str) -> None:
    console.print(f"vlmrl {command}: not implemented yet", highlight=False)
    raise typer.Exit(1)


@app.callback()
def _main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


@app.command()
def doctor(
    run_dir: Annotated[Optional[Path], typer.Argument(help="Write env.json into this run directory.")] = None,
) -> None:
    """Stage 1: versions, GPU, optional backends, free disk (exit 0 on a CPU-only machine)."""
    from vlmrl.doctor import collect_environment
    from vlmrl.io import write_json_atomic

    env = collect_environment(run_dir or ".")
    table = Table(title="vlmrl doctor", show_header=False)
    table.add_row("python", env["python"])
    for name, version in env["packages"].items():
        table.add_row(name, version or "[red]missing[/red]")
    cuda = env["cuda"]
    if cuda["available"]:
        for dev in cuda["devices"]:
            table.add_row(f"cuda:{dev['index']}", f"{dev['name']} ({dev['memory_gib']} GiB, sm {dev['capability']})")
    else:
        table.add_row("cuda", "not available (CPU only: tiny models and the demo run; no 4-bit)")
    for name, ok in env["backends"].items():
        table.add_row(name, "[green]available[/green]" if ok else "not installed")
    table.add_row("disk free", f"{env['disk_free_gib']} GiB")
    console.print(table)
    if run_dir is not None:
        write_json_atomic(Path(run_dir) / "env.json", env)
        console.print(f"wrote {Path(run_dir) / 'env.json'}")


@config_app.command("show")
def config_show(source: ConfigArg = None, set_: SetOpt = None) -> None:
    """Print the fully resolved configuration (preset or file, plus overrides)."""
    config = _config(source, set_)
    console.print(dump_config(config), highlight=False, markup=False, end="")


@config_app.command("validate")
def config_validate(source: Annotated[str, typer.Argument(help="YAML file or preset.")], set_: SetOpt = None) -> None:
    """Validate a configuration; exit 2 with the reason when it is not usable."""
    config = _config(source, set_)
    console.print(f"ok: {source} is valid (fingerprint {config.fingerprint()})")


@app.command("tiny-model")
def tiny_model(
    arch: Annotated[str, typer.Option(help="qwen3_vl | qwen2_5_vl | gemma3")] = "qwen3_vl",
    out: Annotated[Path, typer.Option(help="Folder to write the model into.")] = Path("tiny-model"),
    seed: Annotated[int, typer.Option(help="Weight seed.")] = 0,
) -> None:
    """Build an offline random-weight VLM (real transformers config, small tokenizer) as a HF folder."""
    from vlmrl.models.tiny import TINY_ARCHS, build_tiny_model, tiny_model_summary

    if arch not in TINY_ARCHS:
        _fail(f"--arch {arch!r}: choose one of {', '.join(TINY_ARCHS)}", 2)
    path = build_tiny_model(arch, out, seed=seed)
    console.print_json(json.dumps(tiny_model_summary(path)))
    console.print(f"wrote {path}")


@app.command()
def run(source: ConfigArg = None, set_: SetOpt = None, force: bool = False) -> None:
    """Every stage in order into one run directory (skips stages already done with this config)."""
    _config(source, set_)
    _not_implemented("run")


@app.command()
def prepare(source: ConfigArg = None, set_: SetOpt = None, run_dir: RunDirOpt = None) -> None:
    """Stage 4: data manifests, normalised images, held-out split, drop report."""
    _config(source, set_, run_dir)
    _not_implemented("prepare")


@app.command("eval")
def eval_(source: ConfigArg = None, set_: SetOpt = None, run_dir: RunDirOpt = None) -> None:
    """Stages 5 and 7: evaluate the held-out set, one record per item."""
    _config(source, set_, run_dir)
    _not_implemented("eval")


@app.command()
def train(source: ConfigArg = None, set_: SetOpt = None, run_dir: RunDirOpt = None) -> None:
    """Stage 6: GRPO / GSPO through TRL's GRPOTrainer."""
    _config(source, set_, run_dir)
    _not_implemented("train")


@app.command()
def compare(run_dir: Annotated[Optional[Path], typer.Argument()] = None) -> None:
    """Stage 7: before/after diff with paired statistics."""
    _not_implemented("compare")


@app.command()
def export(source: ConfigArg = None, set_: SetOpt = None, run_dir: RunDirOpt = None) -> None:
    """Stage 8: save and verify the adapter (optional merges)."""
    _config(source, set_, run_dir)
    _not_implemented("export")


@app.command()
def report(run_dir: Annotated[Optional[Path], typer.Argument()] = None) -> None:
    """Write report.html for a run directory."""
    _not_implemented("report")


@app.command()
def bench() -> None:
    """Side-by-side GPU benchmark: plain TRL vs vlmrl's path."""
    _not_implemented("bench")


if __name__ == "__main__":
    app()
