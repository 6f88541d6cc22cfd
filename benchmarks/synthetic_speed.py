"""How fast the synthetic generator draws, on one core.

    python benchmarks/synthetic_speed.py [--count 400] [--sizes 512 128] [--difficulty 2]

Prints images/s for drawing alone and for drawing plus what the data stage adds per image (normalise,
PNG-encode, sha256, dHash), then the slowest families. The target is >= 50 images/s per core at 512x512.
"""

from __future__ import annotations

import argparse
import time

from vlmrl.data.images import dhash, image_sha256, normalize_image, to_png_bytes
from vlmrl.data.synthetic import FAMILIES, generate_item


def rate(count: int, work) -> float:
    start = time.perf_counter()
    for index in range(count):
        work(index)
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=400)
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 128])
    parser.add_argument("--difficulty", type=int, default=2)
    args = parser.parse_args()
    for size in args.sizes:
        generate_item(0, seed=0, size=size)  # warm the font cache

        def draw(i: int, size: int = size) -> None:
            generate_item(i, seed=1, size=size, difficulty=args.difficulty)

        def stage(i: int, size: int = size) -> None:
            image = normalize_image(
                generate_item(i, seed=1, size=size, difficulty=args.difficulty).image, size=size
            )
            image_sha256(to_png_bytes(image))
            dhash(image)

        print(
            f"{size}x{size}: draw {rate(args.count, draw):7.0f} images/s | "
            f"draw + normalise + PNG + hashes {rate(args.count, stage):6.0f} images/s"
        )
        per_family = {}
        for name in FAMILIES:
            per_family[name] = rate(
                40,
                lambda i, name=name, size=size: generate_item(
                    i, seed=1, size=size, difficulty=args.difficulty, families=[name]
                ),
            )
        slowest = sorted(per_family.items(), key=lambda kv: kv[1])[:3]
        print("  slowest families: " + ", ".join(f"{name} {value:.0f}/s" for name, value in slowest))


if __name__ == "__main__":
    main()
