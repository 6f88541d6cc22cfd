"""The procedural generator: exact answers, determinism, families, difficulty, legibility floor and speed."""

from __future__ import annotations

import math
import time
from collections import deque
from fractions import Fraction

import numpy as np
import pytest

from vlmrl.data.images import to_png_bytes
from vlmrl.data.items import DataError
from vlmrl.data.synthetic import DEFAULT_FAMILIES, FAMILIES, check_families, generate_item, generate_items
from vlmrl.data.synthetic.canvas import MIN_FONT_PX, Canvas

REQUIRED = {
    "bar_value",
    "bar_max",
    "bar_difference",
    "bar_sum",
    "line_value",
    "function_value",
    "slope",
    "intercept",
    "linear_root",
    "quadratic_root",
    "pie_percentage",
    "scatter_count",
    "pythagoras",
    "rectangle_area",
    "rectangle_perimeter",
    "circle_area",
    "circle_circumference",
    "triangle_angle",
    "table_lookup",
    "count_squares",
    "bar_tallest",
    "polygon_sides",
}


def items_of(family: str, n: int = 12, *, difficulty: int = 1, size: int = 128, seed: int = 0):
    return [
        generate_item(i, seed=seed, size=size, difficulty=difficulty, families=[family]) for i in range(n)
    ]


def value(item) -> float:
    return float(item.answer)


def test_all_required_families_exist():
    assert set(FAMILIES) == REQUIRED


@pytest.mark.parametrize("difficulty", [1, 2, 3])
@pytest.mark.parametrize("size", [128, 512])
def test_every_family_produces_a_well_formed_item(size, difficulty):
    for index, family in enumerate(FAMILIES):
        item = generate_item(index, seed=difficulty, size=size, difficulty=difficulty, families=list(FAMILIES))
        assert item.family == family and item.id == f"syn-{family}-{index}"
        assert item.image.size == (size, size) and item.image.mode == "RGB"
        assert item.question.endswith("?") or item.question.endswith(".")
        number = float(item.answer)
        if item.precision is None:
            assert item.answer_type == "integer" and item.answer == str(int(number))
        else:
            assert item.answer_type == "float" and item.answer == f"{number:.{item.precision}f}"
            assert item.precision in (1, 2)
        np_img = np.asarray(item.image)
        assert np_img.std() > 5, f"{family} drew an (almost) blank image"


# --- exact answers, from the numbers the generator drew -----------------------------------------


def test_bar_families_answer_from_their_bars():
    for item in items_of("bar_value"):
        assert value(item) == item.spec["bars"][item.spec["target"]]
    for item in items_of("bar_max"):
        assert value(item) == max(item.spec["bars"].values())
    for item in items_of("bar_difference", difficulty=3):
        bars = item.spec["bars"]
        assert value(item) == pytest.approx(bars[item.spec["larger"]] - bars[item.spec["smaller"]])
        assert value(item) > 0
    for item in items_of("bar_sum", difficulty=3):
        assert value(item) == pytest.approx(sum(item.spec["bars"].values()))
    for item in items_of("bar_value", difficulty=1):
        assert all(1 <= v <= 10 and float(v).is_integer() for v in item.spec["bars"].values())
        assert 3 <= len(item.spec["bars"]) <= 4


def test_line_value():
    for item in items_of("line_value", difficulty=3):
        assert value(item) == item.spec["points"][str(item.spec["target_x"])]


def test_pie_missing_share_is_100_minus_the_rest():
    for item in items_of("pie_percentage", difficulty=2):
        shares = item.spec["shares"]
        others = sum(v for k, v in shares.items() if k != item.spec["target"])
        assert value(item) == pytest.approx(100 - others)
        assert sum(shares.values()) == pytest.approx(100)


def test_pythagoras_3_4_5_and_decimals():
    easy = items_of("pythagoras", 40)
    three_four = [it for it in easy if sorted(it.spec["legs"]) == [3, 4]]
    assert three_four, "difficulty 1 should draw the 3-4-5 triangle among 40 items"
    assert all(it.answer == "5" and it.answer_type == "integer" for it in three_four)
    for item in easy:
        assert value(item) == math.hypot(*item.spec["legs"])
    for item in items_of("pythagoras", difficulty=3):
        expected = math.hypot(*item.spec["legs"])
        assert item.answer == (str(int(expected)) if expected.is_integer() else f"{expected:.2f}")


def test_rectangles_and_circles():
    for item in items_of("rectangle_area", difficulty=3):
        assert item.answer == f"{item.spec['width'] * item.spec['height']:.2f}" and item.precision == 2
    for item in items_of("rectangle_perimeter"):
        assert value(item) == 2 * (item.spec["width"] + item.spec["height"])
    for item in items_of("circle_area", difficulty=2):
        assert item.answer == f"{math.pi * item.spec['radius'] ** 2:.2f}" and item.precision == 2
    for item in items_of("circle_circumference", difficulty=3):
        assert item.answer == f"{2 * math.pi * item.spec['radius']:.2f}"


def test_triangle_angle_is_the_remainder_of_180():
    for difficulty in (1, 2, 3):
        for item in items_of("triangle_angle", difficulty=difficulty):
            alpha, beta, gamma = item.spec["angles"]
            assert alpha + beta + gamma == 180 and value(item) == gamma


def test_table_lookup_value_or_row_sum():
    for item in items_of("table_lookup", 20, difficulty=2):
        rows, cols, cells = item.spec["rows"], item.spec["columns"], item.spec["cells"]
        row = rows.index(item.question.split("row ")[1][0])
        if "sum" in item.question:
            assert value(item) == sum(cells[row])
        else:
            col = cols.index(item.question.split("column ")[1].rstrip("?"))
            assert value(item) == cells[row][col]


def test_function_plots():
    for difficulty in (1, 2, 3):
        for item in items_of("function_value", difficulty=difficulty):
            coeffs = [Fraction(c) for c in item.spec["coefficients"]]
            x = item.spec["x"]
            expected = sum(k * x ** (len(coeffs) - 1 - i) for i, k in enumerate(coeffs))
            assert value(item) == float(expected)
    for difficulty in (1, 3):
        for family in ("slope", "intercept", "linear_root"):
            for item in items_of(family, difficulty=difficulty):
                (x1, y1), (x2, y2) = item.spec["points"]
                m = Fraction(y2 - y1, x2 - x1)
                b = y1 - m * x1
                assert Fraction(item.spec["slope"]) == m and Fraction(item.spec["intercept"]) == b
                expected = {"slope": m, "intercept": b, "linear_root": -b / m}[family]
                assert value(item) == pytest.approx(float(expected))
    for item in items_of("quadratic_root", difficulty=3):
        assert value(item) == max(item.spec["roots"])


def _count_components(mask: np.ndarray) -> int:
    seen = np.zeros_like(mask, dtype=bool)
    count = 0
    for start in zip(*np.nonzero(mask)):
        if seen[start]:
            continue
        count += 1
        queue = deque([start])
        seen[start] = True
        while queue:
            y, x = queue.popleft()
            for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1] and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    queue.append((ny, nx))
    return count


def test_count_squares_draws_exactly_the_answer():
    counts = set()
    for item in items_of("count_squares", 15):
        pixels = np.asarray(item.image).astype(int)
        background = pixels[0, 0]
        mask = np.abs(pixels - background).sum(axis=2) > 0
        assert _count_components(mask) == int(item.answer) == item.spec["squares"]
        assert item.question == "How many squares are there?"
        counts.add(int(item.answer))
    assert counts <= {1, 2, 3, 4, 5} and len(counts) >= 3


def test_scatter_count_matches_spec():
    for item in items_of("scatter_count", difficulty=3):
        assert value(item) == item.spec["points"] and 7 <= value(item) <= 15


def test_bar_tallest_is_the_position_of_a_bar_that_stands_out():
    positions = set()
    for difficulty in (1, 2, 3):
        for item in items_of("bar_tallest", 15, difficulty=difficulty, size=256):
            heights = list(item.spec["bars"].values())
            top, second = max(heights), sorted(heights)[-2]
            assert int(item.answer) == heights.index(top) + 1 and item.precision is None
            assert list(item.spec["bars"])[int(item.answer) - 1] == item.spec["tallest"]
            assert top - second >= top / 10 - 1e-9  # visible without reading a label
            positions.add(int(item.answer))
    assert len(positions) >= 4


def test_polygon_sides_draws_a_convex_polygon_with_that_many_visible_corners():
    from vlmrl.data.synthetic.geometry import _turns

    seen = set()
    for difficulty, top in ((1, 6), (2, 8), (3, 10)):
        for item in items_of("polygon_sides", 40, difficulty=difficulty, size=256):
            corners = [tuple(xy) for xy in item.spec["corners"]]
            assert int(item.answer) == item.spec["sides"] == len(corners) and 3 <= len(corners) <= top
            turns = _turns(corners)
            # convex (every turn the same way), each corner a real corner, and the outline closes once
            assert min(turns) >= 24.9 and abs(sum(turns) - 360) < 1e-6
            pixels = np.asarray(item.image).astype(int)
            assert (np.abs(pixels - pixels[0, 0]).sum(axis=2) > 0).sum() > 200  # drawn, not blank
            seen.add(len(corners))
    assert seen == set(range(3, 11))


def test_empty_families_means_the_first_data_versions_twenty():
    """An empty `data.families` is pinned: a family added later does not change any config's data."""
    assert check_families([]) == list(DEFAULT_FAMILIES) and len(DEFAULT_FAMILIES) == 20
    assert set(FAMILIES) - set(DEFAULT_FAMILIES) == {"bar_tallest", "polygon_sides"}
    stream = list(generate_items(22, seed=0, size=128))
    assert [i.family for i in stream] == [*DEFAULT_FAMILIES, *DEFAULT_FAMILIES[:2]]


# --- determinism, selection, knobs ---------------------------------------------------------------


def test_same_seed_same_items_and_bytes_different_seed_different():
    first = list(generate_items(25, seed=7, size=128))
    again = list(generate_items(25, seed=7, size=128))
    other = list(generate_items(25, seed=8, size=128))
    assert [(a.id, a.question, a.answer, a.spec) for a in first] == [
        (a.id, a.question, a.answer, a.spec) for a in again
    ]
    assert [to_png_bytes(a.image) for a in first] == [to_png_bytes(a.image) for a in again]
    differing = sum(to_png_bytes(a.image) != to_png_bytes(b.image) for a, b in zip(first, other))
    assert differing >= 23


def test_item_i_does_not_depend_on_how_many_are_generated():
    few = list(generate_items(3, seed=1, size=128))
    many = list(generate_items(30, seed=1, size=128))
    assert [to_png_bytes(a.image) for a in few] == [to_png_bytes(a.image) for a in many[:3]]
    single = generate_item(17, seed=1, size=128)
    assert to_png_bytes(single.image) == to_png_bytes(many[17].image) and single.answer == many[17].answer


def test_family_selection_round_robin_and_unknown_family():
    items = list(generate_items(6, seed=0, size=128, families=["pythagoras", "bar_sum"]))
    assert [i.family for i in items] == ["pythagoras", "bar_sum"] * 3
    with pytest.raises(DataError, match="bar_chart.*valid families"):
        list(generate_items(1, seed=0, size=128, families=["bar_chart"]))
    with pytest.raises(DataError, match="difficulty"):
        generate_item(0, seed=0, size=128, difficulty=4)


def test_harder_items_have_decimals_and_more_parts():
    easy = list(generate_items(100, seed=0, size=256, difficulty=1))
    hard = list(generate_items(100, seed=0, size=256, difficulty=3))
    assert all(i.answer_type == "integer" for i in easy if not i.family.startswith("circle"))
    assert sum(i.answer_type == "float" for i in hard) > sum(i.answer_type == "float" for i in easy) + 15
    assert {i.precision for i in hard} == {None, 1, 2}


def test_labels_have_a_legibility_floor_at_128px():
    import random

    canvas = Canvas(128, random.Random(0))
    assert canvas.font(0.05).size >= MIN_FONT_PX
    assert canvas.font(0.1).size >= 12  # main labels are ~10% of the side


def test_speed_512px():
    generate_item(0, seed=0, size=512)  # warm the font cache
    n = 40
    start = time.perf_counter()
    for index in range(n):
        generate_item(index, seed=3, size=512, difficulty=2)
    rate = n / (time.perf_counter() - start)
    print(f"synthetic generation: {rate:.0f} images/s at 512x512 on one core")
    assert rate >= 25
