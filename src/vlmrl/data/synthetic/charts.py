"""Synthetic chart families: bars, lines, pies, scatter plots, tables and counting squares.

Each family draws on a `Canvas` and returns a `Problem` whose answer follows from the numbers it drew, so it
is exact by construction. Numbers with decimals are drawn as integer tenths and converted once, which keeps
sums and differences exact (no 0.1 + 0.2 surprises in a gold answer).
"""

from __future__ import annotations

import random

from vlmrl.data.synthetic.canvas import (
    PALETTE,
    Canvas,
    Problem,
    chart_axes,
    format_number,
    nice_step,
    place_boxes,
    ticks_between,
)

TITLES = ("Sales", "Scores", "Visitors", "Results", "Counts", "Revenue", "Votes", "Output")


def _tenths(rng: random.Random, count: int, low: int, high: int, decimals: bool) -> list[int]:
    """`count` distinct values in [low, high] as integer tenths (whole numbers unless `decimals`)."""
    if decimals:
        return rng.sample(range(low * 10, high * 10 + 1), count)
    return [10 * v for v in rng.sample(range(low, high + 1), count)]


def _bar_chart(c: Canvas, difficulty: int, *, separated: bool = False) -> tuple[list[str], list[int], int | None]:
    """Draw a labelled bar chart; returns bar labels, values in tenths, and the answer precision. `separated`:
    the tallest bar is taller than the next by at least a tenth of its height, so the eye can tell."""
    rng = c.rng
    n = rng.randint(*{1: (3, 4), 2: (4, 5), 3: (5, 6)}[difficulty])
    n = min(n, max(3, c.size // 24))  # keep bars (and their value labels) readable on small canvases
    first = rng.randint(0, 26 - n)
    labels = [chr(ord("A") + first + i) for i in range(n)]
    decimals = difficulty == 3 and rng.random() < 0.5
    values = _tenths(rng, n, 1, {1: 10, 2: 30, 3: 60}[difficulty], decimals)
    while separated and max(values) - sorted(values)[-2] < max(values) / 10:
        values = _tenths(rng, n, 1, {1: 10, 2: 30, 3: 60}[difficulty], decimals)
    top = max(values) / 10
    step = nice_step(top * 1.2, 4)
    axes = chart_axes(c, (0, n), (0, step * (int(top * 1.2 / step) + 1)))
    axes.draw_y_ticks(ticks_between(0, axes.y_range[1], step), grid=rng.random() < 0.6)
    axes.draw_frame()
    if rng.random() < 0.7:
        c.text((c.size / 2, c.px(0.06)), rng.choice(TITLES), 0.085)
    colors = c.colors(n)
    width = rng.uniform(0.5, 0.75)
    for i, (label, tenths) in enumerate(zip(labels, values)):
        x0, y0 = axes.to_px(i + (1 - width) / 2, tenths / 10)
        x1, y1 = axes.to_px(i + (1 + width) / 2, 0)
        c.draw.rectangle([x0, y0, x1, y1], fill=colors[i])
        slot = (axes.right - axes.left) / n
        c.text(
            ((x0 + x1) / 2, y0 - c.px(0.012)),
            format_number(tenths / 10),
            0.075,
            anchor="mb",
            max_width=0.95 * slot,
        )
        c.text(((x0 + x1) / 2, axes.bottom + c.px(0.02)), label, 0.09, anchor="mt")
    return labels, values, 1 if decimals else None


def bar_value(c: Canvas, difficulty: int) -> Problem:
    labels, values, precision = _bar_chart(c, difficulty)
    k = c.rng.randrange(len(labels))
    question = c.rng.choice(("What is the value of bar {}?", "What value does bar {} show?")).format(
        labels[k]
    )
    return Problem(question, values[k] / 10, precision, {"bars": _bars(labels, values), "target": labels[k]})


def bar_max(c: Canvas, difficulty: int) -> Problem:
    labels, values, precision = _bar_chart(c, difficulty)
    question = c.rng.choice(
        ("What is the largest value in the bar chart?", "What is the value of the tallest bar?")
    )
    return Problem(question, max(values) / 10, precision, {"bars": _bars(labels, values)})


def bar_tallest(c: Canvas, difficulty: int) -> Problem:
    """The tallest bar's position from the left: read off the heights, no label or value needed."""
    labels, values, _ = _bar_chart(c, difficulty, separated=True)
    k = values.index(max(values))
    question = "Counting from the left, which bar is the tallest? Answer with its position (1 is the leftmost)."
    return Problem(question, k + 1, None, {"bars": _bars(labels, values), "tallest": labels[k]})


def bar_difference(c: Canvas, difficulty: int) -> Problem:
    labels, values, precision = _bar_chart(c, difficulty)
    i, j = c.rng.sample(range(len(labels)), 2)
    if values[i] < values[j]:
        i, j = j, i
    question = f"How much larger is the value of bar {labels[i]} than the value of bar {labels[j]}?"
    spec = {"bars": _bars(labels, values), "larger": labels[i], "smaller": labels[j]}
    return Problem(question, (values[i] - values[j]) / 10, precision, spec)


def bar_sum(c: Canvas, difficulty: int) -> Problem:
    labels, values, precision = _bar_chart(c, difficulty)
    question = c.rng.choice(("What is the sum of all bar values?", "What is the total of all the bars?"))
    return Problem(question, sum(values) / 10, precision, {"bars": _bars(labels, values)})


def line_value(c: Canvas, difficulty: int) -> Problem:
    rng = c.rng
    n = rng.randint(*{1: (4, 5), 2: (5, 6), 3: (6, 7)}[difficulty])
    decimals = difficulty == 3 and rng.random() < 0.5
    values = [rng.randint(10, 200) if decimals else 10 * rng.randint(1, 20) for _ in range(n)]  # tenths
    start = rng.randint(0, 3)
    xs = [start + i for i in range(n)]
    top = max(values) / 10
    step = nice_step(top * 1.25, 4)
    axes = chart_axes(c, (-0.5, n - 0.5), (0, step * (int(top * 1.25 / step) + 1)))
    axes.draw_y_ticks(ticks_between(0, axes.y_range[1], step), grid=rng.random() < 0.6)
    axes.draw_x_ticks([(i, str(x)) for i, x in enumerate(xs)], grid=False, fraction=0.08)
    axes.draw_frame()
    color = c.colors(1)[0]
    points = [axes.to_px(i, v / 10) for i, v in enumerate(values)]
    c.draw.line(points, fill=color, width=max(2, c.px(0.012)))
    radius = max(2, c.px(0.016))
    slot = (axes.right - axes.left) / n
    for (x, y), v in zip(points, values):
        c.draw.ellipse([x - radius, y - radius, x + radius, y + radius], fill=color)
        c.text((x, y - radius - c.px(0.01)), format_number(v / 10), 0.07, anchor="mb", max_width=0.95 * slot)
    k = rng.randrange(n)
    question = f"What is the value of the line at x = {xs[k]}?"
    return Problem(
        question,
        values[k] / 10,
        1 if decimals else None,
        {"points": {str(x): v / 10 for x, v in zip(xs, values)}, "target_x": xs[k]},
    )


def pie_percentage(c: Canvas, difficulty: int) -> Problem:
    """A pie with a legend giving every share but one; the missing share is 100 minus the rest."""
    rng = c.rng
    k = {1: 3, 2: 4, 3: 5}[difficulty]
    unit = {1: 50, 2: 10, 3: 1}[difficulty]  # shares are multiples of 5%, 1% or 0.1% (in tenths)
    while True:
        cuts = sorted(rng.sample(range(1, 1000 // unit), k - 1))
        shares = [(b - a) * unit for a, b in zip([0, *cuts], [*cuts, 1000 // unit])]
        if min(shares) >= 50:  # every slice at least 5% so it is visible
            break
    labels = [chr(ord("A") + i) for i in range(k)]
    target = rng.randrange(k)
    colors = rng.sample(PALETTE, k)
    cx, cy, r = c.px(0.3), c.px(0.55), c.px(0.25)
    start = rng.uniform(0, 360)
    for share, color in zip(shares, colors):
        end = start + share / 1000 * 360
        c.draw.pieslice([cx - r, cy - r, cx + r, cy + r], start, end, fill=color, outline=c.background)
        start = end
    c.text((c.size / 2, c.px(0.08)), rng.choice(("Share by group", "Market share", "Budget")), 0.085)
    precision = 1 if difficulty == 3 else None
    for i, (label, share, color) in enumerate(zip(labels, shares, colors)):
        y = c.px(0.3 + i * 0.13)
        c.draw.rectangle([c.px(0.6), y - c.px(0.035), c.px(0.67), y + c.px(0.035)], fill=color)
        text = f"{label}: ?" if i == target else f"{label}: {format_number(share / 10, precision)}%"
        c.text((c.px(0.69), y), text, 0.075, anchor="lm")
    question = f"What percentage of the pie does slice {labels[target]} represent?"
    return Problem(
        question,
        shares[target] / 10,
        precision,
        {"shares": {lb: s / 10 for lb, s in zip(labels, shares)}, "target": labels[target]},
    )


def scatter_count(c: Canvas, difficulty: int) -> Problem:
    rng = c.rng
    n = rng.randint(*{1: (2, 6), 2: (4, 10), 3: (7, 15)}[difficulty])
    axes = chart_axes(c, (0, 10), (0, 10), title_space=0.08)
    axes.draw_y_ticks([0, 5, 10], grid=rng.random() < 0.5)
    axes.draw_x_ticks([(0, "0"), (5, "5"), (10, "10")], grid=False)
    axes.draw_frame()
    radius = max(3, c.px(0.022))
    area = (axes.left + radius, axes.top, axes.right - 2 * radius, axes.bottom - 3 * radius)
    boxes = place_boxes(rng, n, [2 * radius] * n, area, gap=radius) or []
    color = c.colors(1)[0]
    for x, y, side in boxes:
        c.draw.ellipse([x, y, x + side, y + side], fill=color)
    question = rng.choice(("How many points are in the scatter plot?", "How many data points are shown?"))
    return Problem(question, len(boxes), None, {"points": len(boxes)})


def table_lookup(c: Canvas, difficulty: int) -> Problem:
    rng = c.rng
    rows, cols = {1: (2, 2), 2: (3, 3), 3: (3, 4)}[difficulty]
    row_names = [chr(ord("A") + i) for i in range(rows)]
    col_names = rng.choice((["X", "Y", "Z", "W"], ["P", "Q", "R", "S"], ["1", "2", "3", "4"]))[:cols]
    cells = [[rng.randint(1, 9 if difficulty == 1 else 99) for _ in range(cols)] for _ in range(rows)]
    left, top, right, bottom = c.px(0.06), c.px(0.12), c.px(0.94), c.px(0.12 + 0.16 * (rows + 1))
    cw, ch = (right - left) / (cols + 1), (bottom - top) / (rows + 1)
    c.draw.rectangle([left, top, right, top + ch], fill=(225, 225, 225))
    for i in range(rows + 2):
        c.draw.line([(left, top + i * ch), (right, top + i * ch)], fill=c.ink, width=c.line_width())
    for j in range(cols + 2):
        c.draw.line([(left + j * cw, top), (left + j * cw, bottom)], fill=c.ink, width=c.line_width())
    for j, name in enumerate(col_names):
        c.text((left + (j + 1.5) * cw, top + ch / 2), name, 0.09)
    for i, name in enumerate(row_names):
        c.text((left + cw / 2, top + (i + 1.5) * ch), name, 0.09)
        for j in range(cols):
            c.text((left + (j + 1.5) * cw, top + (i + 1.5) * ch), str(cells[i][j]), 0.085)
    r, k = rng.randrange(rows), rng.randrange(cols)
    spec = {"rows": row_names, "columns": col_names, "cells": cells}
    if difficulty > 1 and rng.random() < 0.5:
        return Problem(f"What is the sum of the values in row {row_names[r]}?", sum(cells[r]), None, spec)
    return Problem(
        f"What is the value in row {row_names[r]}, column {col_names[k]}?", cells[r][k], None, spec
    )


def count_squares(c: Canvas, difficulty: int) -> Problem:
    """1-5 filled squares on a plain background (more, and circles as distractors, when harder)."""
    rng = c.rng
    n = rng.randint(1, {1: 5, 2: 7, 3: 9}[difficulty])
    distractors = rng.randint(1, 3) if difficulty == 3 else 0
    low, high = {1: (0.14, 0.24), 2: (0.12, 0.2), 3: (0.1, 0.16)}[difficulty]
    sides = [c.px(rng.uniform(low, high)) for _ in range(n + distractors)]
    margin = c.px(0.05)
    boxes = None
    while boxes is None:  # sizes shrink until everything fits without touching
        boxes = place_boxes(
            rng, n + distractors, sides, (margin, margin, c.size - margin, c.size - margin), gap=c.px(0.04)
        )
        sides = [max(4, int(s * 0.9)) for s in sides]
    colors = c.colors(n + distractors)
    for i, (x, y, side) in enumerate(boxes):
        shape = c.draw.rectangle if i < n else c.draw.ellipse
        shape([x, y, x + side - 1, y + side - 1], fill=colors[i])
    return Problem("How many squares are there?", n, None, {"squares": n, "circles": distractors})


def _bars(labels: list[str], tenths: list[int]) -> dict[str, float]:
    return {label: v / 10 for label, v in zip(labels, tenths)}
