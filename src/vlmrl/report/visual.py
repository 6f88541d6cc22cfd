"""The report's visual-control section: one row per family and one overall, from comparison.json."""

from __future__ import annotations

from html import escape


def report_html(control: dict | None) -> str:
    """The report's section: one row per family and one overall."""
    if not isinstance(control, dict) or not isinstance(control.get("overall"), dict):
        return ('<p class="missing">No visual control in comparison.json: run <code>vlmrl compare RUN_DIR '
                "--visual-control</code> (or set eval.visual_control: true).</p>")
    rows = [_row("all", control["overall"])] + [_row(name, b) for name, b in sorted(control["by_family"].items())]
    head = "".join(f"<th>{h}</th>" for h in ("family", "n", "before true", "before swapped", "after true",
                                              "after swapped", "visual gain", "95% CI"))
    return (f'<p class="src">From comparison.json "visual_control": each held-out item also evaluated with another '
            f"item's image (same family; {control.get('cross_family_swaps', 0)} cross-family). Visual gain = "
            "(after true − after swapped) − (before true − before swapped) accuracy, paired per item.</p>"
            f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>")


def _row(name: str, block: dict) -> str:
    acc = block["accuracy"]
    lo, hi = block["visual_gain_ci95"]
    cells = [f"{acc[k]:.3f}" for k in ("before_true", "before_swapped", "after_true", "after_swapped")]
    return (f"<tr><th>{escape(name)}</th><td>{block['n']}</td>" + "".join(f"<td>{c}</td>" for c in cells)
            + f"<td>{block['visual_gain']:+.3f}</td><td>[{lo:+.3f}, {hi:+.3f}]</td></tr>")
