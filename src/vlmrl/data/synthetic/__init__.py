"""Procedural visual math: charts, geometry figures and function plots, answers exact by construction.

This is the built-in data source (`data.source: synthetic`) that lets `vlmrl run` work offline on a fresh
machine. Item `i` is drawn from `random.Random(f"{seed}:{i}")`, its family is `families[i % len(families)]`,
so item 17 is the same picture whether 20 or 20,000 items are generated, and families are balanced.

Images are drawn with PIL at the target size directly (no resampling, so 128px labels are as crisp as the
font allows). Deliberately left out: matplotlib (tens of ms per figure) and any randomness outside the
per-item generator.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from vlmrl.data.items import DataError
from vlmrl.data.synthetic import charts, geometry, plots
from vlmrl.data.synthetic.canvas import Canvas, Problem, format_number

FAMILIES: dict[str, Callable[[Canvas, int], Problem]] = {
    "bar_value": charts.bar_value,
    "bar_max": charts.bar_max,
    "bar_tallest": charts.bar_tallest,
    "bar_difference": charts.bar_difference,
    "bar_sum": charts.bar_sum,
    "line_value": charts.line_value,
    "function_value": plots.function_value,
    "slope": plots.slope,
    "intercept": plots.intercept,
    "linear_root": plots.linear_root,
    "quadratic_root": plots.quadratic_root,
    "pie_percentage": charts.pie_percentage,
    "scatter_count": charts.scatter_count,
    "pythagoras": geometry.pythagoras,
    "rectangle_area": geometry.rectangle_area,
    "rectangle_perimeter": geometry.rectangle_perimeter,
    "circle_area": geometry.circle_area,
    "circle_circumference": geometry.circle_circumference,
    "triangle_angle": geometry.triangle_angle,
    "polygon_sides": geometry.polygon_sides,
    "table_lookup": charts.table_lookup,
    "count_squares": charts.count_squares,
}


@dataclass(frozen=True)
class SyntheticItem:
    """One generated example, before it is stored: the picture is still in memory."""

    id: str
    family: str
    difficulty: int
    question: str
    answer: str
    answer_type: str  # "integer" | "float"
    precision: int | None
    image: Image.Image = field(repr=False, compare=False)
    spec: dict[str, Any] = field(default_factory=dict)  # the numbers the picture was drawn from


# What an empty `data.families` means: the families of the first data version, in this order (item i's family
# is `families[i % n]`). A family added since is drawn only when named, so the data of a config never change
# because vlmrl gained a family.
DEFAULT_FAMILIES = (
    "bar_value", "bar_max", "bar_difference", "bar_sum", "line_value", "function_value", "slope", "intercept",
    "linear_root", "quadratic_root", "pie_percentage", "scatter_count", "pythagoras", "rectangle_area",
    "rectangle_perimeter", "circle_area", "circle_circumference", "triangle_angle", "table_lookup", "count_squares",
)


def check_families(families: Sequence[str]) -> list[str]:
    """The families to draw from (`DEFAULT_FAMILIES` when empty); an unknown name is an error listing the valid
    ones."""
    unknown = [name for name in families if name not in FAMILIES]
    if unknown:
        raise DataError(
            f"data.families: unknown synthetic family {', '.join(map(repr, unknown))}; "
            f"valid families are: {', '.join(FAMILIES)}."
        )
    return list(families) or list(DEFAULT_FAMILIES)


def generate_item(
    index: int, *, seed: int, size: int, difficulty: int = 1, families: Sequence[str] = ()
) -> SyntheticItem:
    """Item `index` of the stream for `seed`: the same whatever else is generated."""
    if not 1 <= difficulty <= 3:
        raise DataError(f"data.difficulty must be 1, 2 or 3, got {difficulty}.")
    names = check_families(families)
    family = names[index % len(names)]
    rng = random.Random(f"{seed}:{index}")
    canvas = Canvas(size, rng)
    problem = FAMILIES[family](canvas, difficulty)
    if problem.precision is None and not float(problem.value).is_integer():
        raise AssertionError(f"{family} produced a non-integer answer {problem.value} without a precision")
    return SyntheticItem(
        id=f"syn-{family}-{index}",
        family=family,
        difficulty=difficulty,
        question=problem.question,
        answer=format_number(problem.value, problem.precision),
        answer_type="integer" if problem.precision is None else "float",
        precision=problem.precision,
        image=canvas.image,
        spec=problem.spec,
    )


def generate_items(
    count: int, *, seed: int, size: int, difficulty: int = 1, families: Sequence[str] = ()
) -> Iterator[SyntheticItem]:
    """Items 0..count-1, lazily (each picture is made only when asked for)."""
    names = check_families(families)
    for index in range(count):
        yield generate_item(index, seed=seed, size=size, difficulty=difficulty, families=names)
