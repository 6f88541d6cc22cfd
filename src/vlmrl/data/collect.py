"""Steps 1-2 of the data stage: read the source row by row, and keep or drop each row.

A kept row has passed its source's field checks, each of its images (in order) has been normalised and
stored once under `run_dir/data/images/<sha256[:16]>.png`, and its prompt (asking for the config's
`contract`) fits `data.max_prompt_tokens` (when a token counter is given). A dropped row carries a reason
code. Cheap checks run first, so a filtered row never costs a decode; a row is kept only when all of its
images are usable. With `data.holdout_split`, that split's rows follow the training split's, each item's
`metadata["split"]` saying which split it came from.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path

from PIL import Image

from vlmrl.common.io import write_bytes_atomic
from vlmrl.config.schema import Config
from vlmrl.contract import build_prompt_text
from vlmrl.data.images import ImageError, dhash, image_sha256, normalize_image, open_row_image, to_png_bytes
from vlmrl.data.items import Candidate, DataError, Dropped, Item
from vlmrl.data.mathvista import convert_rows
from vlmrl.data.sources import open_rows
from vlmrl.data.synthetic import SyntheticItem, check_families, generate_items

TokenCounter = Callable[[str, list[Image.Image]], int]  # (prompt text, the item's images) -> tokens


def collect_items(
    config: Config,
    run_dir: Path,
    token_counter: TokenCounter | None,
    progress: Callable[[int, int], None] | None,
    converted: dict[str, int],
) -> tuple[list[Item], list[Dropped], dict[str, int]]:
    """Kept items (images stored), dropped rows, and each kept item's dHash, in source order.

    One bad row never stops the loop; `converted` counts rows kept after a repair.
    """
    total, rows = _open(config, converted)
    kept: list[Item] = []
    dropped: list[Dropped] = []
    hashes: dict[str, list[int]] = {}
    seen: set[str] = set()
    for done, row in enumerate(rows, start=1):
        if isinstance(row, Candidate):
            if row.id in seen:
                row = Dropped(row.id, "duplicate_id", "an earlier row has the same id; the first one is kept")
            else:
                seen.add(row.id)
                row = _keep(row, config, run_dir, token_counter, hashes)
        (dropped if isinstance(row, Dropped) else kept).append(row)
        if progress is not None:
            progress(done, total)
    return kept, dropped, hashes


def _open(config: Config, converted: dict[str, int]) -> tuple[int, Iterator[Candidate | Dropped]]:
    data = config.data
    if data.source == "synthetic":
        families = check_families(data.families)
        count = min(data.num_synthetic, data.max_items or data.num_synthetic)
        items = generate_items(
            count, seed=config.run.seed, size=data.image_size, difficulty=data.difficulty, families=families
        )
        return count, (_from_synthetic(s) for s in items)
    if data.holdout_split is not None and data.source == "synthetic":
        raise DataError("data.holdout_split: the synthetic source has no splits; unset it (data.holdout_size "
                        "items are held out of the generated ones).")
    sources = [open_rows(data)] + ([open_rows(data, holdout=True)] if data.holdout_split is not None else [])
    if len(sources) == 2 and sources[0].split in (None, sources[1].split):  # None: every file, the held-out too
        raise DataError(f"data.holdout_split {data.holdout_split!r}: the training rows would include it (data.split "
                        f"{data.split!r} reads {sources[0].split or 'every file'}); set data.split to another split.")
    rows = itertools.chain.from_iterable(convert_rows(s.rows, data, s.name, converted) for s in sources)
    return sum(s.total for s in sources), rows


def _from_synthetic(item: SyntheticItem) -> Candidate:
    metadata = {"family": item.family, "difficulty": item.difficulty, "spec": item.spec}
    return Candidate(
        id=item.id,
        question=item.question,
        answer=item.answer,
        answer_type=item.answer_type,
        precision=item.precision,
        unit=None,
        choices=None,
        source="synthetic",
        category=item.family,
        metadata=json.loads(json.dumps(metadata)),  # tuples -> lists, as they will read back from disk
        images=(item.image,),
    )


def _keep(
    row: Candidate,
    config: Config,
    run_dir: Path,
    token_counter: TokenCounter | None,
    hashes: dict[str, list[int]],
) -> Item | Dropped:
    """Normalise and store the row's images, check the prompt budget; an Item, or why not."""
    data = config.data
    prompt = build_prompt_text(row.question, answer_type=row.answer_type, choices=row.choices,
                               contract=config.contract, template=data.prompt_template)
    images = []
    for number, value in enumerate(row.images, start=1):
        try:
            opened = open_row_image(value, base_dir=row.base_dir)
            images.append(normalize_image(opened, size=data.image_size, policy=data.resize))
        except ImageError as exc:
            where = f"image {number} of {len(row.images)}: " if len(row.images) > 1 else ""
            return Dropped(row.id, exc.reason, where + exc.detail, fix=exc.fix)
    if token_counter is not None:
        try:
            tokens = token_counter(prompt, images)
        except Exception as exc:  # noqa: BLE001  one odd row must not stop the run
            return Dropped(row.id, "token_count_failed", f"{type(exc).__name__}: {exc}")
        if tokens > data.max_prompt_tokens:
            return Dropped(
                row.id,
                "prompt_too_long",
                f"{tokens} tokens > data.max_prompt_tokens={data.max_prompt_tokens}",
            )
    paths, shas = [], []
    for image in images:
        png = to_png_bytes(image)
        sha = image_sha256(png)
        relative = f"data/images/{sha[:16]}.png"
        if not (run_dir / relative).is_file():
            write_bytes_atomic(run_dir / relative, png)
        paths.append(relative)
        shas.append(sha)
    hashes[row.id] = [dhash(image) for image in images]
    return Item(
        id=row.id,
        question=row.question,
        prompt=prompt,
        answer=row.answer,
        answer_type=row.answer_type,
        precision=row.precision,
        unit=row.unit,
        choices=row.choices,
        source=row.source,
        category=row.category,
        images=tuple(paths),
        image_sha256=tuple(shas),
        metadata=row.metadata,
        extra=row.extra,
        system=row.system or data.system_prompt,
    )
