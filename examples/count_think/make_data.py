"""Writes this example's dataset in the EasyR1 / verl layout: `data/train.parquet` and `data/test.parquet`.

Each row has `images` (a list of `{bytes, path}` records, the way `datasets` stores images in Parquet),
`problem` (the question, with an `<image>` marker where the picture goes) and `answer` (a number, or a LaTeX
fraction such as `\\frac{1}{3}`). That is EasyR1's default data format; `config.yaml` maps the three columns,
holds out the file's own `test` split, and asks for the `think` answer form its rewards (from `trl.rewards`)
expect. No id column: vlmrl names the rows by file and row (`test.parquet:3`).

Run from anywhere:  python examples/count_think/make_data.py   (deterministic; rewrites data/ beside it)
"""

from __future__ import annotations

import io
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent
SIZE = 128


def picture(rng: random.Random, black: int, white: int) -> Image.Image:
    """`black` filled and `white` outlined squares on a light background of random blocks (every picture differs,
    so vlmrl's near-duplicate guard keeps train and test pictures apart)."""
    blocks = Image.new("RGB", (8, 8))
    blocks.putdata([tuple(rng.randint(180, 255) for _ in range(3)) for _ in range(64)])
    img = blocks.resize((SIZE, SIZE), Image.Resampling.NEAREST)
    draw = ImageDraw.Draw(img)
    for i in range(black + white):
        x, y = 6 + (i % 3) * 40, 6 + (i // 3) * 40
        draw.rectangle([x, y, x + 28, y + 28], fill=(20, 20, 20) if i < black else None, outline=(20, 20, 20), width=2)
    return img


def row(rng: random.Random, index: int) -> dict:
    """One question: how many squares (an integer), or what fraction of them is black (a LaTeX fraction)."""
    black, white = rng.randint(1, 4), rng.randint(1, 4)
    image = picture(rng, black, white)
    if index % 3 == 2:
        a, b = black, black + white
        problem, answer = "<image>What fraction of the squares are filled black?", f"\\frac{{{a}}}{{{b}}}"
    else:
        problem, answer = "<image>How many squares are in the picture?", str(black + white)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return {"images": [{"bytes": buffer.getvalue(), "path": f"q{index:03d}.png"}], "problem": problem, "answer": answer}


def main(out: Path = HERE / "data", train: int = 24, test: int = 8, seed: int = 11) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("images", pa.list_(image)), ("problem", pa.string()), ("answer", pa.string())])
    for name, count, start in (("train", train, 0), ("test", test, train)):
        rows = [row(rng, start + i) for i in range(count)]
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), out / f"{name}.parquet")
    return out


if __name__ == "__main__":
    print(f"wrote {main()}")
