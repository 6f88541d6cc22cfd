"""The report's curves: one small matplotlib figure per metric, as inline SVG that is the same on every run.

A bare `Figure` (no pyplot) keeps no global state; matplotlib is imported only when a curve is drawn. Left
out: interactive plots (they would need a script library, and the page allows only its own script).
"""

from __future__ import annotations

import io
import re

from vlmrl.report.cells import esc, finite


def figure(label: str, key: str, series: dict[str, tuple[list, list]], xlabel: str = "step") -> str:
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
        ax.set_xlabel(xlabel)
        ax.ticklabel_format(axis="y", useOffset=False, style="plain" if key != "learning_rate" else "sci")
        if len(series) > 1:  # below the axes, where it cannot hide a line
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=2, frameon=False)
        buffer = io.StringIO()
        fig.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    svg = buffer.getvalue()
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg[svg.index("<svg"):], flags=re.DOTALL)
    caption = f"<figcaption>{esc(label)} <code>{esc(key)}</code></figcaption>"
    return f'<figure data-key="{esc(key)}">{caption}{svg}</figure>'



def step_series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    points = [(r["step"], r[key]) for r in rows if finite(r.get("step")) and finite(r.get(key))]
    return [x for x, _ in points], [y for _, y in points]


def xy_series(rows: list[dict], x: str, y: str, x_scale: float = 1.0) -> tuple[list[float], list[float]]:
    """(x, y) of the rows holding both as finite numbers, x multiplied by `x_scale` (seconds to minutes).

    >>> xy_series([{"s": 60, "r": 1.0}, {"s": 120}, {"s": 180, "r": 2.0}], "s", "r", 1 / 60)
    ([1.0, 3.0], [1.0, 2.0])
    """
    points = [(r[x] * x_scale, r[y]) for r in rows if finite(r.get(x)) and finite(r.get(y))]
    return [a for a, _ in points], [b for _, b in points]

