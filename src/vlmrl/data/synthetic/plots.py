"""Synthetic function-plot families: values, slopes, intercepts and roots on a gridded coordinate plane.

Slopes and roots are kept as `Fraction`s until the very end, so a slope of 3/4 is the gold "0.75" with
precision 2, never 0.7499999. Labelled points always have integer coordinates, so what is printed on the
image is exactly what the answer was computed from.
"""

from __future__ import annotations

from fractions import Fraction

from vlmrl.data.synthetic.canvas import GRID, Axes, Canvas, Problem, format_number

EXTENT = 6  # the plane shows x and y in [-6, 6]: unit squares stay >= 8 px at 128x128


def _plane(c: Canvas) -> Axes:
    """A square-ish coordinate plane with unit gridlines, bold axes and a few tick labels."""
    axes = Axes(c, c.px(0.06), c.px(0.16), c.px(0.94), c.px(0.96), (-EXTENT, EXTENT), (-EXTENT, EXTENT))
    for k in range(-EXTENT, EXTENT + 1):
        x, y = axes.to_px(k, k)
        c.draw.line([(x, axes.top), (x, axes.bottom)], fill=GRID, width=1)
        c.draw.line([(axes.left, y), (axes.right, y)], fill=GRID, width=1)
    ox, oy = axes.to_px(0, 0)
    c.draw.line([(axes.left, oy), (axes.right, oy)], fill=c.ink, width=c.line_width())
    c.draw.line([(ox, axes.top), (ox, axes.bottom)], fill=c.ink, width=c.line_width())
    for k in (-4, -2, 2, 4) if c.size >= 256 else (-4, 4):  # fewer labels where they would crowd
        x, y = axes.to_px(k, k)
        c.text((x, oy + c.px(0.012)), str(k), 0.06, anchor="mt")
        c.text((ox - c.px(0.012), y), str(k), 0.06, anchor="rm")
    return axes


def _curve(axes: Axes, f, color) -> None:
    """Draw y = f(x) across the plane, broken where it leaves the visible range."""
    c = axes.canvas
    segment: list[tuple[float, float]] = []
    for i in range(121):
        x = -EXTENT + 2 * EXTENT * i / 120
        y = float(f(x))
        if -EXTENT <= y <= EXTENT:
            segment.append(axes.to_px(x, y))
            continue
        if len(segment) > 1:
            c.draw.line(segment, fill=color, width=max(2, c.px(0.012)))
        segment = []
    if len(segment) > 1:
        c.draw.line(segment, fill=color, width=max(2, c.px(0.012)))


def _mark(axes: Axes, x: int, y: int, color) -> None:
    c = axes.canvas
    px, py = axes.to_px(x, y)
    r = max(3, c.px(0.016))
    c.draw.ellipse([px - r, py - r, px + r, py + r], fill=color)
    right_side = px > c.size * 0.6
    anchor = "rb" if right_side else "lb"
    c.text((px + (-r if right_side else r), py - r), f"({x}, {y})", 0.075, anchor=anchor, boxed=True)


def _poly_text(coeffs: list[Fraction | int]) -> str:
    """ASCII polynomial from the highest degree down: [1, -5, 6] -> 'x^2 - 5x + 6'."""
    degree = len(coeffs) - 1
    out = ""
    for power, k in zip(range(degree, -1, -1), coeffs):
        if k == 0:
            continue
        magnitude = abs(k)
        body = "" if (magnitude == 1 and power > 0) else format_number(float(magnitude))
        body += {0: "", 1: "x"}.get(power, f"x^{power}")
        if not out:
            out = ("-" if k < 0 else "") + body
        else:
            out += f" {'-' if k < 0 else '+'} {body}"
    return out or "0"


def _decimals(value: Fraction) -> int | None:
    """None for an integer, else the decimals a terminating fraction needs (1/2 -> 1, 3/4 -> 2)."""
    for places in range(4):
        if (value * 10**places).denominator == 1:
            return places or None
    raise ValueError(f"{value} does not terminate within 3 decimals")


def _answer(value: Fraction, question: str, spec: dict) -> Problem:
    return Problem(question, float(value), _decimals(value), spec)


def function_value(c: Canvas, difficulty: int) -> Problem:
    rng = c.rng
    if difficulty == 1:
        coeffs = [Fraction(rng.choice([-3, -2, -1, 1, 2, 3])), Fraction(rng.randint(-4, 4))]
    else:
        lead = rng.choice([1, -1] if difficulty == 2 else [Fraction(1, 2), Fraction(-1, 2), 1, -1, 2])
        coeffs = [Fraction(lead), Fraction(rng.randint(-3, 3)), Fraction(rng.randint(-4, 4))]

    def f(x):
        return sum(k * x ** (len(coeffs) - 1 - i) for i, k in enumerate(coeffs))

    axes = _plane(c)
    _curve(axes, f, c.colors(1)[0])
    c.text((c.px(0.06), c.px(0.075)), f"f(x) = {_poly_text(coeffs)}", 0.085, anchor="lm")
    x = rng.choice([k for k in range(-4, 5) if k != 0])
    question = rng.choice(("What is f({})?", "What is the value of f at x = {}?")).format(x)
    return _answer(f(Fraction(x)), question, {"coefficients": [str(k) for k in coeffs], "x": x})


def _line(c: Canvas, difficulty: int, family: str) -> tuple[Fraction, Fraction, list[tuple[int, int]]]:
    """A slope, an intercept and two labelled integer points on the line, suited to `family`."""
    rng = c.rng
    slopes = {1: [1, 2, 3], 2: [-3, -2, -1, 1, 2, 3]}.get(difficulty)
    if slopes is None:
        slopes = [Fraction(n, d) for n in (-3, -1, 1, 3) for d in (2, 4)] + [-2, 2, 3]
    while True:
        m, b = Fraction(rng.choice(slopes)), Fraction(rng.randint(-4, 4))
        if family == "linear_root":
            root = -b / m
            if b == 0 or abs(root) > EXTENT - 1 or (root * (1 if difficulty < 3 else 100)).denominator != 1:
                continue  # on the plane, and an integer (or a 2-decimal number when hard)
        points = [
            (x, int(m * x + b))
            for x in range(-EXTENT + 1, EXTENT)
            if (m * x + b).denominator == 1 and abs(m * x + b) <= EXTENT - 1 and x != 0 and m * x + b != 0
        ]
        if len(points) >= 2:
            first, second = sorted(rng.sample(points, 2))
            if second[0] - first[0] >= 2:
                return m, b, [first, second]


def _line_problem(c: Canvas, difficulty: int, family: str) -> tuple[Fraction, Fraction, list]:
    m, b, points = _line(c, difficulty, family)
    axes = _plane(c)
    color = c.colors(1)[0]
    _curve(axes, lambda x: m * Fraction(x) + b, color)
    for x, y in points:
        _mark(axes, x, y, color)
    c.text((c.size / 2, c.px(0.075)), c.rng.choice(("Line through two points", "A straight line", "")), 0.08)
    return m, b, points


def slope(c: Canvas, difficulty: int) -> Problem:
    m, b, points = _line_problem(c, difficulty, "slope")
    return _answer(
        m, "What is the slope of the line?", {"slope": str(m), "intercept": str(b), "points": points}
    )


def intercept(c: Canvas, difficulty: int) -> Problem:
    m, b, points = _line_problem(c, difficulty, "intercept")
    question = "At what y-value does the line cross the y-axis?"
    return _answer(b, question, {"slope": str(m), "intercept": str(b), "points": points})


def linear_root(c: Canvas, difficulty: int) -> Problem:
    m, b, points = _line_problem(c, difficulty, "linear_root")
    question = "At what x-value does the line cross the x-axis?"
    return _answer(-b / m, question, {"slope": str(m), "intercept": str(b), "points": points})


def quadratic_root(c: Canvas, difficulty: int) -> Problem:
    rng = c.rng
    r1, r2 = sorted(rng.sample(range(-4, 5), 2))
    lead = Fraction(rng.choice({1: [1], 2: [1, -1], 3: [1, -1, 2, -2]}[difficulty]))
    coeffs = [lead, -lead * (r1 + r2), lead * r1 * r2]
    axes = _plane(c)
    _curve(axes, lambda x: lead * (x - r1) * (x - r2), c.colors(1)[0])
    c.text((c.px(0.06), c.px(0.075)), f"y = {_poly_text(coeffs)}", 0.085, anchor="lm")
    question = "The curve crosses the x-axis twice. What is the larger x-value where it crosses?"
    return _answer(Fraction(r2), question, {"coefficients": [str(k) for k in coeffs], "roots": [r1, r2]})
