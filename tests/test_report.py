"""report.html builder: sections present, headline numbers equal comparison.json, model text escaped,
partial runs say what is missing, the page stays small and needs no network."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

from vlmrl.report import build_report, write_report

SCRIPT_ATTACK = "<script>window.__pwned=1</script>"
IMG_ATTACK = '<img src=x onerror="window.__pwned=1">'
ALL_STAGES = ("setup", "data", "baseline", "train", "after", "compare", "export")


# ---- a fake run directory, shaped like the stage outputs ---------------------------------------------------

def make_run(root: Path, *, n: int = 12, stages: tuple[str, ...] = ALL_STAGES) -> Path:
    """The files a run directory holds after `stages`. Item 1's after completion is an injection attempt."""
    run = root / "run"
    (run / "data" / "images").mkdir(parents=True, exist_ok=True)
    items = [_item(run, i) for i in range(n)]
    if "setup" in stages:
        (run / "config.yaml").write_text("run:\n  name: demo\n  seed: 0\ntrain:\n  algorithm: gspo\n")
        _json(run / "env.json", {"python": "3.11.2", "packages": {"torch": "2.14.1", "trl": "1.16.0"},
                                 "cuda": {"available": False, "devices": []},
                                 "backends": {"unsloth": False, "vllm": False}, "disk_free_gib": 74.2})
    if "data" in stages:
        _jsonl(run / "data" / "holdout.jsonl", items)
        _json(run / "data" / "summary.json", {
            "input_rows": n + 43, "train": 40, "holdout": n,
            "dropped_by_reason": {"too_long": 2, "bad_image": 1}, "comparable_to_published": False,
            "message": "synthetic data"})
    records = {}
    for stage in ("baseline", "after"):
        if stage in stages:
            records[stage] = [_record(item, stage) for item in items]
            _jsonl(run / f"{stage}_records.jsonl", records[stage])
            _json(run / f"{stage}_summary.json", _summary(stage, records[stage]))
    if "train" in stages:
        _jsonl(run / "train" / "metrics.jsonl", [_metrics(s) for s in range(1, 21)])
        _jsonl(run / "train" / "health.jsonl", [
            {"step": s, "n": 4, "gibberish_rate": 0.0, "format_rate": min(1, 0.1 * s), "truncation_rate": 0.1,
             "mean_length": 60 - s, "zero_variance_groups": 1, "reward_mean": 0.3, "reward_std": 0.1,
             "warnings": ["format rate < 0.5 <b>"] if s == 2 else []} for s in range(1, 21)])
        _json(run / "train" / "summary.json", {"algorithm": "gspo", "steps": 20, "optimizer": "adamw_torch",
                                               "train_seconds": 12.5, "lora": {"r": 16, "alpha": 16}})
    if "compare" in stages:
        _json(run / "comparison.json", _comparison(records["baseline"], records["after"]))
    if "export" in stages:
        _json(run / "export.json", {"adapter_dir": "adapter", "source": "train/final", "base_model": "tiny",
                                    "all_passed": False, "checks": [
            {"name": "lora_b_nonzero", "passed": True, "value": 14, "detail": ""},
            {"name": "logits_match", "passed": False, "value": 0.02, "detail": "max diff"},
            {"name": "gguf", "passed": None, "value": None, "detail": "no llama.cpp"}]})
    return run


def _item(run: Path, i: int) -> dict:
    image = Image.new("RGB", (256, 256), "white")
    ImageDraw.Draw(image).rectangle([40, 256 - 20 * (i % 10 + 1), 120, 250], fill=(60, 110, 200))
    image.save(run / "data" / "images" / f"q{i}.png")
    return {"id": f"item-{i:03d}", "question": f"How tall is bar {i}? (<b>units</b>)", "prompt": "...",
            "answer": str(i % 10 + 1), "answer_type": "integer", "precision": None, "unit": None,
            "choices": None, "source": "synthetic", "category": ["chart", "geometry"][i % 2], "metadata": {},
            "image": f"data/images/q{i}.png", "image_sha256": "ab" * 32}


def _record(item: dict, stage: str) -> dict:
    i = int(item["id"].split("-")[1])
    good = (i % 3 == 0) if stage == "baseline" else (i % 2 == 0)  # some gained, some lost, some unchanged
    formatted = stage == "after" or i % 4 != 1
    answer = item["answer"] if good else "0"
    completion = "the bar is tall"
    if formatted:
        completion = f"<REASONING>count</REASONING><SOLUTION>{answer}</SOLUTION>"
    if stage == "after" and i == 1:  # an injection attempt, and the only broken format after training
        completion, formatted = f"{SCRIPT_ATTACK} {IMG_ATTACK} <SOLUTION>0</SOLUTION>", False
    correct = good and formatted
    return {"id": item["id"], "stage": stage, "question": item["question"], "gold": item["answer"],
            "answer_type": "integer", "precision": None, "completion": completion,
            "pred": answer if formatted else None, "format_ok": formatted,
            "format_reward": 1.0 if formatted else 0.0, "correctness_reward": 1.0 if correct else 0.0,
            "total_reward": 0.3 * formatted + 1.0 * correct, "correct": correct, "exact_match": correct,
            "degenerate": False, "mathvista_normalized": None, "mathvista_correct": correct,
            "generated_tokens": 17, "truncated": False, "image_sha256": item["image_sha256"],
            "prompt_sha256": "cd" * 32, "category": item["category"], "metadata": {}, "generation": {},
            "seconds": 0.1}


def _metrics(step: int) -> dict:
    return {"step": step, "epoch": step / 20, "reward": 0.2 + 0.03 * step,
            "rewards/format_reward/mean": min(1, 0.1 * step), "rewards/correctness_reward/mean": 0.02 * step,
            "completions/mean_length": 60 - step, "completions/clipped_ratio": 0.1,
            "clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.01 * (step % 3),
            "frac_reward_zero_std": 0.5 - 0.02 * step,
            "learning_rate": 5e-6, "loss": 0.01 * (step % 4), "grad_norm": 0.3}


def _mean(rows: list[dict], field: str) -> float:
    return sum(float(r[field]) for r in rows) / len(rows)


def _summary(stage: str, records: list[dict]) -> dict:
    def stat(field):
        mean = _mean(records, field)
        return {"mean": mean, "ci95": [max(0.0, mean - 0.1), mean + 0.1]}

    return {"stage": stage, "n": len(records), "accuracy": stat("correct"),
            "mathvista_accuracy": stat("mathvista_correct"), "exact_match": stat("exact_match"),
            "format_compliance": stat("format_ok"), "format_reward": stat("format_reward"),
            "correctness_reward": stat("correctness_reward"), "total_reward": stat("total_reward"),
            "truncation_rate": 0.0, "gibberish_rate": 0.0, "mean_generated_tokens": 17.0,
            "tokens_per_second": 123.4, "items_per_second": 7.25}


def _comparison(before: list[dict], after: list[dict]) -> dict:
    pairs = list(zip(before, after, strict=True))
    metrics = {}
    for name, field in (("accuracy", "correct"), ("mathvista_accuracy", "mathvista_correct"),
                        ("format_compliance", "format_ok")):
        b, a = _mean(before, field), _mean(after, field)
        metrics[name] = {"before": b, "after": a, "delta": a - b, "delta_ci95": [a - b - 0.21, a - b + 0.19],
                         "gained": sum(not x[field] and y[field] for x, y in pairs),
                         "lost": sum(x[field] and not y[field] for x, y in pairs), "mcnemar_p": 0.0421875}
    for name in ("total_reward", "format_reward", "correctness_reward"):
        b, a = _mean(before, name), _mean(after, name)
        metrics[name] = {"before": b, "after": a, "delta": a - b, "delta_ci95": [a - b - 0.1, a - b + 0.1]}
    flips = {"wrong_to_right": [x["id"] for x, y in pairs if not x["correct"] and y["correct"]],
             "right_to_wrong": [x["id"] for x, y in pairs if x["correct"] and not y["correct"]],
             "format_broken_to_ok": [x["id"] for x, y in pairs if not x["format_ok"] and y["format_ok"]],
             "format_ok_to_broken": [x["id"] for x, y in pairs if x["format_ok"] and not y["format_ok"]]}
    regressions = sorted(((y["total_reward"] - x["total_reward"], x, y) for x, y in pairs),
                         key=lambda t: t[0])
    by_category = {}
    for cat in sorted({x["category"] for x in before}):
        bs, as_ = ([r for r in rs if r["category"] == cat] for rs in (before, after))
        by_category[cat] = {"n": len(bs), "accuracy_before": _mean(bs, "correct"),
                            "accuracy_after": _mean(as_, "correct"), "format_before": _mean(bs, "format_ok"),
                            "format_after": _mean(as_, "format_ok")}
    return {"n_paired": len(pairs), "ids_missing_a_pair": [], "metrics": metrics,
            "flip_counts": {k: len(v) for k, v in flips.items()}, "flips": flips,
            "largest_regressions": [
                {"id": x["id"], "before": x["total_reward"], "after": y["total_reward"], "delta": d}
                for d, x, y in regressions if d < 0],
            "by_category": by_category}


def _json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


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
    _jsonl(run / "train" / "metrics.jsonl", [
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
    _json(tmp_path / "data" / "summary.json", {"new_field": [1, 2], "nested": {"a": {"b": {"c": 1}}}})
    data = _section(build_report(tmp_path), "data")
    assert "<th>new_field</th><td>[1, 2]</td>" in data and "<th>b</th><td>{&quot;c&quot;: 1}</td>" in data


def test_file_without_the_sections_part_says_so(tmp_path):
    _json(tmp_path / "comparison.json", {"n_paired": 0})
    _jsonl(tmp_path / "train" / "metrics.jsonl", [{"step": 1, "epoch": 0.1}])
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
