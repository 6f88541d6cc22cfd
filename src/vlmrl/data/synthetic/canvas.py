"""Drawing helpers shared by the synthetic families: a styled canvas, scaled fonts, and chart axes.

Everything is drawn with PIL's ImageDraw at the target size directly (matplotlib is ~50x slower per image),
and every length is a fraction of the canvas side so a chart drawn at 128x128 has the same layout as at
512x512. Text sizes have a floor so labels stay legible on the demo's 128px images.

PIL's bundled font (Aileron) has no glyphs for superscripts, pi or the unicode minus: formulas in images are
written in ASCII (`x^2`, `-`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from functools import lru_cache

from PIL import Image, ImageDraw, ImageFont

Color = tuple[int, int, int]

PALETTE: tuple[Color, ...] = (
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (23, 160, 180),
    (160, 160, 20),
    (90, 90, 90),
)
BACKGROUNDS: tuple[Color, ...] = ((255, 255, 255), (246, 246, 246), (252, 249, 240), (242, 247, 255))
INKS: tuple[Color, ...] = ((0, 0, 0), (40, 40, 40), (20, 30, 70))
GRID: Color = (205, 205, 205)
MIN_FONT_PX = 10  # below this the bundled font stops being readable


@lru_cache(maxsize=128)
def _font(px: int) -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=px)  # cached: building a FreeType face costs ~1 ms


@dataclass
class Canvas:
    """A square image with a random but legible style (background, ink, colours, font scale)."""

    size: int
    rng: random.Random
    background: Color = field(init=False)
    ink: Color = field(init=False)
    font_scale: float = field(init=False)
    image: Image.Image = field(init=False)
    draw: ImageDraw.ImageDraw = field(init=False)

    def __post_init__(self) -> None:
        self.background = self.rng.choice(BACKGROUNDS)
        self.ink = self.rng.choice(INKS)
        self.font_scale = self.rng.uniform(0.9, 1.15)
        self.image = Image.new("RGB", (self.size, self.size), self.background)
        self.draw = ImageDraw.Draw(self.image)

    def px(self, fraction: float) -> int:
        return round(self.size * fraction)

    def font(self, fraction: float) -> ImageFont.FreeTypeFont:
        return _font(max(MIN_FONT_PX, round(self.size * fraction * self.font_scale)))

    def text(
        self,
        xy: tuple[float, float],
        text: str,
        fraction: float = 0.09,
        *,
        anchor: str = "mm",
        fill: Color | None = None,
        max_width: float | None = None,
        boxed: bool = False,
    ) -> None:
        """Draw text; `max_width` shrinks the font (not below the legibility floor) so neighbours don't
        collide, `boxed` paints the background behind it so grid lines don't cut through digits."""
        font = self.font(fraction)
        max_width = self.size * 0.98 if max_width is None else max_width
        while font.size > MIN_FONT_PX and font.getlength(text) > max_width:
            font = _font(font.size - 1)
        if boxed:
            left, top, right, bottom = self.draw.textbbox(xy, text, font=font, anchor=anchor)
            self.draw.rectangle([left - 1, top - 1, right + 1, bottom + 1], fill=self.background)
        self.draw.text(xy, text, font=font, fill=fill or self.ink, anchor=anchor)

    def colors(self, n: int) -> list[Color]:
        """n distinct palette colours, or one colour n times (single-series charts look like that too)."""
        if self.rng.random() < 0.4:
            return [self.rng.choice(PALETTE)] * n
        if n > len(PALETTE):
            return [self.rng.choice(PALETTE) for _ in range(n)]
        return self.rng.sample(PALETTE, n)

    def line_width(self) -> int:
        return max(1, self.px(0.008))


@dataclass
class Axes:
    """A plot area in pixels and the data range it shows."""

    canvas: Canvas
    left: int
    top: int
    right: int
    bottom: int
    x_range: tuple[float, float]
    y_range: tuple[float, float]

    def to_px(self, x: float, y: float) -> tuple[float, float]:
        (x0, x1), (y0, y1) = self.x_range, self.y_range
        px = self.left + (x - x0) / (x1 - x0) * (self.right - self.left)
        py = self.bottom - (y - y0) / (y1 - y0) * (self.bottom - self.top)
        return px, py

    def draw_y_ticks(self, ticks: list[float], *, grid: bool, fraction: float = 0.07) -> None:
        c = self.canvas
        for value in ticks:
            _, y = self.to_px(self.x_range[0], value)
            if grid:
                c.draw.line([(self.left, y), (self.right, y)], fill=GRID, width=1)
            c.draw.line([(self.left - c.px(0.012), y), (self.left, y)], fill=c.ink, width=c.line_width())
            c.text((self.left - c.px(0.02), y), format_number(value), fraction, anchor="rm")

    def draw_x_ticks(self, ticks: list[tuple[float, str]], *, grid: bool, fraction: float = 0.07) -> None:
        c = self.canvas
        for value, label in ticks:
            x, _ = self.to_px(value, self.y_range[0])
            if grid:
                c.draw.line([(x, self.top), (x, self.bottom)], fill=GRID, width=1)
            c.text((x, self.bottom + c.px(0.02)), label, fraction, anchor="mt")

    def draw_frame(self) -> None:
        c = self.canvas
        width = c.line_width()
        c.draw.line(
            [(self.left, self.top), (self.left, self.bottom), (self.right, self.bottom)],
            fill=c.ink,
            width=width,
        )


def chart_axes(
    canvas: Canvas, x_range: tuple[float, float], y_range: tuple[float, float], *, title_space: float = 0.12
) -> Axes:
    """Axes that leave room for y tick labels on the left, x labels below and a title line on top."""
    return Axes(
        canvas,
        left=canvas.px(0.17 + canvas.rng.uniform(0, 0.03)),
        top=canvas.px(title_space + canvas.rng.uniform(0, 0.03)),
        right=canvas.px(0.95 - canvas.rng.uniform(0, 0.03)),
        bottom=canvas.px(0.85 - canvas.rng.uniform(0, 0.03)),
        x_range=x_range,
        y_range=y_range,
    )


def nice_step(span: float, target_ticks: int = 5) -> float:
    """A 1-2-5 tick step giving about `target_ticks` ticks over `span`."""
    raw = span / max(1, target_ticks)
    magnitude = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    for multiple in (1, 2, 2.5, 5, 10):
        if raw <= multiple * magnitude:
            return multiple * magnitude
    return 10 * magnitude


def ticks_between(low: float, high: float, step: float) -> list[float]:
    first = math.ceil(low / step - 1e-9)
    last = math.floor(high / step + 1e-9)
    return [round(k * step, 6) for k in range(first, last + 1)]


def format_number(value: float, precision: int | None = None) -> str:
    """`3` not `3.0`; floats with exactly `precision` decimals when given; ASCII minus."""
    if precision is not None:
        return f"{value:.{precision}f}"
    if float(value).is_integer():
        return str(int(value))
    return f"{value:g}"


def place_boxes(
    rng: random.Random,
    count: int,
    sizes: list[int],
    area: tuple[int, int, int, int],
    gap: int,
    attempts: int = 400,
) -> list[tuple[int, int, int]] | None:
    """Non-overlapping square boxes (x, y, side) inside area=(left, top, right, bottom), or None."""
    left, top, right, bottom = area
    placed: list[tuple[int, int, int]] = []
    for side in sizes[:count]:
        for _ in range(attempts):
            x = rng.randint(left, max(left, right - side))
            y = rng.randint(top, max(top, bottom - side))
            if all(
                x + side + gap <= px or px + ps + gap <= x or y + side + gap <= py or py + ps + gap <= y
                for px, py, ps in placed
            ):
                placed.append((x, y, side))
                break
        else:
            return None
    return placed


@dataclass(frozen=True)
class Problem:
    """What a family returns after drawing: the question, the exact answer, and the facts it was built from
    (kept in the item's metadata so any answer can be audited against the drawing)."""

    question: str
    value: float
    precision: int | None = None  # None: an integer answer
    spec: dict = field(default_factory=dict)
