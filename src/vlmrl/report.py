"""The report: one self-contained `report.html` that shows what a run did and what changed.

It reads only files in the run directory (every number on the page is a value from one of them, and each
section names its file), so it can be regenerated at any time and works for a run stopped at any stage: a
missing file becomes a plain sentence saying what is missing, never an error. The page needs no network:
plots are inline SVG (matplotlib, no pyplot state), thumbnails are base64 PNGs, CSS and JS are inline, and a
Content-Security-Policy forbids every fetch and every script but ours (pinned by hash), so even a completion
that slipped past escaping could not run. All text from the model or the data goes through `html.escape`.

Left out on purpose: computing statistics (that is `compare.py`'s job; the report only shows them), and
full-size images (96 px thumbnails keep a 100-item report well under a few megabytes).
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from vlmrl import visual_control
from vlmrl.io import read_json, read_jsonl, write_text_atomic

THUMB_PX = 96
HEADLINE = [  # comparison.json metric -> label; the first three are paired binary metrics (with McNemar)
    ("accuracy", "Accuracy (ours)"), ("mathvista_accuracy", "Accuracy (MathVista grading)"),
    ("format_compliance", "Format compliance"), ("total_reward", "Mean total reward"),
    ("format_reward", "Mean format reward"), ("correctness_reward", "Mean correctness reward"),
]
EVAL_EXTRAS = [  # *_summary.json key -> number format
    ("n", "d"), ("truncation_rate", ".3f"), ("gibberish_rate", ".3f"), ("mean_generated_tokens", ".1f"),
    ("tokens_per_second", ".1f"), ("items_per_second", ".2f"),
]
TRAIN_KEYS = [  # TRL log key -> label, in plotting order; every `clip_ratio/...` key shares one plot
    ("reward", "total reward"), ("rewards/format_reward/mean", "format reward (mean)"),
    ("rewards/correctness_reward/mean", "correctness reward (mean)"),
    ("completions/mean_length", "completion length"), ("completions/clipped_ratio", "truncated completions"),
    ("clip_ratio/*", "clip ratio"), ("kl", "KL"), ("frac_reward_zero_std", "zero-variance groups (fraction)"),
    ("learning_rate", "learning rate"), ("loss", "loss"), ("grad_norm", "grad norm"),
]
VALIDATION_KEYS = [("accuracy", "validation accuracy"), ("format_compliance", "validation format compliance"),
                   ("total_reward", "validation total reward")]
HEALTH_KEYS = [("format_rate", "format rate"), ("gibberish_rate", "gibberish rate"),
               ("truncation_rate", "truncation rate"), ("zero_variance_groups", "zero-variance groups")]


def write_report(run_dir: Path) -> Path:
    """Write `run_dir/report.html` from whatever stage outputs exist; return its path."""
    path = Path(run_dir) / "report.html"
    write_text_atomic(path, build_report(Path(run_dir)))
    return path


def build_report(run_dir: Path) -> str:
    """The whole page, as a string."""
    files = _RunFiles(Path(run_dir))
    sections = [
        ("headline", "Before / after", _headline_section(files)),
        ("training", "Training", _training_section(files)),
        ("categories", "By category", _category_section(files)),
        ("visual", "Visual control", visual_control.report_html((files.json_object("comparison.json") or {}).get("visual_control"))),
        ("flips", "Flips", _flips_section(files)),
        ("samples", "Samples", _samples_section(files)),
        ("export", "Export checks", _export_section(files)),
        ("data", "Data", _data_section(files)),
        ("setup", "Config & environment", _setup_section(files)),
    ]
    nav = "".join(f'<a href="#{key}">{title}</a>' for key, title, _ in sections)
    body = "".join(f'<section id="{key}"><h2>{title}</h2>{html_}</section>' for key, title, html_ in sections)
    script_hash = base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode()
    csp = f"default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'sha256-{script_hash}'"
    name = _e(files.run_dir.resolve().name)
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><link rel="icon" href="data:,">'
        f"<title>vlmrl report: {name}</title><style>{_CSS}</style></head><body>"
        f"<header><h1>vlmrl report <span>{name}</span></h1><nav>{nav}</nav>{files.inventory()}</header>"
        f"<main>{body}</main><script>{_SCRIPT}</script></body></html>\n"
    )


class _RunFiles:
    """Reads each run-directory file once and remembers which were unreadable, for the page to say so."""

    KNOWN: ClassVar[list[str]] = [
        "config.yaml", "env.json", "data/summary.json", "data/holdout.jsonl", "baseline_records.jsonl",
        "baseline_summary.json", "train/summary.json", "train/metrics.jsonl", "train/health.jsonl",
        "after_records.jsonl", "after_summary.json", "comparison.json", "export.json"]

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.problems: dict[str, str] = {}
        self._cache: dict[str, Any] = {}

    def json(self, name: str) -> Any:
        return self._read(name, read_json)

    def json_object(self, name: str) -> dict | None:
        data = self.json(name)
        if data is not None and not isinstance(data, dict):
            self.problems[name] = f"expected a JSON object, found {type(data).__name__}"
        return data if isinstance(data, dict) else None

    def jsonl(self, name: str) -> list[dict]:
        return [row for row in self._read(name, read_jsonl) or [] if isinstance(row, dict)]

    def text(self, name: str) -> str | None:
        return self._read(name, lambda path: path.read_text(encoding="utf-8", errors="replace"))

    def _read(self, name: str, reader: Callable[[Path], Any]) -> Any:
        if name not in self._cache:
            self._cache[name] = None
            if (self.run_dir / name).is_file():
                try:
                    self._cache[name] = reader(self.run_dir / name)
                except (OSError, ValueError) as exc:  # one damaged file must not take the whole report down
                    self.problems[name] = f"{type(exc).__name__}: {exc}"
        return self._cache[name]

    def missing(self, name: str, what: str, lacks: str = "what this section shows") -> str:
        """A plain sentence for a section whose file is absent, unreadable, or lacks the section's part."""
        if name in self.problems:
            why = f"could not be read: {_e(self.problems[name])}"
        elif (self.run_dir / name).is_file():
            why = f"has no {lacks}"
        else:
            why = "missing"
        return f'<p class="missing">{what} ({_e(name)} {why}).</p>'

    def inventory(self) -> str:
        """Each input file: found, absent or unreadable (call it after the sections have read them)."""
        state = {n: "unreadable" if n in self.problems else "found" if (self.run_dir / n).is_file()
                 else "absent" for n in self.KNOWN}
        items = "".join(f'<li class="{state[n]}">{_e(n)}</li>' for n in self.KNOWN)
        return f'<details class="inventory"><summary>Input files</summary><ul>{items}</ul></details>'


# ---- sections ------------------------------------------------------------------------------------------

def _headline_section(files: _RunFiles) -> str:
    comparison = files.json_object("comparison.json")
    parts = []
    if comparison and isinstance(comparison.get("metrics"), dict):
        rows = []
        for key, label in HEADLINE + _more_rewards(comparison["metrics"]):
            m = comparison["metrics"].get(key)
            if isinstance(m, dict):
                flips = f"+{_e(m['gained'])} / −{_e(m.get('lost'))}" if "gained" in m else ""
                p = _num_td(m["mcnemar_p"], ".3g") if "mcnemar_p" in m else "<td></td>"
                rows.append(f'<tr data-metric="{key}"><th>{label}</th>{_num_td(m.get("before"))}'
                            f'{_num_td(m.get("after"))}{_num_td(m.get("delta"), signed=True)}'
                            f'<td>{_interval(m.get("delta_ci95"))}</td>{p}<td>{flips}</td></tr>')
        unpaired = comparison.get("ids_missing_a_pair") or []
        parts.append(
            f'<p class="src">From comparison.json: {_e(comparison.get("n_paired"))} paired held-out items'
            f'{f", {len(unpaired)} without a pair" if unpaired else ""}. Delta = after − before; interval: '
            "paired bootstrap 95%; p: exact McNemar test on the discordant pairs; flips: items gained / "
            "lost.</p>"
            + _table(["metric", "before", "after", "delta", "delta 95% CI", "McNemar p", "flips"], rows,
                     "headline"))
    else:
        parts.append(files.missing("comparison.json", "No before/after comparison yet", '"metrics"'))
    summaries = {s: files.json_object(f"{s}_summary.json") for s in ("baseline", "after")}
    summaries = {stage: summary for stage, summary in summaries.items() if summary}
    if summaries:
        parts.append(_eval_summary_table(summaries))
    if "baseline" not in summaries:
        parts.append(files.missing("baseline_summary.json", "No evaluation yet"))
    if "after" not in summaries:
        parts.append(files.missing("after_summary.json", "No evaluation after training yet"))
    return "".join(parts)


def _eval_summary_table(summaries: dict[str, dict]) -> str:
    rows = []
    per_reward = {n for s in summaries.values() if isinstance(s.get("rewards"), dict) for n in s["rewards"]}
    for key, label in HEADLINE + _more_rewards(dict.fromkeys(sorted(per_reward))):
        cells = ""
        for summary in summaries.values():
            stat = summary.get(key) if isinstance(summary.get(key), dict) else {}
            if key not in summary and isinstance(summary.get("rewards"), dict):  # a user reward
                stat = summary["rewards"].get(key) if isinstance(summary["rewards"].get(key), dict) else {}
            cells += f'{_num_td(stat.get("mean"))}<td>{_interval(stat.get("ci95"))}</td>'
        rows.append(f'<tr data-metric="{key}"><th>{label}</th>{cells}</tr>')
    for key, fmt in EVAL_EXTRAS:
        cells = "".join(f"{_num_td(summary.get(key), fmt)}<td></td>" for summary in summaries.values())
        rows.append(f'<tr data-metric="{key}"><th>{key.replace("_", " ")}</th>{cells}</tr>')
    head = ["metric"] + [h for stage in summaries for h in (f"{stage} (mean)", f"{stage} 95% CI")]
    source = " and ".join(f"{stage}_summary.json" for stage in summaries)
    return (f'<h3>Evaluation summaries</h3><p class="src">From {source}: each stage alone, means with '
            f"bootstrap intervals.</p>{_table(head, rows, 'summary')}")


def _training_section(files: _RunFiles) -> str:
    metrics, health = files.jsonl("train/metrics.jsonl"), files.jsonl("train/health.jsonl")
    summary = files.json_object("train/summary.json")
    parts = [f'<p class="src">From train/summary.json.</p>{_kv_table(summary)}' if summary
             else files.missing("train/summary.json", "No training summary yet")]
    plots = []
    known = {key for key, _ in TRAIN_KEYS}
    user = sorted({k for row in metrics for k in row if k.startswith("rewards/") and k.endswith("/mean")} - known)
    for key, label in TRAIN_KEYS[:3] + [(k, f"{k[8:-5]} (mean)") for k in user] + TRAIN_KEYS[3:]:
        keys = ([key] if key != "clip_ratio/*"
                else sorted({k for row in metrics for k in row if k.startswith("clip_ratio/")}))
        series = {k: _series(metrics, k) for k in keys}
        series = {k: xy for k, xy in series.items() if xy[0]}
        if series:
            plots.append(_figure(label, key, series))
    parts.append('<h3>Trainer log</h3><p class="src">From train/metrics.jsonl (TRL logs), against step.</p>'
                 f'<div class="plots">{"".join(plots)}</div>' if plots
                 else files.missing("train/metrics.jsonl", "No training metrics yet", "plottable metric yet"))
    plots = [_figure(label, key, {key: _series(health, key)})
             for key, label in HEALTH_KEYS if _series(health, key)[0]]
    parts.append('<h3>Health</h3><p class="src">From train/health.jsonl (our check of each step\'s '
                 f'rollouts), against step.</p><div class="plots">{"".join(plots)}</div>' if plots
                 else files.missing("train/health.jsonl", "No training health log yet", "rows yet"))
    parts.append(_validation_part(files))
    warnings = "".join(f"<li>step {_e(row.get('step'))}: {_e(w)}</li>" for row in health
                       for w in row.get("warnings") or [])
    if warnings:
        parts.append(f'<details class="warnings"><summary>{warnings.count("<li>")} health warnings '
                     f"(train/health.jsonl)</summary><ul>{warnings}</ul></details>")
    return "".join(parts)


def _validation_part(files: _RunFiles) -> str:
    """Held-out subset metrics during training: the mean per validation step, and its 95% interval as lo/hi."""
    rows = files.jsonl("train/validation.jsonl")
    plots = []
    for key, label in VALIDATION_KEYS:
        flat = [{"step": r.get("step"), "mean": m.get("mean"), "lo": (m.get("ci95") or [None, None])[0],
                 "hi": (m.get("ci95") or [None, None])[1]} for r in rows if isinstance(m := r.get(key), dict)]
        series = {name: _series(flat, name) for name in ("mean", "lo", "hi")}
        if series["mean"][0]:
            plots.append(_figure(label, key, {f"{key} {n}": xy for n, xy in series.items() if xy[0]}))
    if not plots:
        return ""  # validation during training is optional (train.eval_every_steps)
    return ('<h3>Validation during training</h3><p class="src">From train/validation.jsonl: a fixed held-out '
            f'subset, greedy, with 95% bootstrap intervals (lo, hi), against step.</p><div class="plots">{"".join(plots)}</div>')


def _category_section(files: _RunFiles) -> str:
    categories = (files.json_object("comparison.json") or {}).get("by_category")
    if not isinstance(categories, dict) or not categories:
        return files.missing("comparison.json", "No per-category comparison yet", '"by_category"')
    rows = []
    for name, c in sorted(categories.items()):
        ab, aa = c.get("accuracy_before"), c.get("accuracy_after")
        fb, fa = c.get("format_before"), c.get("format_after")
        rows.append(f'<tr data-category="{_e(name)}"><th>{_e(name)}</th>{_num_td(c.get("n"), "d")}'
                    f"{_num_td(ab)}{_num_td(aa)}{_delta_td(ab, aa)}"
                    f"{_num_td(fb)}{_num_td(fa)}{_delta_td(fb, fa)}</tr>")
    head = ["category", "n", "accuracy before", "accuracy after", "delta", "format before", "format after",
            "delta"]
    return ('<p class="src">From comparison.json "by_category"; delta = after − before.</p>'
            + _table(head, rows))


def _flips_section(files: _RunFiles) -> str:
    comparison = files.json_object("comparison.json") or {}
    if not isinstance(comparison.get("flip_counts"), dict):
        return files.missing("comparison.json", "No flips yet", '"flip_counts"')
    flips = comparison.get("flips") or {}
    rows = [f'<tr data-flip="{_e(kind)}"><th>{_e(kind.replace("_", " "))}</th>{_num_td(count, "d")}'
            f'<td class="ids">{" ".join(_id_link(i) for i in flips.get(kind) or [])}</td></tr>'
            for kind, count in comparison["flip_counts"].items()]
    parts = ['<p class="src">From comparison.json "flip_counts" and "flips"; click an id to see the item.</p>'
             + _table(["flip", "count", "ids"], rows)]
    regressions = [r for r in comparison.get("largest_regressions") or [] if isinstance(r, dict)]
    if regressions:
        rows = [f'<tr><td>{_id_link(r.get("id"))}</td>{_num_td(r.get("before"))}{_num_td(r.get("after"))}'
                f'{_num_td(r.get("delta"), signed=True)}</tr>' for r in regressions]
        parts.append('<h3>Largest regressions in total reward</h3><p class="src">From comparison.json '
                     f'"largest_regressions".</p>{_table(["id", "before", "after", "delta"], rows)}')
    return "".join(parts)


def _export_section(files: _RunFiles) -> str:
    export = files.json_object("export.json")
    if not export:
        return files.missing("export.json", "No export yet")
    verdicts = {True: ("pass", "passed"), False: ("fail", "FAILED"), None: ("skip", "skipped")}
    rows = []
    for check in (c for c in export.get("checks") or [] if isinstance(c, dict)):
        cls, word = verdicts.get(check.get("passed"), ("skip", "?"))
        rows.append(f'<tr><th>{_e(check.get("name"))}</th><td><span class="badge {cls}">{word}</span></td>'
                    f'<td>{_e(_short(check.get("value")))}</td><td>{_e(check.get("detail"))}</td></tr>')
    overall = "all checks passed" if export.get("all_passed") else "NOT all checks passed"
    where = {k: export.get(k) for k in ("adapter_dir", "source", "base_model")}
    return (f'<p class="src">From export.json: <strong>{overall}</strong>.</p>{_kv_table(where)}'
            + _table(["check", "result", "value", "detail"], rows))


def _data_section(files: _RunFiles) -> str:
    summary = files.json_object("data/summary.json")
    if not summary:
        return files.missing("data/summary.json", "No data summary yet")
    message = f'<p>{_e(summary["message"])}</p>' if summary.get("message") else ""
    rest = {k: v for k, v in summary.items() if k != "message"}
    return f'<p class="src">From data/summary.json.</p>{message}{_kv_table(rest)}'


def _setup_section(files: _RunFiles) -> str:
    config, env = files.text("config.yaml"), files.json_object("env.json")
    parts = ['<h3>Config</h3><p class="src">From config.yaml (the fully resolved configuration).</p>'
             f'<pre class="config">{_e(config)}</pre>' if config is not None
             else files.missing("config.yaml", "No config recorded")]
    if env:
        packages = env.get("packages") if isinstance(env.get("packages"), dict) else {}
        rest = {k: v for k, v in env.items() if k != "packages"}
        parts.append(f'<h3>Environment</h3><p class="src">From env.json.</p>{_kv_table(rest)}'
                     f"<details><summary>{len(packages)} packages</summary>{_kv_table(packages)}</details>")
    else:
        parts.append(files.missing("env.json", "No environment recorded"))
    return "".join(parts)


# ---- the per-sample viewer ------------------------------------------------------------------------------

def _samples_section(files: _RunFiles) -> str:
    holdout = {r.get("id"): r for r in files.jsonl("data/holdout.jsonl")}
    before = {r.get("id"): r for r in files.jsonl("baseline_records.jsonl")}
    after = {r.get("id"): r for r in files.jsonl("after_records.jsonl")}
    ids = list(dict.fromkeys([*holdout, *before, *after]))
    if not ids:
        return files.missing("data/holdout.jsonl", "No held-out items yet")
    notes = [files.missing(name, what) for name, what, rows in (
        ("data/holdout.jsonl", "No images or questions from the data", holdout),
        ("baseline_records.jsonl", "No baseline completions yet", before),
        ("after_records.jsonl", "No completions after training yet", after)) if not rows]
    states = {i: _sample_state(before.get(i), after.get(i)) for i in ids}
    cards = "".join(_sample_card(i, states[i], holdout.get(i), before.get(i), after.get(i), files.run_dir)
                    for i in ids)
    counts = {s: sum(state[0] == s for state in states.values())
              for s in ("improved", "regressed", "unchanged")}
    counts.update({"all": len(ids), "format-broken": sum(state[1] for state in states.values())})
    buttons = "".join(
        f'<button type="button" data-filter="{key}" aria-pressed="{str(key == "all").lower()}">'
        f"{key.replace('-', ' ')} <span>{counts[key]}</span></button>"
        for key in ("all", "improved", "regressed", "unchanged", "format-broken"))
    return ('<p class="src">From data/holdout.jsonl (image, question, gold), baseline_records.jsonl and '
            "after_records.jsonl (completion, extracted answer, rewards). Improved / regressed / unchanged: "
            "the item's total reward after vs before; format broken: its latest completion fails the "
            "format.</p>"
            f'{"".join(notes)}<div class="toolbar">{buttons}<input id="sample-search" type="search" '
            'placeholder="search by id" aria-label="search by id"><span id="sample-count"></span></div>'
            f'<div id="sample-list">{cards}</div>')


def _sample_state(before: dict | None, after: dict | None) -> tuple[str, bool]:
    """(status from the total reward after vs before, whether the latest completion breaks the format)."""
    latest = after or before
    broken = bool(latest) and not latest.get("format_ok")
    if not (before and after and _finite(before.get("total_reward")) and _finite(after.get("total_reward"))):
        return ("baseline-only" if before and not after else "not-evaluated"), broken
    delta = after["total_reward"] - before["total_reward"]
    return ("improved" if delta > 1e-9 else "regressed" if delta < -1e-9 else "unchanged"), broken


def _sample_card(item_id: Any, state: tuple[str, bool], item: dict | None, before: dict | None,
                 after: dict | None, run_dir: Path) -> str:
    first = item or before or after or {}
    status, broken = state
    gold = item.get("answer") if item else first.get("gold")
    meta = " · ".join(_e(first.get(k)) for k in ("category", "answer_type", "source") if first.get(k))
    return (f'<article class="sample" data-id="{_e(item_id)}" data-status="{status}" '
            f'data-format-broken="{int(broken)}"><div class="thumb">{_thumbnail(item, run_dir)}</div>'
            f'<div class="item"><h3><code>{_e(item_id)}</code> <span class="badge {status}">'
            f'{status.replace("-", " ")}</span></h3><p class="meta">{meta}</p>'
            f'<p class="question">{_e(first.get("question"))}</p>'
            f'<p>gold: <strong class="gold">{_e(gold)}</strong></p></div>'
            f"{_stage_column('before', before)}{_stage_column('after', after)}</article>")


def _stage_column(label: str, record: dict | None) -> str:
    if record is None:
        return f'<div class="stage {label}"><h4>{label}</h4><p class="missing">not evaluated</p></div>'
    ok, correct = bool(record.get("format_ok")), bool(record.get("correct"))
    flags = [("format ok" if ok else "format broken", ok), ("correct" if correct else "wrong", correct),
             (f'MathVista {"correct" if record.get("mathvista_correct") else "wrong"}', None)]
    flags += [("truncated", False)] if record.get("truncated") else []
    badges = "".join(f'<span class="badge {"info" if good is None else "pass" if good else "fail"}">{text}'
                     "</span>" for text, good in flags)
    pred = record.get("pred")
    pred = (f'<strong class="pred">{_e(pred)}</strong>' if pred is not None
            else '<em class="none">none extracted</em>')
    each = record.get("rewards") if isinstance(record.get("rewards"), dict) else {
        name: record.get(f"{name}_reward") for name in ("format", "correctness")}
    rewards = " · ".join(f"{_e(name)} {_num(value)}" for name, value in
                         [*each.items(), ("total", record.get("total_reward"))])
    return (f'<div class="stage {label}"><h4>{label} {badges}</h4><pre class="completion">'
            f'{_e(record.get("completion"))}</pre><p>pred: {pred}</p><p class="rewards">reward: {rewards} · '
            f'{_e(record.get("generated_tokens"))} tokens</p></div>')


def _thumbnail(item: dict | None, run_dir: Path) -> str:
    """Every image of the item, in order, as small inline PNGs."""
    from vlmrl.data.items import record_images

    paths = record_images(item) if item else []
    if not paths:
        return '<span class="missing">no image</span>'
    return "".join(_one_thumbnail(path, run_dir) for path in paths)


def _one_thumbnail(path: str, run_dir: Path) -> str:
    from PIL import Image

    try:
        with Image.open(run_dir / path) as image:
            thumb = image.convert("RGB")
            thumb.thumbnail((THUMB_PX, THUMB_PX))
        buffer = io.BytesIO()
        thumb.save(buffer, format="PNG", optimize=True)
    except (OSError, ValueError):
        return f'<span class="missing">image not found: {_e(path)}</span>'
    data = base64.b64encode(buffer.getvalue()).decode()
    return f'<img src="data:image/png;base64,{data}" alt="{_e(path)}" width="{thumb.width}">'


# ---- small pieces --------------------------------------------------------------------------------------

def _figure(label: str, key: str, series: dict[str, tuple[list, list]]) -> str:
    import matplotlib
    from matplotlib.figure import Figure

    # A bare Figure (no pyplot) keeps no global state; a fixed hash salt makes the SVG the same on every run.
    style = {"svg.fonttype": "none", "svg.hashsalt": "vlmrl", "font.size": 8, "text.parse_math": False,
             "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3}
    with matplotlib.rc_context(style):
        fig = Figure(figsize=(3.3, 2.0))
        ax = fig.add_subplot()
        for name, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o" if len(xs) <= 30 else None, markersize=2.5, linewidth=1.3,
                    label=name.removeprefix(key.removesuffix("*")))
        ax.set_xlabel("step")
        ax.ticklabel_format(axis="y", useOffset=False, style="plain" if key != "learning_rate" else "sci")
        if len(series) > 1:  # below the axes, where it cannot hide a line
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=2, frameon=False)
        buffer = io.StringIO()
        fig.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    svg = buffer.getvalue()
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg[svg.index("<svg"):], flags=re.DOTALL)
    caption = f"<figcaption>{_e(label)} <code>{_e(key)}</code></figcaption>"
    return f'<figure data-key="{_e(key)}">{caption}{svg}</figure>'


def _more_rewards(metrics: dict) -> list[tuple[str, str]]:
    """(key, label) of the metrics that are neither headline nor known: the user's own rewards."""
    known = {key for key, _ in HEADLINE} | {"exact_match"}
    return [(key, f"Mean {key}") for key in metrics if key not in known]


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    points = [(r["step"], r[key]) for r in rows if _finite(r.get("step")) and _finite(r.get(key))]
    return [x for x, _ in points], [y for _, y in points]


def _table(head: list[str], rows: list[str], cls: str = "") -> str:
    header = "".join(f"<th>{h}</th>" for h in head)
    return f'<table class="{cls}"><thead><tr>{header}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def _kv_table(data: dict, depth: int = 0) -> str:
    """A dict of any shape as a compact key/value table; nested dicts nest twice, then show as JSON."""
    rows = "".join(
        f"<tr><th>{_e(k)}</th><td>"
        f"{_kv_table(v, depth + 1) if isinstance(v, dict) and v and depth < 2 else _e(_short(v))}</td></tr>"
        for k, v in data.items())
    return f'<table class="kv">{rows}</table>'


def _short(value: Any) -> str:
    if value is None or isinstance(value, str):
        return value or ""
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 400 else text[:400] + " …"


def _id_link(item_id: Any) -> str:
    return f'<a href="#samples" data-goto="{_e(item_id)}"><code>{_e(item_id)}</code></a>'


def _interval(ci: Any) -> str:
    return f"[{_num(ci[0])}, {_num(ci[1])}]" if isinstance(ci, list) and len(ci) == 2 else "–"


def _num(value: Any, fmt: str = ".3f", signed: bool = False) -> str:
    if not _finite(value):
        return "–" if value is None else _e(value)
    if fmt == "d" or isinstance(value, int) and fmt == ".3f":
        return format(round(value), "+d" if signed else "d")
    return format(value, ("+" if signed else "") + fmt)


def _num_td(value: Any, fmt: str = ".3f", signed: bool = False) -> str:
    """A number cell; `data-value` keeps the exact file value, so every shown number can be checked."""
    direction = "" if not (signed and _finite(value) and value) else " up" if value > 0 else " down"
    raw = f' data-value="{_e(json.dumps(value))}"' if _finite(value) else ""
    return f'<td class="num{direction}"{raw}>{_num(value, fmt, signed)}</td>'


def _delta_td(before: Any, after: Any) -> str:
    return _num_td(after - before, signed=True) if _finite(before) and _finite(after) else "<td></td>"


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


_CSS = """
:root{--fg:#1f2328;--muted:#656d76;--line:#d0d7de;--bg:#f6f8fa;--accent:#0969da;--up:#1a7f37;--down:#cf222e}
*{box-sizing:border-box}body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;
color:var(--fg)}header{background:var(--bg);border-bottom:1px solid var(--line);padding:16px 32px}
h1{margin:0 0 8px;font-size:22px}h1 span{color:var(--muted);font-weight:400}
nav a{margin-right:14px;color:var(--accent);text-decoration:none}nav a:hover{text-decoration:underline}
main{max-width:1280px;margin:0 auto;padding:0 32px 48px}section{margin-top:28px}
h2{font-size:18px;border-bottom:1px solid var(--line);padding-bottom:4px}h3{font-size:15px;margin:18px 0 6px}
.src{color:var(--muted);font-size:12.5px;margin:4px 0 10px}
.missing{color:#7d4e00;background:#fff8c5;padding:6px 10px;border-radius:6px;display:inline-block;
margin:4px 8px 4px 0}
table{border-collapse:collapse;margin:6px 0 12px}th,td{border-bottom:1px solid var(--line);padding:4px 10px;
text-align:left;vertical-align:top}thead th{background:var(--bg);font-weight:600}
td.num{text-align:right;font-variant-numeric:tabular-nums}td.up{color:var(--up)}td.down{color:var(--down)}
table.kv th{font-weight:500;color:var(--muted)}table.kv table.kv{margin:0}td.ids{max-width:760px}
.inventory{font-size:12.5px;margin-top:8px}.inventory ul{columns:3;margin:6px 0}
.inventory li.absent{color:var(--muted);text-decoration:line-through}
.inventory li.unreadable{color:var(--down)}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(270px,1fr));gap:12px}
figure{margin:0;border:1px solid var(--line);border-radius:6px;padding:6px}
figcaption{font-size:12.5px;font-weight:600}figcaption code{font-weight:400;color:var(--muted);font-size:11px}
figure svg{width:100%;height:auto}
pre{white-space:pre-wrap;word-break:break-word;background:var(--bg);border:1px solid var(--line);
border-radius:6px;padding:8px;font-size:12px;margin:4px 0}pre.config{max-height:420px;overflow:auto}
.badge{display:inline-block;font-size:11px;font-weight:500;border-radius:10px;padding:0 7px;margin-left:4px;
background:#eaeef2;color:var(--muted)}.badge.pass,.badge.improved{background:#dafbe1;color:var(--up)}
.badge.fail,.badge.regressed{background:#ffebe9;color:var(--down)}
.badge.info{background:#ddf4ff;color:var(--accent)}
.toolbar{display:flex;flex-wrap:wrap;gap:8px;align-items:center;position:sticky;top:0;background:#fff;
padding:8px 0;z-index:1}.toolbar button{border:1px solid var(--line);background:#fff;border-radius:6px;
padding:4px 10px;cursor:pointer;font:inherit}.toolbar button span{opacity:.75}
.toolbar button[aria-pressed=true]{background:var(--accent);color:#fff;border-color:var(--accent)}
.toolbar input{border:1px solid var(--line);border-radius:6px;padding:4px 8px;font:inherit}
#sample-count{color:var(--muted);font-size:12.5px}
.sample{display:grid;grid-template-columns:104px minmax(180px,1fr) minmax(0,1.5fr) minmax(0,1.5fr);gap:12px;
border:1px solid var(--line);border-radius:8px;padding:10px;margin:8px 0}.sample[hidden]{display:none}
.sample.chosen{outline:2px solid var(--accent)}.sample h3{margin:0;font-size:13px}
.sample h4{margin:0;font-size:12.5px}
.sample p{margin:4px 0}.meta,.rewards{color:var(--muted);font-size:12px}em.none{color:var(--muted)}
.thumb img{border:1px solid var(--line);border-radius:4px}.completion{max-height:220px;overflow:auto}
@media (max-width:900px){.sample{grid-template-columns:104px 1fr}.stage{grid-column:1/-1}}
"""

# Filtering only toggles `hidden` and reads data attributes: no model text ever passes through innerHTML.
_SCRIPT = """
(function () {
  var cards = Array.prototype.slice.call(document.querySelectorAll('.sample'));
  var buttons = Array.prototype.slice.call(document.querySelectorAll('[data-filter]'));
  var search = document.getElementById('sample-search');
  var count = document.getElementById('sample-count');
  var filter = 'all';
  function keep(card) {
    var q = search ? search.value.trim().toLowerCase() : '';
    if (q && card.dataset.id.toLowerCase().indexOf(q) < 0) return false;
    if (filter === 'all') return true;
    if (filter === 'format-broken') return card.dataset.formatBroken === '1';
    return card.dataset.status === filter;
  }
  function apply() {
    var shown = 0;
    cards.forEach(function (card) { card.hidden = !keep(card); if (!card.hidden) shown++; });
    if (count) count.textContent = shown + ' of ' + cards.length + ' shown';
  }
  function choose(name) {
    filter = name;
    buttons.forEach(function (b) { b.setAttribute('aria-pressed', String(b.dataset.filter === name)); });
    apply();
  }
  buttons.forEach(function (b) { b.addEventListener('click', function () { choose(b.dataset.filter); }); });
  if (search) search.addEventListener('input', apply);
  document.querySelectorAll('[data-goto]').forEach(function (link) {
    link.addEventListener('click', function (event) {
      var card = cards.filter(function (c) { return c.dataset.id === link.dataset.goto; })[0];
      if (!card) return;
      event.preventDefault();
      if (search) search.value = '';
      choose('all');
      cards.forEach(function (c) { c.classList.toggle('chosen', c === card); });
      card.scrollIntoView({block: 'center'});
    });
  });
  apply();
})();
"""
