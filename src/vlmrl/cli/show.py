"""What the `vlmrl` commands print once a stage returns: rich tables and plain lines built from the dataclasses,
dicts and files the stages produce. The console lives here; cli.py, which holds the commands, prints through it.

Kept apart from `cli.py` so that a command reads as options -> one stage call -> one `show_*` call. Left out:
progress while a stage runs (vlmrl.common.progress, vlmrl.train.callbacks.TrainProgress), error lines and exit codes
(vlmrl.cli.errors), help and --version (vlmrl.cli.help).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console, ConsoleDimensions
from rich.markup import escape
from rich.table import Table

from vlmrl.cli.errors import fail
from vlmrl.run import layout

if TYPE_CHECKING:
    from vlmrl.common.progress import EvalProgress
    from vlmrl.config.schema import Config

# Columns when stdout is a file or a pipe: rich's default there, 80, would cut help and tables (a log is read whole).
WIDE = 160


def pipe_width(stream: Any) -> int | None:
    """WIDE for a stream that is not a terminal (unless COLUMNS says a width); None: the terminal's own width."""
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        tty = False
    return None if tty or os.environ.get("COLUMNS", "").isdigit() else WIDE


class WideConsole(Console):
    """A rich console as wide as the terminal it writes to, and WIDE columns when it writes to a file or a pipe
    (decided at each print: the same console serves a terminal and a captured stdout)."""

    def _size(self) -> ConsoleDimensions:
        size = Console.size.fget(self)
        width = pipe_width(self.file) if self._width is None else None
        return size if width is None else ConsoleDimensions(width, size.height)

    size = property(_size, Console.size.fset)


def _table(title: str, columns: tuple[str, ...] = ("", ""), *, right: tuple[str, ...] = (),
          show_header: bool = True) -> Table:
    """A table at least as wide as its title (rich wraps a title at the table's width), whose cells fold onto the
    next line when too long for the console, never ending in `…`."""
    t = Table(title=title, min_width=len(title), show_header=show_header)
    for name in columns:
        t.add_column(name, justify="right" if name in right else "left", overflow="fold")
    return t


console = WideConsole()
# What `vlmrl run` lists at its end, those that exist, in the order the stages write them.
RUN_FILES = (layout.CONFIG, layout.DATA_SUMMARY, layout.records_file("baseline"), layout.METRICS,
             layout.ROLLOUTS, layout.records_file("after"), layout.COMPARISON, "adapter", layout.EXPORT,
             layout.REPORT)


def say(message: str) -> None:
    """A plain line: never wrapped (a log keeps one line per record), no markup read from the message."""
    console.print(message, highlight=False, markup=False, soft_wrap=True)


def eval_progress(label: str) -> EvalProgress:
    from vlmrl.common.progress import EvalProgress

    return EvalProgress(console, label)


def show_environment(env: dict) -> None:
    """`vlmrl doctor`'s table from vlmrl.preflight.doctor.collect_environment."""
    table = _table("vlmrl doctor", show_header=False)
    table.add_row("python", env["python"])
    for name, version in env["packages"].items():
        table.add_row(name, version or "[red]missing[/red]")
    cuda = env["cuda"]
    if cuda["available"]:
        for dev in cuda["devices"]:
            table.add_row(f"cuda:{dev['index']}", f"{dev['name']} ({dev['memory_gib']} GiB, sm {dev['capability']})")
    else:
        table.add_row("cuda", "not available (CPU only: tiny models and the demo run)")
    four_bit = env["four_bit"]
    table.add_row("4-bit (nf4)", "[green]available[/green]" + ("" if cuda["available"] else " on the CPU (slow)")
                  if four_bit["available"] else f"not available: {escape(four_bit['reason'])}")
    for name, ok in env["backends"].items():
        table.add_row(name, "[green]available[/green]" if ok else "not installed")
    table.add_row("disk free", f"{env['disk_free_gib']} GiB")
    console.print(table)


def show_preflight(config: Config, env: dict, prompt_tokens: int, *, gpus: int = 1, strategy: str = "ddp") -> None:
    """`vlmrl doctor --config`: the predicted GPU memory of `config` (each GPU's, with `gpus` > 1) and advice
    against the first GPU of `env`."""
    from vlmrl.preflight.memory import advice, estimate_memory, shapes_for

    shapes = shapes_for(config.model.name)
    if shapes is None:
        console.print(f"preflight: no local config.json or shipped shapes for {config.model.name!r}; "
                      "point model.name at a downloaded folder to get a prediction.", highlight=False, markup=False)
        return
    # The prediction is for the GPU the config is meant for, where `auto` turns fast generation on.
    estimate = estimate_memory(config, shapes, prompt_tokens=prompt_tokens,
                               fast_generation=config.train.rollout.fast != "never", gpus=gpus, strategy=strategy)
    where = "" if gpus == 1 else f", each of {gpus} GPUs, {strategy}"
    table = _table(f"memory preflight: {config.model.name} (prompt {prompt_tokens} tokens{where})", show_header=False)
    for key, value in estimate.as_dict().items():
        table.add_row(key.removesuffix("_gib").replace("_", " "), f"{value:.1f} GiB")
    console.print(table)
    devices = env["cuda"]["devices"]
    for line in advice(estimate, devices[0]["memory_gib"] if devices else None, config, shapes=shapes,
                       prompt_tokens=prompt_tokens):
        console.print(f"[yellow]warning:[/yellow] {escape(line)}", soft_wrap=True)


def show_tiny_model(path: Path, summary: dict) -> None:
    console.print_json(json.dumps(summary))
    console.print(f"wrote {path}", markup=False)


def show_preset_note(config: Config) -> None:
    """Before a preset's training: why it pairs GSPO with a token-summing loss, in one line. Called once per
    command, for a preset named on the command line only: a user's own config chose its loss itself."""
    from vlmrl.train.args import gspo_loss_note

    if note := gspo_loss_note(config):
        say(f"note: {note}")


def show_run_done(run_dir: Path, seconds: float) -> None:
    """`vlmrl run`'s end: the comparison, the time taken and the files the run holds."""
    show_comparison(run_dir / layout.COMPARISON)
    console.print(f"\n[bold]done[/bold] in {seconds:.0f} s: {escape(str(run_dir))}")
    for name in RUN_FILES:
        if (run_dir / name).exists():
            console.print(f"  {run_dir / name}", highlight=False, markup=False)


def show_prepared(run_dir: Path) -> None:
    """`vlmrl prepare`'s end: one line of counts naming data/summary.json, then the drops (one line per reason)
    and the summary's warning, when there are any."""
    path = run_dir / layout.DATA_SUMMARY
    summary = json.loads(path.read_text())
    counts = summary["counts"]
    say(f"prepared {counts['train']} train and {counts['holdout']} held-out items from {counts['input_rows']} rows "
        f"({counts.get('dropped', 0)} dropped): {path}")
    from vlmrl.data.drops import drop_lines

    for line in drop_lines(summary.get("drops") or [], counts["input_rows"]):
        say(line)
    if summary.get("comparable_to_published") is False:
        console.print(f"[yellow]warning:[/yellow] {escape(str(summary.get('message')))}", soft_wrap=True)


def show_eval(stage: str, result: Any) -> None:
    """An evaluation's summary (vlmrl.evaluate.stage's result): each metric with its 95% interval."""
    s = result.summary
    table = _table(f"{stage} ({s['n']} items)", ("metric", "value", "95% CI"), right=("value", "95% CI"))
    for key in ("accuracy", "mathvista_accuracy", "format_compliance", "total_reward"):
        lo, hi = s[key]["ci95"]
        table.add_row(key, f"{s[key]['mean']:.3f}", escape(f"[{lo:.3f}, {hi:.3f}]"))
    table.add_row("truncation_rate", f"{s['truncation_rate']:.3f}", "")
    table.add_row("gibberish_rate", f"{s['gibberish_rate']:.3f}", "")
    console.print(table)
    console.print(f"records: {result.records_path}", markup=False)


def show_trained(result: Any, run_dir: Path) -> None:
    """`vlmrl train`'s end: one line (steps, time, loss, the adapter) naming train/summary.json."""
    s = result.summary
    loss = s.get("train_loss")
    say(f"trained {s.get('steps')} steps in {s.get('train_seconds') or 0:.0f} s"
        + (f", loss {loss:.4f}" if isinstance(loss, int | float) else "")
        + f": adapter {result.final_dir}, summary {run_dir / layout.TRAIN_SUMMARY}")


def show_comparison(path: Path) -> None:
    """comparison.json as a before -> after table, the flip counts and the visual control; nothing if absent."""
    if not path.exists():
        return
    comparison = json.loads(path.read_text())
    columns = ("metric", "before", "after", "delta", "95% CI", "McNemar p")
    table = _table(f"before -> after ({comparison['n_paired']} held-out items)", columns, right=columns[1:])
    from vlmrl.common.stats import finite

    for name, m in comparison["metrics"].items():
        if not all(finite(m.get(key)) for key in ("before", "after", "delta")):  # a reward that never scored
            table.add_row(name, "no values", "", "", "", "")
            continue
        ci = m.get("delta_ci95") or []
        p = f"{m['mcnemar_p']:.3g}" if "mcnemar_p" in m else ""
        table.add_row(name, f"{m['before']:.3f}", f"{m['after']:.3f}", f"{m['delta']:+.3f}",
                      escape(f"[{ci[0]:+.3f}, {ci[1]:+.3f}]") if len(ci) == 2 and all(map(finite, ci)) else "–", p)
    console.print(table)
    flips = comparison["flip_counts"]
    console.print(", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in flips.items()), highlight=False)
    if comparison.get("visual_control"):
        _show_visual_control(comparison["visual_control"])


def _show_visual_control(control: dict) -> None:
    columns = ("family", "n", "before true", "before swapped", "after true", "after swapped", "visual gain", "95% CI")
    table = _table("visual control: accuracy on true vs swapped images", columns, right=columns[1:])
    for name, b in [("all", control["overall"]), *sorted(control["by_family"].items())]:
        a, (lo, hi) = b["accuracy"], b["visual_gain_ci95"]
        table.add_row(name, str(b["n"]), *(f"{a[k]:.3f}" for k in ("before_true", "before_swapped", "after_true",
                      "after_swapped")), f"{b['visual_gain']:+.3f}", escape(f"[{lo:+.3f}, {hi:+.3f}]"))
    console.print(table)


def show_export_checks(report: dict) -> None:
    """vlmrl.export.stage.export_adapter's checks: pass, FAIL or skipped, with the value measured."""
    table = _table("export checks", ("check", "result", "value", "detail"))
    for c in report["checks"]:
        verdict = {True: "[green]pass[/green]", False: "[red]FAIL[/red]", None: "skipped"}[c["passed"]]
        table.add_row(c["name"], verdict, escape(str(c["value"])), escape(c["detail"]))
    console.print(table)


def show_bench(out: Path, summary: dict) -> None:
    """bench.md as written; exit 2 naming the paths that failed (their errors are in bench.json)."""
    console.print((out / "bench.md").read_text(), markup=False, highlight=False)
    failed = [name for name, p in summary["paths"].items() if p.get("error")]
    if failed:
        fail(f"bench path(s) failed: {', '.join(failed)} (details in {out / 'bench.json'})")


def show_throughput(out: Path, summary: dict) -> None:
    """throughput.md as written; exit 2 naming the generation batches that failed or were skipped."""
    console.print((out / "throughput.md").read_text(), markup=False, highlight=False)
    if failed := [f"{r['path']} at {r['generation_batch']}" for r in summary["rows"] if r.get("error")]:
        fail(f"generation batch(es) failed or skipped: {', '.join(failed)} (details in {out / 'throughput.json'})")
