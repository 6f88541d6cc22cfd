"""The report's sections: before/after tables, training and validation curves, categories, flips, export,
data and setup; each shows values from one named run-folder file, or says which file is missing.

Left out: the per-sample viewer (`samples`), the visual control (`visual`), and
the page around them (`page`).
"""

from __future__ import annotations

from vlmrl.common.stats import finite
from vlmrl.report.cells import delta_td, esc, id_link, interval, kv_table, num_td, short, table
from vlmrl.report.files import RunFiles
from vlmrl.report.plots import figure, step_series, xy_series
from vlmrl.run import layout

HEADLINE = [  # comparison.json metric -> label; the first three are paired binary metrics (with McNemar)
    ("accuracy", "Accuracy (ours)"), ("mathvista_accuracy", "Accuracy (MathVista grading)"),
    ("format_compliance", "Format compliance"), ("total_reward", "Mean total reward"),
    ("format_reward", "Mean format reward"), ("correctness_reward", "Mean correctness reward"),
]
EVAL_EXTRAS = [  # *_summary.json key -> number format
    ("n", "d"), ("truncation_rate", ".3f"), ("gibberish_rate", ".3f"), ("mean_generated_tokens", ".1f"),
    ("tokens_per_second", ".1f"), ("items_per_second", ".2f"),
]
TRAIN_KEYS = [  # TRL log key -> label, in plotting order; a key ending in * is a prefix whose keys share one plot
    ("reward", "total reward"), ("rewards/format_reward/mean", "format reward (mean)"),
    ("rewards/correctness_reward/mean", "correctness reward (mean)"),
    ("completions/mean_length", "completion length"), ("completions/clipped_ratio", "truncated completions"),
    ("clip_ratio/*", "clip ratio"), ("kl", "KL"), ("frac_reward_zero_std", "zero-variance groups (fraction)"),
    # the rollout engine against the loss pass (vlmrl.engine.rollout.mismatch, docs/rollouts.md)
    ("mismatch/logp_diff_*", "rollout vs loss pass: |Δ log p| per token"),
    ("mismatch/sequence_kl", "rollout vs loss pass: KL per completion (k3)"),
    ("mismatch/ratio_outside_cap", "rollout vs loss pass: tokens outside the TIS cap (fraction)"),
    # train.dynamic_sampling (vlmrl.train.dynamic_sampling, docs/rewards.md): groups per generation batch, all ranks
    ("dynamic_sampling/groups_*", "dynamic sampling: groups per batch"),
    ("dynamic_sampling/rounds", "dynamic sampling: extra rounds"),
    ("dynamic_sampling/cap_hit", "dynamic sampling: cap hit (batch filled with zero-advantage groups)"),
    ("learning_rate", "learning rate"), ("loss", "loss"), ("grad_norm", "grad norm"),
]
VALIDATION_KEYS = [("accuracy", "validation accuracy"), ("format_compliance", "validation format compliance"),
                   ("total_reward", "validation total reward")]
# metrics.jsonl's clocks (vlmrl.train.callbacks): key, axis label, scale
TIME_AXES = [("elapsed_s", "wall-clock minutes", 1 / 60), ("rollout_tokens", "rollout tokens generated", 1.0)]
HEALTH_KEYS = [("format_rate", "format rate"), ("gibberish_rate", "gibberish rate"),
               ("truncation_rate", "truncation rate"), ("zero_variance_groups", "zero-variance groups")]


def headline_section(files: RunFiles) -> str:
    comparison = files.json_object(layout.COMPARISON)
    parts = []
    if comparison and isinstance(comparison.get("metrics"), dict):
        rows = []
        for key, label in HEADLINE + _more_rewards(comparison["metrics"]):
            m = comparison["metrics"].get(key)
            if isinstance(m, dict):
                flips = f"+{esc(m['gained'])} / −{esc(m.get('lost'))}" if "gained" in m else ""
                p = num_td(m["mcnemar_p"], ".3g") if "mcnemar_p" in m else "<td></td>"
                if not finite(m.get("delta")):  # a reward that gave no value on one side: no delta either
                    rows.append(f'<tr data-metric="{key}"><th>{label}</th>{_value_td(m.get("before"))}'
                                f'{_value_td(m.get("after"))}<td></td><td></td><td></td><td></td></tr>')
                    continue
                rows.append(f'<tr data-metric="{key}"><th>{label}</th>{num_td(m.get("before"))}'
                            f'{num_td(m.get("after"))}{num_td(m.get("delta"), signed=True)}'
                            f'<td>{interval(m.get("delta_ci95"))}</td>{p}<td>{flips}</td></tr>')
        unpaired = comparison.get("ids_missing_a_pair") or []
        parts.append(
            f'<p class="src">From comparison.json: {esc(comparison.get("n_paired"))} paired held-out items'
            f'{f", {len(unpaired)} without a pair" if unpaired else ""}. Delta = after − before; interval: '
            "paired bootstrap 95%; p: exact McNemar test on the discordant pairs; flips: items gained / "
            "lost.</p>"
            + table(["metric", "before", "after", "delta", "delta 95% CI", "McNemar p", "flips"], rows,
                     "headline"))
    else:
        parts.append(files.missing(layout.COMPARISON, "No before/after comparison yet", '"metrics"'))
    summaries = {s: files.json_object(f"{s}_summary.json") for s in ("baseline", "after")}
    summaries = {stage: summary for stage, summary in summaries.items() if summary}
    if summaries:
        parts.append(_eval_summary_table(summaries))
    if "baseline" not in summaries:
        parts.append(files.missing(layout.summary_file("baseline"), "No evaluation yet"))
    if "after" not in summaries:
        parts.append(files.missing(layout.summary_file("after"), "No evaluation after training yet"))
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
            if stat and not finite(stat.get("mean")):  # scored, but every item's value was None
                cells += f"{_value_td(None)}<td></td>"
                continue
            cells += f'{num_td(stat.get("mean"))}<td>{interval(stat.get("ci95"))}</td>'
        rows.append(f'<tr data-metric="{key}"><th>{label}</th>{cells}</tr>')
    for key, fmt in EVAL_EXTRAS:
        cells = "".join(f"{num_td(summary.get(key), fmt)}<td></td>" for summary in summaries.values())
        rows.append(f'<tr data-metric="{key}"><th>{key.replace("_", " ")}</th>{cells}</tr>')
    head = ["metric"] + [h for stage in summaries for h in (f"{stage} (mean)", f"{stage} 95% CI")]
    source = " and ".join(f"{stage}_summary.json" for stage in summaries)
    return (f'<h3>Evaluation summaries</h3><p class="src">From {source}: each stage alone, means with '
            f"bootstrap intervals.</p>{table(head, rows, 'summary')}")


def _value_td(value: object) -> str:
    """A before/after cell: the number, or "no values" where a reward returned None for every item (its mean
    is null in the file; "–" would read as a missing file)."""
    return num_td(value) if finite(value) else '<td class="num">no values</td>'


def training_section(files: RunFiles) -> str:
    metrics, health = files.jsonl(layout.METRICS), files.jsonl("train/health.jsonl")
    summary = files.json_object("train/summary.json")
    parts = [f'<p class="src">From train/summary.json.</p>{kv_table(summary)}' if summary
             else files.missing("train/summary.json", "No training summary yet")]
    plots = []
    known = {key for key, _ in TRAIN_KEYS}
    user = sorted({k for row in metrics for k in row if k.startswith("rewards/") and k.endswith("/mean")} - known)
    for key, label in TRAIN_KEYS[:3] + [(k, f"{k[8:-5]} (mean)") for k in user] + TRAIN_KEYS[3:]:
        keys = ([key] if not key.endswith("*")
                else sorted({k for row in metrics for k in row if k.startswith(key[:-1])}))
        series = {k: step_series(metrics, k) for k in keys}
        series = {k: xy for k, xy in series.items() if xy[0]}
        if series:
            plots.append(figure(label, key, series))
    parts.append('<h3>Trainer log</h3><p class="src">From train/metrics.jsonl (TRL logs), against step.</p>'
                 f'<div class="plots">{"".join(plots)}</div>' if plots
                 else files.missing(layout.METRICS, "No training metrics yet", "plottable metric yet"))
    plots = [figure(label, key, {key: step_series(health, key)})
             for key, label in HEALTH_KEYS if step_series(health, key)[0]]
    parts.append('<h3>Health</h3><p class="src">From train/health.jsonl (our check of each step\'s '
                 f'rollouts), against step.</p><div class="plots">{"".join(plots)}</div>' if plots
                 else files.missing("train/health.jsonl", "No training health log yet", "rows yet"))
    parts.append(_validation_part(files))
    parts.append(_time_part(files, metrics))
    warnings = "".join(f"<li>step {esc(row.get('step'))}: {esc(w)}</li>" for row in health
                       for w in row.get("warnings") or [])
    if warnings:
        parts.append(f'<details class="warnings"><summary>{warnings.count("<li>")} health warnings '
                     f"(train/health.jsonl)</summary><ul>{warnings}</ul></details>")
    return "".join(parts)


def _validation_part(files: RunFiles) -> str:
    """Held-out subset metrics during training: the mean per validation step, and its 95% interval as lo/hi."""
    rows = files.jsonl("train/validation.jsonl")
    plots = []
    for key, label in VALIDATION_KEYS + _validation_rewards(rows):
        flat = [{"step": r.get("step"), "mean": m.get("mean"), "lo": (m.get("ci95") or [None, None])[0],
                 "hi": (m.get("ci95") or [None, None])[1]} for r in rows if isinstance(m := _stat(r, key), dict)]
        series = {name: step_series(flat, name) for name in ("mean", "lo", "hi")}
        if series["mean"][0]:
            plots.append(figure(label, key, {f"{key} {n}": xy for n, xy in series.items() if xy[0]}))
    if not plots:
        return ""  # validation during training is optional (train.eval_every_steps)
    return ('<h3>Validation during training</h3><p class="src">From train/validation.jsonl: a fixed held-out '
            f'subset, greedy, with 95% bootstrap intervals (lo, hi), against step.</p><div class="plots">{"".join(plots)}</div>')


def _time_part(files: RunFiles, metrics: list[dict]) -> str:
    """Train reward and validation accuracy / total reward against wall-clock minutes and against rollout tokens
    generated (cumulative): the axes on which two settings that cost differently per step compare fairly. A
    validation row takes the clocks of its step's metrics row."""
    at_step = {r.get("step"): r for r in metrics if "train_runtime" not in r}
    validation = [{**{x: at_step.get(r.get("step"), {}).get(x) for x, _, _ in TIME_AXES},
                   **{key: stat.get("mean") for key in ("accuracy", "total_reward")
                      if isinstance(stat := r.get(key), dict)}}
                  for r in files.jsonl(layout.VALIDATION)]
    curves = [(metrics, "reward", "train total reward"), (validation, "accuracy", "validation accuracy"),
              (validation, "total_reward", "validation total reward")]
    plots = []
    for x, axis, scale in TIME_AXES:
        for rows, y, label in curves:
            xy = xy_series(rows, x, y, scale)
            if xy[0]:
                plots.append(figure(f"{label} against {axis}", f"{y}@{x}", {y: xy}, xlabel=axis))
    if not plots:
        return ""  # a run from before the clocks were recorded
    return ('<h3>Learning against time</h3><p class="src">From train/metrics.jsonl (<code>elapsed_s</code>: '
            "wall-clock seconds of training, resumed sessions added; <code>rollout_tokens</code>: completion tokens "
            "generated, every rollout of every process) and train/validation.jsonl (the means, at their step's "
            f'clocks).</p><div class="plots">{"".join(plots)}</div>')


def _validation_rewards(rows: list[dict]) -> list[tuple[str, str]]:
    """(key, label) of the user's own rewards in validation rows (their `rewards`; the built-ins are summed
    into the headline curves already)."""
    names = dict.fromkeys(n for r in rows if isinstance(r.get("rewards"), dict) for n in r["rewards"])
    return [(f"rewards/{n}", f"validation {n}") for n in names if n not in ("format_reward", "correctness_reward")]


def _stat(row: dict, key: str) -> object:
    """A validation row's {mean, ci95} for a metric, or for a reward under `rewards/<name>`."""
    if key.startswith("rewards/"):
        return (row.get("rewards") or {}).get(key.removeprefix("rewards/"))
    return row.get(key)


def category_section(files: RunFiles) -> str:
    categories = (files.json_object(layout.COMPARISON) or {}).get("by_category")
    if not isinstance(categories, dict) or not categories:
        return files.missing(layout.COMPARISON, "No per-category comparison yet", '"by_category"')
    rows = []
    for name, c in sorted(categories.items()):
        ab, aa = c.get("accuracy_before"), c.get("accuracy_after")
        fb, fa = c.get("format_before"), c.get("format_after")
        rows.append(f'<tr data-category="{esc(name)}"><th>{esc(name)}</th>{num_td(c.get("n"), "d")}'
                    f"{num_td(ab)}{num_td(aa)}{delta_td(ab, aa)}"
                    f"{num_td(fb)}{num_td(fa)}{delta_td(fb, fa)}</tr>")
    head = ["category", "n", "accuracy before", "accuracy after", "delta", "format before", "format after",
            "delta"]
    return ('<p class="src">From comparison.json "by_category"; delta = after − before.</p>'
            + table(head, rows))


def flips_section(files: RunFiles) -> str:
    comparison = files.json_object(layout.COMPARISON) or {}
    if not isinstance(comparison.get("flip_counts"), dict):
        return files.missing(layout.COMPARISON, "No flips yet", '"flip_counts"')
    flips = comparison.get("flips") or {}
    rows = [f'<tr data-flip="{esc(kind)}"><th>{esc(kind.replace("_", " "))}</th>{num_td(count, "d")}'
            f'<td class="ids">{" ".join(id_link(i) for i in flips.get(kind) or [])}</td></tr>'
            for kind, count in comparison["flip_counts"].items()]
    parts = ['<p class="src">From comparison.json "flip_counts" and "flips"; click an id to see the item.</p>'
             + table(["flip", "count", "ids"], rows)]
    regressions = [r for r in comparison.get("largest_regressions") or [] if isinstance(r, dict)]
    if regressions:
        rows = [f'<tr><td>{id_link(r.get("id"))}</td>{num_td(r.get("before"))}{num_td(r.get("after"))}'
                f'{num_td(r.get("delta"), signed=True)}</tr>' for r in regressions]
        parts.append('<h3>Largest regressions in total reward</h3><p class="src">From comparison.json '
                     f'"largest_regressions".</p>{table(["id", "before", "after", "delta"], rows)}')
    return "".join(parts)


def export_section(files: RunFiles) -> str:
    export = files.json_object(layout.EXPORT)
    if not export:
        return files.missing(layout.EXPORT, "No export yet")
    verdicts = {True: ("pass", "passed"), False: ("fail", "FAILED"), None: ("skip", "skipped")}
    rows = []
    for check in (c for c in export.get("checks") or [] if isinstance(c, dict)):
        cls, word = verdicts.get(check.get("passed"), ("skip", "?"))
        rows.append(f'<tr><th>{esc(check.get("name"))}</th><td><span class="badge {cls}">{word}</span></td>'
                    f'<td>{esc(short(check.get("value")))}</td><td>{esc(check.get("detail"))}</td></tr>')
    overall = "all checks passed" if export.get("all_passed") else "NOT all checks passed"
    where = {k: export.get(k) for k in ("adapter_dir", "source", "base_model")}
    return (f'<p class="src">From export.json: <strong>{overall}</strong>.</p>{kv_table(where)}'
            + table(["check", "result", "value", "detail"], rows))


def data_section(files: RunFiles) -> str:
    summary = files.json_object(layout.DATA_SUMMARY)
    if not summary:
        return files.missing(layout.DATA_SUMMARY, "No data summary yet")
    message = f'<p>{esc(summary["message"])}</p>' if summary.get("message") else ""
    rest = {k: v for k, v in summary.items() if k != "message"}
    return f'<p class="src">From data/summary.json.</p>{message}{kv_table(rest)}'


def setup_section(files: RunFiles) -> str:
    config, env = files.text(layout.CONFIG), files.json_object(layout.ENV)
    parts = ['<h3>Config</h3><p class="src">From config.yaml (the fully resolved configuration).</p>'
             f'<pre class="config">{esc(config)}</pre>' if config is not None
             else files.missing(layout.CONFIG, "No config recorded")]
    if env:
        packages = env.get("packages") if isinstance(env.get("packages"), dict) else {}
        rest = {k: v for k, v in env.items() if k != "packages"}
        parts.append(f'<h3>Environment</h3><p class="src">From env.json.</p>{kv_table(rest)}'
                     f"<details><summary>{len(packages)} packages</summary>{kv_table(packages)}</details>")
    else:
        parts.append(files.missing(layout.ENV, "No environment recorded"))
    return "".join(parts)



def _more_rewards(metrics: dict) -> list[tuple[str, str]]:
    """(key, label) of the metrics that are neither headline nor known: the user's own rewards."""
    known = {key for key, _ in HEADLINE} | {"exact_match"}
    return [(key, f"Mean {key}") for key in metrics if key not in known]

