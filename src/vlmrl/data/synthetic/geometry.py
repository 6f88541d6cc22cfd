"""Synthetic geometry families: right triangles, rectangles, circles and triangle angles.

Figures are drawn roughly to scale (extreme proportions are clamped so a 1 x 12 rectangle still looks like a
rectangle with readable labels); the numbers printed on the figure are what the answer is computed from.
Lengths with decimals are integer tenths until the end, so areas and perimeters are exact.
"""

from __future__ import annotations

import math

from vlmrl.data.synthetic.canvas import Canvas, Problem, format_number

LIGHT_FILLS = ((222, 235, 250), (250, 232, 214), (226, 244, 226), (240, 230, 248), (255, 255, 255))
EASY_TRIPLES = ((3, 4, 5), (6, 8, 10), (5, 12, 13), (8, 15, 17))
TRIPLES = ((3, 4, 5), (5, 12, 13), (8, 15, 17), (7, 24, 25), (20, 21, 29), (9, 40, 41))


def _box(c: Canvas, width: float, height: float, max_ratio: float = 2.2) -> tuple[float, float, float, float]:
    """Pixel rectangle (left, top, right, bottom) for a shape of the given proportions, centred, clamped."""
    ratio = min(max(height / width, 1 / max_ratio), max_ratio)
    span = c.size * c.rng.uniform(0.5, 0.6)
    w, h = (span, span * ratio) if ratio <= 1 else (span / ratio, span)
    cx = c.size / 2 + c.rng.uniform(-0.04, 0.04) * c.size
    cy = c.size * 0.55 + c.rng.uniform(-0.03, 0.03) * c.size
    return cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2


def _length_label(c: Canvas, tenths: int, decimals: bool) -> str:
    return format_number(tenths / 10, 1 if decimals else None)


def pythagoras(c: Canvas, difficulty: int) -> Problem:
    rng = c.rng
    if difficulty == 3:
        a, b = rng.randint(2, 15), rng.randint(2, 15)
        hyp = math.hypot(a, b)
        precision = None if hyp.is_integer() else 2
    else:
        k = 1 if difficulty == 1 else rng.randint(1, 3)
        a, b, hyp = (k * side for side in rng.choice(EASY_TRIPLES if difficulty == 1 else TRIPLES))
        precision = None
    if rng.random() < 0.5:
        a, b = b, a
    left, top, right, bottom = _box(c, a, b)
    corner, far_x = (
        (left, right) if rng.random() < 0.5 else (right, left)
    )  # right angle bottom-left or -right
    points = [(corner, bottom), (far_x, bottom), (corner, top)]
    c.draw.polygon(points, fill=rng.choice(LIGHT_FILLS), outline=c.ink, width=max(2, c.px(0.01)))
    mark = c.px(0.05) * (1 if corner == left else -1)
    c.draw.line(
        [(corner + mark, bottom), (corner + mark, bottom - abs(mark)), (corner, bottom - abs(mark))],
        fill=c.ink,
        width=c.line_width(),
    )
    side_x = corner - c.px(0.03) * (1 if corner == left else -1)
    c.text(((corner + far_x) / 2, bottom + c.px(0.025)), str(a), 0.1, anchor="mt")
    c.text((side_x, (top + bottom) / 2), str(b), 0.1, anchor="rm" if corner == left else "lm")
    mid = ((far_x + corner) / 2, (top + bottom) / 2)
    away = 1 if far_x > corner else -1
    c.text((mid[0] + away * c.px(0.06), mid[1] - c.px(0.06)), "?", 0.11)
    question = "The two legs of the right triangle are labelled. What is the length of the hypotenuse?"
    if precision:
        question += " Round to two decimal places."
    value = round(hyp, precision) if precision else int(hyp)
    return Problem(question, value, precision, {"legs": [a, b]})


def _rectangle(c: Canvas, difficulty: int) -> tuple[int, int, bool]:
    """Draw a rectangle with labelled sides; returns width and height in tenths, and whether decimal."""
    rng = c.rng
    decimals = difficulty == 3
    low, high = {1: (2, 10), 2: (5, 25), 3: (1, 15)}[difficulty]
    if decimals:
        w, h = rng.randint(low * 10, high * 10), rng.randint(low * 10, high * 10)
    else:
        w, h = 10 * rng.randint(low, high), 10 * rng.randint(low, high)
    left, top, right, bottom = _box(c, w, h, max_ratio=1.8)
    c.draw.rectangle(
        [left, top, right, bottom], fill=rng.choice(LIGHT_FILLS), outline=c.ink, width=max(2, c.px(0.01))
    )
    c.text(((left + right) / 2, bottom + c.px(0.025)), _length_label(c, w, decimals), 0.1, anchor="mt")
    c.text((right + c.px(0.025), (top + bottom) / 2), _length_label(c, h, decimals), 0.1, anchor="lm")
    return w, h, decimals


def rectangle_area(c: Canvas, difficulty: int) -> Problem:
    w, h, decimals = _rectangle(c, difficulty)
    return Problem(
        "What is the area of the rectangle?",
        w * h / 100,
        2 if decimals else None,
        {"width": w / 10, "height": h / 10},
    )


def rectangle_perimeter(c: Canvas, difficulty: int) -> Problem:
    w, h, decimals = _rectangle(c, difficulty)
    return Problem(
        "What is the perimeter of the rectangle?",
        2 * (w + h) / 10,
        1 if decimals else None,
        {"width": w / 10, "height": h / 10},
    )


def _circle(c: Canvas, difficulty: int) -> float:
    """Draw a circle with its radius (or diameter) labelled; returns the radius."""
    rng = c.rng
    if difficulty == 3:
        radius, show_diameter = rng.randint(10, 120) / 10, False
    else:
        radius, show_diameter = (
            rng.randint(1, 10 if difficulty == 1 else 15),
            difficulty == 2 and rng.random() < 0.5,
        )
    r = c.size * rng.uniform(0.27, 0.33)
    cx, cy = c.size / 2, c.size * 0.56
    c.draw.ellipse(
        [cx - r, cy - r, cx + r, cy + r],
        fill=rng.choice(LIGHT_FILLS),
        outline=c.ink,
        width=max(2, c.px(0.01)),
    )
    dot = max(2, c.px(0.012))
    c.draw.ellipse([cx - dot, cy - dot, cx + dot, cy + dot], fill=c.ink)
    start = cx - r if show_diameter else cx
    c.draw.line([(start, cy), (cx + r, cy)], fill=c.ink, width=max(2, c.px(0.008)))
    label = f"d = {format_number(2 * radius)}" if show_diameter else f"r = {format_number(radius)}"
    c.text(((start + cx + r) / 2, cy - c.px(0.02)), label, 0.095, anchor="mb")
    return radius


def circle_area(c: Canvas, difficulty: int) -> Problem:
    radius = _circle(c, difficulty)
    question = "What is the area of the circle? Use pi and round to two decimal places."
    return Problem(question, round(math.pi * radius**2, 2), 2, {"radius": radius})


def circle_circumference(c: Canvas, difficulty: int) -> Problem:
    radius = _circle(c, difficulty)
    question = "What is the circumference of the circle? Use pi and round to two decimal places."
    return Problem(question, round(2 * math.pi * radius, 2), 2, {"radius": radius})


def polygon_sides(c: Canvas, difficulty: int) -> Problem:
    """A filled convex polygon, regular or (harder) with its corners moved: count its sides. No text in the picture.

    Every corner turns the outline by at least 25 degrees, so no corner hides in a near-straight edge."""
    rng = c.rng
    n = rng.randint(3, {1: 6, 2: 8, 3: 10}[difficulty])
    jitter = {1: 0.0, 2: 0.12, 3: 0.22}[difficulty]
    cx, cy = c.size / 2, c.size / 2
    while True:
        radius, turn = c.size * rng.uniform(0.25, 0.4), rng.uniform(0, 2 * math.pi)
        points = []
        for i in range(n):
            angle = turn + 2 * math.pi * (i + rng.uniform(-jitter, jitter)) / n
            r = radius * (1 - rng.uniform(0, jitter))
            points.append((cx + r * math.cos(angle), cy + r * math.sin(angle)))
        if min(_turns(points)) >= 25:
            break
    c.draw.polygon(points, fill=rng.choice(LIGHT_FILLS), outline=c.ink, width=max(2, c.px(0.01)))
    question = rng.choice(("How many sides does the polygon have?", "How many sides does this shape have?"))
    return Problem(question, n, None, {"sides": n, "corners": [[round(x, 1), round(y, 1)] for x, y in points]})


def _turns(points: list[tuple[float, float]]) -> list[float]:
    """How far the outline turns at each corner, in degrees, signed by direction: all positive when convex
    and counter-clockwise in image coordinates' angle order."""
    turns = []
    for i, (x, y) in enumerate(points):
        (px, py), (nx, ny) = points[i - 1], points[(i + 1) % len(points)]
        before, after = math.atan2(y - py, x - px), math.atan2(ny - y, nx - x)
        turns.append(math.degrees((after - before + math.pi) % (2 * math.pi) - math.pi))
    return turns


def triangle_angle(c: Canvas, difficulty: int) -> Problem:
    """Two angles of a triangle are labelled; the third is 180 minus their sum."""
    rng = c.rng
    step, low, high = {1: (10, 30, 80), 2: (5, 25, 100), 3: (1, 20, 110)}[difficulty]
    while True:
        alpha, beta = rng.randrange(low, high + 1, step), rng.randrange(low, high + 1, step)
        gamma = 180 - alpha - beta
        if gamma >= low:
            break
    # A=(0,0), B=(1,0); law of sines gives |AC| = sin(beta) / sin(gamma).
    ac = math.sin(math.radians(beta)) / math.sin(math.radians(gamma))
    raw = [(0.0, 0.0), (1.0, 0.0), (ac * math.cos(math.radians(alpha)), ac * math.sin(math.radians(alpha)))]
    if rng.random() < 0.5:
        raw = [(1.0 - x, y) for x, y in raw]
    xs, ys = [p[0] for p in raw], [p[1] for p in raw]
    scale = min(c.size * 0.66 / (max(xs) - min(xs)), c.size * 0.6 / (max(ys) - min(ys)))
    ox = (c.size - scale * (max(xs) - min(xs))) / 2 - scale * min(xs)
    base_y = c.size * 0.84
    pts = [(ox + scale * x, base_y - scale * y) for x, y in raw]
    c.draw.polygon(pts, fill=rng.choice(LIGHT_FILLS), outline=c.ink, width=max(2, c.px(0.01)))
    centroid = (sum(p[0] for p in pts) / 3, sum(p[1] for p in pts) / 3)
    for (x, y), text, angle in zip(pts, (f"{alpha}°", f"{beta}°", "?"), (alpha, beta, gamma)):
        dx, dy = centroid[0] - x, centroid[1] - y
        norm = math.hypot(dx, dy) or 1.0
        reach = c.px(0.1) + c.px(0.08) * max(0.0, (60 - angle) / 40)  # sharp corners push the label inward
        reach = min(reach, 0.7 * norm)
        c.text((x + dx / norm * reach, y + dy / norm * reach), text, 0.09)
    question = (
        "Two angles of the triangle are labelled. What is the measure of the angle marked '?', in degrees?"
    )
    return Problem(question, gamma, None, {"angles": [alpha, beta, gamma]})
