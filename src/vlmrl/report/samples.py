"""The report's per-sample viewer: one card per held-out item with its image, question, gold, and the
completion before and after training, marked improved / regressed / unchanged / format broken.

Left out: the filtering itself (the page's inline script toggles `hidden` on these cards from their data
attributes) and full-size images (96 px thumbnails keep a 100-item report small).
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

from vlmrl.report.cells import esc, finite, num
from vlmrl.report.files import RunFiles
from vlmrl.run import layout

THUMB_PX = 96


def samples_section(files: RunFiles) -> str:
    holdout = {r.get("id"): r for r in files.jsonl(layout.HOLDOUT)}
    before = {r.get("id"): r for r in files.jsonl(layout.records_file("baseline"))}
    after = {r.get("id"): r for r in files.jsonl(layout.records_file("after"))}
    ids = list(dict.fromkeys([*holdout, *before, *after]))
    if not ids:
        return files.missing(layout.HOLDOUT, "No held-out items yet")
    notes = [files.missing(name, what) for name, what, rows in (
        (layout.HOLDOUT, "No images or questions from the data", holdout),
        (layout.records_file("baseline"), "No baseline completions yet", before),
        (layout.records_file("after"), "No completions after training yet", after)) if not rows]
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
    if not (before and after and finite(before.get("total_reward")) and finite(after.get("total_reward"))):
        return ("baseline-only" if before and not after else "not-evaluated"), broken
    delta = after["total_reward"] - before["total_reward"]
    return ("improved" if delta > 1e-9 else "regressed" if delta < -1e-9 else "unchanged"), broken


def _sample_card(item_id: Any, state: tuple[str, bool], item: dict | None, before: dict | None,
                 after: dict | None, run_dir: Path) -> str:
    first = item or before or after or {}
    status, broken = state
    gold = item.get("answer") if item else first.get("gold")
    # the category, unless it only repeats the source (a dataset with no category column)
    shown = [first.get(k) for k in ("category", "answer_type", "source") if first.get(k)]
    meta = " · ".join(esc(v) for i, v in enumerate(shown) if v not in shown[:i])
    return (f'<article class="sample" data-id="{esc(item_id)}" data-status="{status}" '
            f'data-format-broken="{int(broken)}"><div class="thumb">{_thumbnail(item, run_dir)}</div>'
            f'<div class="item"><h3><code>{esc(item_id)}</code> <span class="badge {status}">'
            f'{status.replace("-", " ")}</span></h3><p class="meta">{meta}</p>'
            f'<p class="question">{esc(first.get("question"))}</p>'
            f'<p>gold: <strong class="gold">{esc(gold)}</strong></p></div>'
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
    pred = (f'<strong class="pred">{esc(pred)}</strong>' if pred is not None
            else '<em class="none">none extracted</em>')
    each = record.get("rewards") if isinstance(record.get("rewards"), dict) else {
        name: record.get(f"{name}_reward") for name in ("format", "correctness")}
    rewards = " · ".join(f"{esc(name)} {num(value)}" for name, value in
                         [*each.items(), ("total", record.get("total_reward"))])
    return (f'<div class="stage {label}"><h4>{label} {badges}</h4><pre class="completion">'
            f'{esc(record.get("completion"))}</pre><p>pred: {pred}</p><p class="rewards">reward: {rewards} · '
            f'{esc(record.get("generated_tokens"))} tokens</p></div>')


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
        return f'<span class="missing">image not found: {esc(path)}</span>'
    data = base64.b64encode(buffer.getvalue()).decode()
    return f'<img src="data:image/png;base64,{data}" alt="{esc(path)}" width="{thumb.width}">'

