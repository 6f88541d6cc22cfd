"""The data stage (`vlmrl prepare`): from `data.source` to the run's train/holdout manifests.

Steps, in order:
  1. read the source (synthetic generator, MathVista, or a column-mapped dataset) row by row;
  2. drop what cannot be used (filtered answer types, missing fields, duplicate ids, bad images, prompts over
     `data.max_prompt_tokens`), each with a reason; normalise and store every kept image once, by sha256;
  3. choose the holdout (reusing the previous one when the data config is unchanged);
  4. remove from train any item whose image is (nearly) a holdout image;
  5. write train.jsonl, holdout.jsonl, dropped.jsonl, then summary.json last (its presence means "complete").

Every input row ends up in exactly one of train, holdout or dropped, and summary.json says so.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from ..config import Config
from ..contract import build_prompt_text
from .images import ImageError, dhash, image_sha256, normalize_image, open_image, to_png_bytes
from .items import Candidate, DataError, Dropped, Item, read_items, write_bytes_atomic, write_json, write_jsonl
from .mathvista import convert_rows
from .sources import open_rows
from .splits import ImageKey, check_no_overlap, choose_holdout, find_contamination
from .synthetic import check_families, generate_items

log = logging.getLogger(__name__)

TokenCounter = Callable[[str, Image.Image], int]
TESTMINI = "mathvista-testmini"
NOT_COMPARABLE = (
    "numbers are not comparable to published MathVista testmini results: training used testmini items "
    "(the holdout is a slice of testmini, and the rest of testmini was trained on)."
)


@dataclass(frozen=True)
class PrepareResult:
    """What the stage wrote, and the numbers a CLI prints."""

    data_dir: Path
    input_rows: int
    num_train: int
    num_holdout: int
    dropped_by_reason: dict[str, int]
    comparable_to_published: bool
    message: str | None
    fingerprint: str
    holdout_reused: bool
    summary: dict[str, Any] = field(repr=False, compare=False)

    @property
    def train_path(self) -> Path:
        return self.data_dir / "train.jsonl"

    @property
    def holdout_path(self) -> Path:
        return self.data_dir / "holdout.jsonl"


def prepare_data(config: Config, run_dir: Path, *, token_counter: TokenCounter | None = None,
                 progress: Callable[[int, int], None] | None = None) -> PrepareResult:  # fmt: skip
    """Write `run_dir/data/` for `config.data`; see the module docstring for the steps."""
    data, run_dir = config.data, Path(run_dir)
    data_dir = run_dir / "data"
    fingerprint = config.data_fingerprint()
    previous_holdout = _previous_holdout(data_dir, fingerprint)

    # step 1-2: every row becomes a kept item (image stored) or a dropped row
    converted: dict[str, int] = {}
    total, rows = _open(config, converted)
    kept: list[Item] = []
    dropped: list[Dropped] = []
    hashes: dict[str, int] = {}  # id -> dHash of the kept items' images
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
    input_rows = len(kept) + len(dropped)
    if not kept:
        raise DataError(f"data.source {data.source!r}: all {input_rows} rows were dropped. {_top_reasons(dropped)}")
    if len(kept) <= data.holdout_size:
        raise DataError(
            f"data.source {data.source!r}: only {len(kept)} usable rows ({len(dropped)} dropped), and "
            f"data.holdout_size={data.holdout_size} would leave nothing to train on. Lower data.holdout_size"
            + (" or raise data.num_synthetic." if data.source == "synthetic" else ".")
        )

    # step 3: the holdout, reused when this config made it before
    holdout_ids = set(choose_holdout([i.id for i in kept], data.holdout_size, config.run.seed, previous_holdout))
    holdout = [i for i in kept if i.id in holdout_ids]
    train = [i for i in kept if i.id not in holdout_ids]
    holdout_reused = bool(previous_holdout) and set(previous_holdout) <= holdout_ids

    # step 4: no holdout image, nor a near-copy of one, in train
    near = data.source != "synthetic"  # template figures (a circle labelled r = 7 vs r = 8) share dHashes
    found = find_contamination([_key(i, hashes) for i in train], [_key(i, hashes) for i in holdout],
                               near_duplicates=near)  # fmt: skip
    contaminated = {c.train_id: c for c in found}
    dropped += [Dropped(c.train_id, "contaminated_holdout", c.detail()) for c in found]
    train = [i for i in train if i.id not in contaminated]
    check_no_overlap(train, holdout)

    # step 5: manifests, then the summary last
    comparable = not (any(i.source == TESTMINI for i in train) and any(i.source == TESTMINI for i in holdout))
    message = None if comparable else NOT_COMPARABLE
    summary = {
        "fingerprint": fingerprint,
        "source": data.source,
        "counts": {"input_rows": input_rows, "train": len(train), "holdout": len(holdout), "dropped": len(dropped)},
        "dropped_by_reason": dict(Counter(d.reason for d in dropped).most_common()),
        "converted": converted,
        "train_by_category": dict(sorted(Counter(i.category for i in train).items())),
        "holdout_by_category": dict(sorted(Counter(i.category for i in holdout).items())),
        "holdout": {"size": len(holdout), "requested": data.holdout_size, "seed": config.run.seed,
                    "reused": holdout_reused},  # fmt: skip
        "contamination_check": "sha256 + dHash <= 4 bits" if near else "sha256 (synthetic figures)",
        "token_budget": _budget_note(token_counter is not None, data.max_prompt_tokens),
        "images": {"stored": len({i.image_sha256 for i in train + holdout}), "size": data.image_size,
                   "resize": data.resize},  # fmt: skip
        "comparable_to_published": comparable,
        "message": message,
    }
    if len(train) + len(holdout) + len(dropped) != input_rows:
        raise AssertionError(f"data stage lost rows: {summary['counts']}")  # a bug here, never the data
    write_jsonl(data_dir / "train.jsonl", (i.to_json() for i in train))
    write_jsonl(data_dir / "holdout.jsonl", (i.to_json() for i in holdout))
    write_jsonl(data_dir / "dropped.jsonl", (d.to_json() for d in dropped))
    _remove_unused_images(data_dir / "images", {Path(i.image).name for i in train + holdout})
    write_json(data_dir / "summary.json", summary)
    if message:
        log.warning(message)
    return PrepareResult(data_dir, input_rows, len(train), len(holdout), summary["dropped_by_reason"], comparable,
                         message, fingerprint, holdout_reused, summary)  # fmt: skip


def load_prepared(run_dir: Path) -> tuple[list[Item], list[Item]]:
    """A run's (train, holdout) items, refusing a pair that overlaps (see `check_no_overlap`)."""
    data_dir = Path(run_dir) / "data"
    train, holdout = read_items(data_dir / "train.jsonl"), read_items(data_dir / "holdout.jsonl")
    check_no_overlap(train, holdout)
    return train, holdout


def _open(config: Config, converted: dict[str, int]) -> tuple[int, Iterator[Candidate | Dropped]]:
    data = config.data
    if data.source == "synthetic":
        families = check_families(data.families)
        count = min(data.num_synthetic, data.max_items or data.num_synthetic)
        items = generate_items(count, seed=config.run.seed, size=data.image_size, difficulty=data.difficulty,
                               families=families)  # fmt: skip
        return count, (_from_synthetic(s) for s in items)
    source = open_rows(data)
    return source.total, convert_rows(source.rows, data, source.name, converted)


def _from_synthetic(item: Any) -> Candidate:
    metadata = {"family": item.family, "difficulty": item.difficulty, "spec": item.spec}
    return Candidate(item.id, item.question, item.answer, item.answer_type, item.precision, None, None,
                     "synthetic", item.family, json.loads(json.dumps(metadata)), item.image)  # fmt: skip


def _keep(row: Candidate, config: Config, run_dir: Path, token_counter: TokenCounter | None,
          hashes: dict[str, int]) -> Item | Dropped:  # fmt: skip
    """Normalise and store the row's image, check the prompt budget; an Item, or why not."""
    data = config.data
    prompt = build_prompt_text(row.question)
    try:
        image = normalize_image(open_image(row.image, base_dir=row.base_dir), size=data.image_size,
                                policy=data.resize)  # fmt: skip
    except ImageError as exc:
        return Dropped(row.id, exc.reason, exc.detail)
    if token_counter is not None:
        try:
            tokens = token_counter(prompt, image)
        except Exception as exc:  # one odd row must not stop the run; a systematic failure shows in the counts
            return Dropped(row.id, "token_count_failed", f"{type(exc).__name__}: {exc}")
        if tokens > data.max_prompt_tokens:
            return Dropped(row.id, "prompt_too_long", f"{tokens} tokens > data.max_prompt_tokens={data.max_prompt_tokens}")
    png = to_png_bytes(image)
    sha = image_sha256(png)
    relative = f"data/images/{sha[:16]}.png"
    if not (run_dir / relative).is_file():
        write_bytes_atomic(run_dir / relative, png)
    hashes[row.id] = dhash(image)
    return Item(row.id, row.question, prompt, row.answer, row.answer_type, row.precision, row.unit, row.choices,
                row.source, row.category, relative, sha, row.metadata)  # fmt: skip


def _key(item: Item, hashes: dict[str, int]) -> ImageKey:
    return ImageKey(item.id, item.image_sha256, hashes[item.id])


def _previous_holdout(data_dir: Path, fingerprint: str) -> list[str]:
    """Holdout ids of an earlier run of this stage with the same data config, else []."""
    try:
        summary = json.loads((data_dir / "summary.json").read_text())
        if summary.get("fingerprint") != fingerprint:
            return []
        return [item.id for item in read_items(data_dir / "holdout.jsonl")]
    except (OSError, ValueError) as exc:  # absent or damaged: choose afresh
        log.debug("no reusable holdout in %s (%s)", data_dir, exc)
        return []


def _top_reasons(dropped: list[Dropped], n: int = 5) -> str:
    counts = Counter(d.reason for d in dropped).most_common(n)
    example = {d.reason: d.detail for d in reversed(dropped)}
    reasons = "; ".join(f"{reason}: {count} (e.g. {example[reason]})" for reason, count in counts)
    return f"Top reasons: {reasons}. See the data config (data.source, data.answer_types, data.columns)."


def _budget_note(checked: bool, limit: int) -> dict[str, Any]:
    if checked:
        return {"checked": True, "max_prompt_tokens": limit, "note": "prompts counted with the model's processor"}
    return {"checked": False, "max_prompt_tokens": limit,
            "note": "no token counter was given: prompt lengths were not checked against data.max_prompt_tokens"}  # fmt: skip


def _remove_unused_images(images_dir: Path, used: set[str]) -> None:
    """Images of rows dropped late (contaminated) or left by an earlier run with another config."""
    if not images_dir.is_dir():
        return
    for path in images_dir.iterdir():
        if path.is_file() and path.name not in used and (path.suffix == ".png" or path.name.endswith(".tmp")):
            path.unlink()
