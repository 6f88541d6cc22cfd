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


# ---- a fake run directory, shaped like the stage outputs ------------------------------------------------------

def make_run(root: Path, *, n: int = 12, stages: tuple[str, ...] = ("data", "baseline", "train", "after",
                                                                     "compare", "export", "setup")) -> Path:
    """Write the files a run directory holds after `stages`; item 1's after completion is an injection attempt."""
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
        _json(run / "data" / "summary.json", {"input_rows": n + 3, "train": 40, "holdout": n,
                                              "dropped_by_reason": {"too_long": 2, "bad_image": 1},
                                              "comparable_to_published": False, "message": "synthetic data"})
    records = {}
    for stage in ("baseline", "after"):
        if stage in stages:
            records[stage] = [_record(item, stage) for item in items]
            _jsonl(run / f"{stage}_records.jsonl", records[stage])
            _json(run / f"{stage}_summary.json", _summary(stage, records[stage]))
    if "train" in stages:
        (run / "train").mkdir(exist_ok=True)
        _jsonl(run / "train" / "metrics.jsonl", [
            {"step": s, "epoch": s / 20, "reward": 0.2 + 0.03 * s, "rewards/format_reward/mean": min(1, 0.1 * s),
             "rewards/correctness_reward/mean": 0.02 * s, "completions/mean_length": 60 - s,
             "completions/clipped_ratio": 0.1, "clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.01 * (s % 3),
             "frac_reward_zero_std": 0.5 - 0.02 * s, "learning_rate": 5e-6, "loss": 0.01 * (s % 4),
             "grad_norm": 0.3} for s in range(1, 21)])
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
    path = run / "data" / "images" / f"q{i}.png"
    image = Image.new("RGB", (256, 256), "white")
    ImageDraw.Draw(image).rectangle([40, 256 - 20 * (i % 10 + 1), 120, 250], fill=(60, 110, 200))
    image.save(path)
    return {"id": f"item-{i:03d}", "question": f"How tall is bar {i}? (<b>units</b>)", "prompt": "...",
            "answer": str(i % 10 + 1), "answer_type": "integer", "precision": None, "unit": None, "choices": None,
            "source": "synthetic", "category": ["chart", "geometry"][i % 2], "metadata": {},
            "image": f"data/images/q{i}.png", "image_sha256": "ab" * 32}


def _record(item: dict, stage: str) -> dict:
    i = int(item["id"].split("-")[1])
    good = (i % 3 == 0) if stage == "baseline" else (i % 2 == 0)  # some gained, some lost, some unchanged
    formatted = stage == "after" or i % 4 != 1
    completion = (f"<REASONING>count</REASONING><SOLUTION>{item['answer'] if good else 0}</SOLUTION>" if formatted
                  else "the bar is tall")
    if stage == "after" and i == 1:  # an injection attempt, and the only after completion with a broken format
        completion, formatted = f"{SCRIPT_ATTACK} {IMG_ATTACK} <SOLUTION>0</SOLUTION>", False
    correct = good and formatted
    return {"id": item["id"], "stage": stage, "question": item["question"], "gold": item["answer"],
            "answer_type": "integer", "precision": None, "completion": completion,
            "pred": (item["answer"] if good else "0") if formatted else None, "format_ok": formatted,
            "format_reward": 1.0 if formatted else 0.0, "correctness_reward": 1.0 if correct else 0.0,
            "total_reward": 0.3 * formatted + 1.0 * correct, "correct": correct, "exact_match": correct,
            "degenerate": False, "mathvista_normalized": None, "mathvista_correct": correct,
            "generated_tokens": 17, "truncated": False, "image_sha256": item["image_sha256"], "prompt_sha256": "cd" * 32,
            "category": item["category"], "metadata": {}, "generation": {}, "seconds": 0.1}


def _summary(stage: str, records: list[dict]) -> dict:
    def stat(field):
        mean = sum(float(r[field]) for r in records) / len(records)
        return {"mean": mean, "ci95": [max(0.0, mean - 0.1), mean + 0.1]}

    return {"stage": stage, "n": len(records), "accuracy": stat("correct"), "mathvista_accuracy": stat("mathvista_correct"),
            "exact_match": stat("exact_match"), "format_compliance": stat("format_ok"),
            "format_reward": stat("format_reward"), "correctness_reward": stat("correctness_reward"),
            "total_reward": stat("total_reward"), "truncation_rate": 0.0, "gibberish_rate": 0.0,
            "mean_generated_tokens": 17.0, "tokens_per_second": 123.4, "items_per_second": 7.25}


def _comparison(before: list[dict], after: list[dict]) -> dict:
    pairs = list(zip(before, after))
    mean = lambda rs, f: sum(float(r[f]) for r in rs) / len(rs)
    metrics = {}
    for name, field in (("accuracy", "correct"), ("mathvista_accuracy", "mathvista_correct"),
                        ("format_compliance", "format_ok")):
        b, a = mean(before, field), mean(after, field)
        metrics[name] = {"before": b, "after": a, "delta": a - b, "delta_ci95": [a - b - 0.21, a - b + 0.19],
                         "gained": sum(not x[field] and y[field] for x, y in pairs),
                         "lost": sum(x[field] and not y[field] for x, y in pairs), "mcnemar_p": 0.0421875}
    for name in ("total_reward", "format_reward", "correctness_reward"):
        b, a = mean(before, name), mean(after, name)
        metrics[name] = {"before": b, "after": a, "delta": a - b, "delta_ci95": [a - b - 0.1, a - b + 0.1]}
    flips = {"wrong_to_right": [x["id"] for x, y in pairs if not x["correct"] and y["correct"]],
             "right_to_wrong": [x["id"] for x, y in pairs if x["correct"] and not y["correct"]],
             "format_broken_to_ok": [x["id"] for x, y in pairs if not x["format_ok"] and y["format_ok"]],
             "format_ok_to_broken": [x["id"] for x, y in pairs if x["format_ok"] and not y["format_ok"]]}
    regressions = sorted(((y["total_reward"] - x["total_reward"], x, y) for x, y in pairs), key=lambda t: t[0])
    by_category = {}
    for cat in sorted({x["category"] for x in before}):
        bs = [x for x in before if x["category"] == cat]
        as_ = [y for y in after if y["category"] == cat]
        by_category[cat] = {"n": len(bs), "accuracy_before": mean(bs, "correct"), "accuracy_after": mean(as_, "correct"),
                            "format_before": mean(bs, "format_ok"), "format_after": mean(as_, "format_ok")}
    return {"n_paired": len(pairs), "ids_missing_a_pair": [], "metrics": metrics,
            "flip_counts": {k: len(v) for k, v in flips.items()}, "flips": flips,
            "largest_regressions": [{"id": x["id"], "before": x["total_reward"], "after": y["total_reward"], "delta": d}
                                    for d, x, y in regressions if d < 0],
            "by_category": by_category}


def _json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _cells(page: str, metric: str) -> list[str]:
    """The data-value attributes (exact file values) of a headline row, in column order."""
    row = re.search(rf'<table class="headline">.*?<tr data-metric="{metric}">(.*?)</tr>', page, re.DOTALL).group(1)
    return re.findall(r'data-value="([^"]*)"', row)


# ---- tests ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> tuple[Path, str]:
    run = make_run(tmp_path_factory.mktemp("full"))
    path = write_report(run)
    return run, path.read_text(encoding="utf-8")


def test_write_report_writes_report_html_with_every_section(full_run):
    run, page = full_run
    assert (run / "report.html").is_file()
    for section in ("headline", "training", "categories", "flips", "samples", "export", "data", "setup"):
        assert f'<section id="{section}">' in page
    for source in ("comparison.json", "baseline_summary.json", "train/metrics.jsonl", "train/health.jsonl",
                   "export.json", "data/summary.json", "config.yaml", "env.json", "data/holdout.jsonl"):
        assert f"From {source}" in page or source in page
    assert "missing)" not in page  # a complete run reports nothing missing


def test_headline_numbers_equal_comparison_json(full_run):
    run, page = full_run
    metrics = json.loads((run / "comparison.json").read_text())["metrics"]
    for name in ("accuracy", "mathvista_accuracy", "format_compliance", "total_reward"):
        m = metrics[name]
        values = [float(v) for v in _cells(page, name)]
        expected = [m["before"], m["after"], m["delta"]] + ([m["mcnemar_p"]] if "mcnemar_p" in m else [])
        assert values == expected
        lo, hi = m["delta_ci95"]
        assert f"[{lo:.3f}, {hi:.3f}]" in page
    acc = metrics["accuracy"]
    row = re.search(r'<tr data-metric="accuracy">.*?</tr>', page, re.DOTALL).group(0)
    # shown text: 3 decimals, signed delta, p to 3 significant digits, gained/lost
    assert f">{acc['before']:.3f}<" in row and f">{acc['delta']:+.3f}<" in row and ">0.0422<" in row
    assert f"+{acc['gained']} / −{acc['lost']}" in row


def test_training_curves_plot_each_logged_key_as_inline_svg(full_run):
    _, page = full_run
    for key in ("reward", "rewards/format_reward/mean", "rewards/correctness_reward/mean", "completions/mean_length",
                "completions/clipped_ratio", "clip_ratio/*", "frac_reward_zero_std", "learning_rate", "loss",
                "grad_norm", "format_rate", "gibberish_rate", "truncation_rate", "zero_variance_groups"):
        assert f'<figure data-key="{key}">' in page
    assert 'data-key="kl"' not in page  # not logged, so not plotted
    assert page.count("<svg") == 14
    assert "format rate &lt; 0.5 &lt;b&gt;" in page  # health warnings, escaped


def test_categories_flips_export_and_data_sections_show_file_values(full_run):
    run, page = full_run
    comparison = json.loads((run / "comparison.json").read_text())
    for name, c in comparison["by_category"].items():
        row = re.search(rf'<tr data-category="{name}">(.*?)</tr>', page, re.DOTALL).group(1)
        assert [float(v) for v in re.findall(r'data-value="([^"]*)"', row)][:3] == [c["n"], c["accuracy_before"],
                                                                                   c["accuracy_after"]]
    for kind, count in comparison["flip_counts"].items():
        row = re.search(rf'<tr data-flip="{kind}">(.*?)</tr>', page, re.DOTALL).group(1)
        assert f'data-value="{count}">{count}</td>' in row
        assert all(f'data-goto="{i}"' in row for i in comparison["flips"][kind])
    export = page[page.index('<section id="export">'):page.index('<section id="data">')]
    assert "NOT all checks passed" in export
    assert export.count('badge pass">passed') == 1 and export.count('badge fail">FAILED') == 1
    assert export.count('badge skip">skipped') == 1
    data = page[page.index('<section id="data">'):page.index('<section id="setup">')]
    assert "dropped_by_reason" in data and "too_long" in data and "synthetic data" in data
    assert "algorithm: gspo" in page and "2.14.1" in page


def test_samples_viewer_has_one_card_per_item_with_status_and_thumbnail(full_run):
    run, page = full_run
    assert page.count('<article class="sample"') == 12
    assert page.count('<img src="data:image/png;base64,') == 12
    before = {json.loads(x)["id"]: json.loads(x) for x in (run / "baseline_records.jsonl").read_text().splitlines()}
    after = {json.loads(x)["id"]: json.loads(x) for x in (run / "after_records.jsonl").read_text().splitlines()}
    for item_id in before:
        delta = after[item_id]["total_reward"] - before[item_id]["total_reward"]
        status = "improved" if delta > 0 else "regressed" if delta < 0 else "unchanged"
        broken = "0" if after[item_id]["format_ok"] else "1"
        assert f'data-id="{item_id}" data-status="{status}" data-format-broken="{broken}"' in page
    for label in ("all", "improved", "regressed", "unchanged", "format-broken"):
        assert f'data-filter="{label}"' in page
    assert 'id="sample-search"' in page


def test_model_and_data_text_is_escaped(full_run):
    _, page = full_run
    assert SCRIPT_ATTACK not in page and IMG_ATTACK not in page
    assert html.escape(SCRIPT_ATTACK) in page and html.escape(IMG_ATTACK) in page
    assert "(&lt;b&gt;units&lt;/b&gt;)" in page  # questions from the data, too
    assert page.count("<script") == 1  # ours only
    csp = re.search(r'http-equiv="Content-Security-Policy" content="([^"]*)"', page).group(1)
    assert "default-src 'none'" in csp and "'unsafe-inline'" not in csp.split("script-src")[1]


def test_page_needs_no_network(full_run):
    _, page = full_run
    assert not re.search(r'(src|href)="(https?:)?//', page)
    assert "@import" not in page and "<link rel=\"stylesheet\"" not in page


def test_report_of_100_items_stays_small(tmp_path):
    page = build_report(make_run(tmp_path, n=100))
    assert page.count('<article class="sample"') == 100
    assert len(page.encode()) < 1_500_000


def test_report_is_deterministic(tmp_path):
    run = make_run(tmp_path, n=3)
    assert build_report(run) == build_report(run)


def test_baseline_only_run_says_what_is_missing(tmp_path):
    page = build_report(make_run(tmp_path, stages=("setup", "data", "baseline")))
    assert "No before/after comparison yet (comparison.json missing)." in page
    assert "No training metrics yet (train/metrics.jsonl missing)." in page
    assert "No evaluation after training yet (after_summary.json missing)." in page
    assert "No completions after training yet (after_records.jsonl missing)." in page
    assert "No export yet (export.json missing)." in page
    assert 'data-status="baseline-only"' in page and "<svg" not in page
    summary = re.search(r'<table class="summary">.*?</table>', page, re.DOTALL).group(0)
    assert "baseline (mean)" in summary and "after (mean)" not in summary


def test_data_only_run_shows_items_without_completions(tmp_path):
    page = build_report(make_run(tmp_path, n=4, stages=("data",)))
    assert "No evaluation yet (baseline_summary.json missing)." in page
    assert "No baseline completions yet (baseline_records.jsonl missing)." in page
    assert "No config recorded (config.yaml missing)." in page
    assert page.count('data-status="not-evaluated"') == 4 and page.count("not evaluated</p>") == 8


def test_empty_run_dir_still_renders(tmp_path):
    path = write_report(tmp_path)
    page = path.read_text()
    assert "No held-out items yet (data/holdout.jsonl missing)." in page
    assert "No data summary yet (data/summary.json missing)." in page


def test_damaged_file_is_named_not_fatal(tmp_path):
    run = make_run(tmp_path, n=2)
    (run / "comparison.json").write_text("{not json")
    (run / "data" / "images" / "q0.png").unlink()
    page = build_report(run)
    assert "comparison.json could not be read: JSONDecodeError" in page
    assert "image not found: data/images/q0.png" in page
