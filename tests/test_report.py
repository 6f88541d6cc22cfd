"""report.html builder: sections present, headline numbers equal comparison.json, model text escaped,
partial runs say what is missing, the page stays small and needs no network."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest

from tests.helpers import IMG_ATTACK, SCRIPT_ATTACK, make_run, write_json, write_jsonl
from vlmrl.report import build_report, write_report


def _row(page: str, pattern: str) -> str:
    return re.search(pattern, page, re.DOTALL).group(1)


def _values(row_html: str) -> list[float]:
    """The data-value attributes (the exact file values) of a table row, in column order."""
    return [float(v) for v in re.findall(r'data-value="([^"]*)"', row_html)]


def _section(page: str, name: str) -> str:
    return _row(page, rf'(<section id="{name}">.*?</section>)')


# ---- tests -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> tuple[Path, str]:
    run = make_run(tmp_path_factory.mktemp("full"))
    return run, write_report(run).read_text(encoding="utf-8")


def test_write_report_writes_report_html_with_every_section(full_run):
    run, page = full_run
    assert (run / "report.html").is_file()
    for name in ("headline", "training", "categories", "flips", "samples", "export", "data", "setup"):
        assert f'<section id="{name}">' in page and f'href="#{name}"' in page
    for source in ("comparison.json", "baseline_summary.json and after_summary.json", "train/summary.json",
                   "train/metrics.jsonl", "train/health.jsonl", "export.json", "data/summary.json",
                   "config.yaml", "env.json", "data/holdout.jsonl"):
        assert f"From {source}" in page  # every section names its file
    assert "missing)" not in page and 'class="absent"' not in page  # a complete run reports nothing missing


def test_headline_numbers_equal_comparison_json(full_run):
    run, page = full_run
    metrics = json.loads((run / "comparison.json").read_text())["metrics"]
    headline = _row(page, r'(<table class="headline">.*?</table>)')
    for name, m in metrics.items():
        row = _row(headline, rf'<tr data-metric="{name}">(.*?)</tr>')
        p_value = [m["mcnemar_p"]] if "mcnemar_p" in m else []
        assert _values(row) == [m["before"], m["after"], m["delta"], *p_value]
        lo, hi = m["delta_ci95"]
        assert f"<td>[{lo:.3f}, {hi:.3f}]</td>" in row
    # what a reader sees: 3 decimals, a signed delta, p to 3 significant digits, items gained / lost
    acc = metrics["accuracy"]
    row = _row(headline, r'<tr data-metric="accuracy">(.*?)</tr>')
    assert f">{acc['before']:.3f}<" in row and f">{acc['after']:.3f}<" in row
    assert f">{acc['delta']:+.3f}<" in row and ">0.0422<" in row
    assert f"+{acc['gained']} / −{acc['lost']}" in row
    assert "12 paired held-out items" in page


def test_evaluation_summaries_show_each_stage_file(full_run):
    run, page = full_run
    table = _row(page, r'(<table class="summary">.*?</table>)')
    b, a = (json.loads((run / f"{s}_summary.json").read_text()) for s in ("baseline", "after"))
    assert _values(_row(table, r'<tr data-metric="accuracy">(.*?)</tr>')) == [b["accuracy"]["mean"],
                                                                             a["accuracy"]["mean"]]
    assert _values(_row(table, r'<tr data-metric="tokens_per_second">(.*?)</tr>')) == [123.4, 123.4]
    assert ">123.4<" in table and ">7.25<" in table and ">12<" in table


def test_training_curves_plot_each_logged_key_as_inline_svg(full_run):
    _, page = full_run
    for key in ("reward", "rewards/format_reward/mean", "rewards/correctness_reward/mean",
                "completions/mean_length", "completions/clipped_ratio", "clip_ratio/*",
                "frac_reward_zero_std", "learning_rate", "loss", "grad_norm", "format_rate", "gibberish_rate",
                "truncation_rate", "zero_variance_groups"):
        assert f'<figure data-key="{key}">' in page
    assert 'data-key="kl"' not in page  # not logged, so not plotted
    assert page.count("<svg") == 14
    clip = _row(page, r'(<figure data-key="clip_ratio/\*">.*?</figure>)')
    assert ">high_mean<" in clip and ">low_mean<" in clip  # one plot, one line per logged clip_ratio/ key
    assert "step 2: format rate &lt; 0.5 &lt;b&gt;" in page  # health warnings, escaped


def test_training_plots_skip_missing_and_non_numeric_values(tmp_path):
    run = tmp_path / "run"
    write_jsonl(run / "train" / "metrics.jsonl", [
        {"step": 1, "loss": 0.5, "kl": None}, {"step": 2, "loss": float("nan"), "kl": 0.1},
        {"step": 3, "loss": "bad", "kl": 0.2}, {"epoch": 1.0, "loss": 1}])
    training = _section(build_report(run), "training")
    assert training.count("<svg") == 2 and 'data-key="loss"' in training and 'data-key="kl"' in training
    assert "No training health log yet (train/health.jsonl missing)." in training


def test_categories_flips_export_data_and_setup_show_file_values(full_run):
    run, page = full_run
    comparison = json.loads((run / "comparison.json").read_text())
    for name, c in comparison["by_category"].items():
        row = _row(page, rf'<tr data-category="{name}">(.*?)</tr>')
        assert _values(row)[:3] == [c["n"], c["accuracy_before"], c["accuracy_after"]]
    for kind, count in comparison["flip_counts"].items():
        row = _row(page, rf'<tr data-flip="{kind}">(.*?)</tr>')
        assert f'data-value="{count}">{count}</td>' in row
        assert all(f'data-goto="{i}"' in row for i in comparison["flips"][kind])
    regressions = _section(page, "flips").split("Largest regressions")[1]
    assert all(f'data-goto="{r["id"]}"' in regressions for r in comparison["largest_regressions"])
    export = _section(page, "export")
    assert "NOT all checks passed" in export and 'badge pass">passed' in export
    assert 'badge fail">FAILED' in export and 'badge skip">skipped' in export and "no llama.cpp" in export
    data = _section(page, "data")
    assert "<th>too_long</th><td>2</td>" in data and "synthetic data" in data and "<td>false</td>" in data
    setup = _section(page, "setup")
    assert "algorithm: gspo" in setup and "<th>torch</th><td>2.14.1</td>" in setup and "74.2" in setup


def test_samples_viewer_has_one_card_per_item_with_status_and_thumbnail(full_run):
    run, page = full_run
    assert page.count('<article class="sample"') == 12
    assert page.count('<img src="data:image/png;base64,') == 12
    before, after = ({r["id"]: r for r in map(json.loads, (run / f"{stage}_records.jsonl").open())}
                     for stage in ("baseline", "after"))
    for item_id in before:
        delta = after[item_id]["total_reward"] - before[item_id]["total_reward"]
        status = "improved" if delta > 0 else "regressed" if delta < 0 else "unchanged"
        broken = int(not after[item_id]["format_ok"])
        assert f'data-id="{item_id}" data-status="{status}" data-format-broken="{broken}"' in page
    for name in ("all", "improved", "regressed", "unchanged", "format-broken"):
        assert f'data-filter="{name}"' in page
    assert 'id="sample-search"' in page and "none extracted" in page  # item 1 has no extracted answer
    card = _row(page, r'(<article class="sample" data-id="item-002".*?</article>)')
    assert 'gold: <strong class="gold">3</strong>' in card
    assert "reward: format 1.000 · correctness 1.000 · total 1.300" in card


def test_thumbnails_are_downscaled(full_run):
    _, page = full_run
    assert page.count('width="96"') == 12


def test_model_and_data_text_is_escaped(full_run):
    _, page = full_run
    assert SCRIPT_ATTACK not in page and IMG_ATTACK not in page
    assert html.escape(SCRIPT_ATTACK) in page and html.escape(IMG_ATTACK) in page
    assert "(&lt;b&gt;units&lt;/b&gt;)" in page  # questions from the data, too
    assert page.count("<script") == 1  # ours only
    csp = _row(page, r'http-equiv="Content-Security-Policy" content="([^"]*)"')
    assert "default-src 'none'" in csp and "unsafe" not in csp.split("script-src")[1]


def test_page_needs_no_network(full_run):
    _, page = full_run
    assert not re.search(r'(src|href)="(https?:)?//', page)
    assert "@import" not in page and 'rel="stylesheet"' not in page


def test_report_of_100_items_stays_small(tmp_path):
    page = build_report(make_run(tmp_path, n=100))
    assert page.count('<article class="sample"') == 100
    assert len(page.encode()) < 1_000_000


def test_report_is_deterministic(tmp_path):
    run = make_run(tmp_path, n=3)
    assert build_report(run) == build_report(run)


def test_baseline_only_run_says_what_is_missing(tmp_path):
    page = build_report(make_run(tmp_path, stages=("setup", "data", "baseline")))
    for sentence in ("No before/after comparison yet (comparison.json missing).",
                     "No training metrics yet (train/metrics.jsonl missing).",
                     "No evaluation after training yet (after_summary.json missing).",
                     "No completions after training yet (after_records.jsonl missing).",
                     "No export yet (export.json missing)."):
        assert sentence in page
    assert page.count('data-status="baseline-only"') == 12 and "<svg" not in page
    summary = _row(page, r'(<table class="summary">.*?</table>)')
    assert "baseline (mean)" in summary and "after (mean)" not in summary
    assert '<li class="absent">comparison.json</li>' in page and '<li class="found">config.yaml</li>' in page


def test_data_only_run_shows_items_without_completions(tmp_path):
    page = build_report(make_run(tmp_path, n=4, stages=("data",)))
    assert "No evaluation yet (baseline_summary.json missing)." in page
    assert "No baseline completions yet (baseline_records.jsonl missing)." in page
    assert "No config recorded (config.yaml missing)." in page
    assert page.count('data-status="not-evaluated"') == 4 and page.count("not evaluated</p>") == 8


def test_empty_run_dir_still_renders(tmp_path):
    page = write_report(tmp_path).read_text()
    assert "No held-out items yet (data/holdout.jsonl missing)." in page
    assert "No data summary yet (data/summary.json missing)." in page


def test_unknown_data_summary_shape_becomes_a_key_value_table(tmp_path):
    write_json(tmp_path / "data" / "summary.json", {"new_field": [1, 2], "nested": {"a": {"b": {"c": 1}}}})
    data = _section(build_report(tmp_path), "data")
    assert "<th>new_field</th><td>[1, 2]</td>" in data and "<th>b</th><td>{&quot;c&quot;: 1}</td>" in data


def test_file_without_the_sections_part_says_so(tmp_path):
    write_json(tmp_path / "comparison.json", {"n_paired": 0})
    write_jsonl(tmp_path / "train" / "metrics.jsonl", [{"step": 1, "epoch": 0.1}])
    page = build_report(tmp_path)
    assert 'No before/after comparison yet (comparison.json has no "metrics").' in page
    assert 'No flips yet (comparison.json has no "flip_counts").' in page
    assert "No training metrics yet (train/metrics.jsonl has no plottable metric yet)." in page


def test_damaged_files_are_named_not_fatal(tmp_path):
    run = make_run(tmp_path, n=2)
    (run / "comparison.json").write_text("{not json")
    (run / "env.json").write_text("[1, 2]")  # valid JSON, wrong shape
    (run / "data" / "images" / "q0.png").unlink()
    page = build_report(run)
    assert "No flips yet (comparison.json could not be read: JSONDecodeError" in page
    assert '<li class="unreadable">comparison.json</li>' in page
    assert "No environment recorded (env.json could not be read: expected a JSON object, found list)." in page
    assert "image not found: data/images/q0.png" in page
