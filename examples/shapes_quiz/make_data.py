"""Writes this example's dataset: `data/quiz.jsonl` plus the PNG images it names, beside it.

A small visual quiz with every answer type vlmrl grades (integer, float, choice, expression, text), and one
question in five that shows two pictures. The file uses its own column names on purpose (`qid`, `ask`, `gold`,
`kind`, `options`, `pictures`) and carries one extra column (`level`): `config.yaml` maps the names, and the
extra column reaches the reward functions as a keyword argument (see `rewards.py`).

Run from anywhere:  python examples/shapes_quiz/make_data.py   (deterministic; rewrites data/ beside it)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent
SIZE = 128
COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220)}


def canvas(rng: random.Random) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    """A light background of random pastel blocks: every picture differs from every other, as real figures do,
    so vlmrl's contamination guard (which also matches near-duplicate pictures) keeps them apart."""
    blocks = Image.new("RGB", (8, 8))
    blocks.putdata([tuple(rng.randint(170, 255) for _ in range(3)) for _ in range(64)])
    img = blocks.resize((SIZE, SIZE), Image.Resampling.NEAREST)
    return img, ImageDraw.Draw(img)


def squares(rng: random.Random, n: int) -> Image.Image:
    img, draw = canvas(rng)
    for i in range(n):
        x, y = 8 + (i % 3) * 40, 8 + (i // 3) * 40
        draw.rectangle([x, y, x + 28, y + 28], fill=(30, 30, 30))
    return img


def row(rng: random.Random, index: int, out: Path) -> dict:
    """One quiz row; its pictures are saved under `out/images/`."""
    kind = ("integer", "float", "choice", "expression", "text", "integer")[index % 6]
    pictures: list[Image.Image] = []
    options = None
    if kind == "integer" and index % 12 == 5:  # two pictures: count across both
        a, b = rng.randint(1, 3), rng.randint(1, 3)
        pictures = [squares(rng, a), squares(rng, b)]
        ask, gold = "How many black squares are there in the two pictures together?", str(a + b)
    elif kind == "integer":
        n = rng.randint(1, 5)
        pictures = [squares(rng, n)]
        ask, gold = "How many black squares are in the picture?", str(n)
    elif kind == "float":
        height = rng.randint(10, 90) / 10  # 1.0 .. 9.0 units, one decimal
        img, draw = canvas(rng)
        top = SIZE - 10 - int(height * 12)
        draw.rectangle([50, top, 78, SIZE - 10], fill=(60, 60, 200))
        draw.text((4, 4), f"h = {height:.1f}", fill=(0, 0, 0))
        pictures = [img]
        ask, gold = "What height is written above the bar? Answer with one decimal.", f"{height:.1f}"
    elif kind == "choice":
        name = rng.choice(sorted(COLORS))
        img, draw = canvas(rng)
        draw.ellipse([24, 24, 104, 104], fill=COLORS[name])
        pictures, options = [img], ["red", "green", "blue"]
        ask, gold = "What colour is the disc?", name
    elif kind == "expression":
        r = rng.randint(2, 6)
        img, draw = canvas(rng)
        draw.ellipse([14, 14, 114, 114], outline=(0, 0, 0), width=2)
        draw.line([64, 64, 114, 64], fill=(0, 0, 0), width=2)
        draw.text((80, 48), f"r={r}", fill=(0, 0, 0))
        pictures = [img]
        ask, gold = "What is the area of the circle? Give an exact expression.", f"{r * r}\\pi"
    else:  # text
        shape = rng.choice(["triangle", "square", "circle"])
        img, draw = canvas(rng)
        if shape == "triangle":
            draw.polygon([(64, 14), (14, 114), (114, 114)], fill=(0, 0, 0))
        elif shape == "square":
            draw.rectangle([24, 24, 104, 104], fill=(0, 0, 0))
        else:
            draw.ellipse([24, 24, 104, 104], fill=(0, 0, 0))
        pictures = [img]
        ask, gold = "Which shape is drawn: triangle, square or circle?", shape
    names = []
    for k, picture in enumerate(pictures):
        name = f"images/q{index:03d}_{k}.png"
        picture.save(out / name)
        names.append(name)
    record = {"qid": f"q{index:03d}", "ask": ask, "gold": gold, "kind": kind, "pictures": names,
              "level": 1 + index % 3}
    if options is not None:
        record["options"] = options
    return record


def main(out: Path = HERE / "data", count: int = 96, seed: int = 7) -> Path:
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = [row(rng, i, out) for i in range(count)]
    path = out / "quiz.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


if __name__ == "__main__":
    print(f"wrote {main()}")
