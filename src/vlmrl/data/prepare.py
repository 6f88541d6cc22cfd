"""The data stage (`vlmrl prepare`): from `data.source` to the run's train/holdout manifests.

Steps, in order:
  1. read the source (synthetic generator, MathVista, or a column-mapped dataset) row by row;
  2. drop what cannot be used (filtered answer types, missing fields, duplicate ids, bad images, prompts over
     `data.max_prompt_tokens`), each with a reason; normalise and store every kept image once, by sha256;
  3. choose the holdout (reusing the previous one when the data config is unchanged), from the training split
     or, with `data.holdout_split`, from that split (its items past `data.holdout_size` are dropped);
  4. remove from train any item any of whose images is (nearly) a holdout item's image (`data.contamination`);
  5. write train.jsonl, holdout.jsonl, dropped.jsonl, then summary.json last (its presence means "complete").

Every input row ends up in exactly one of train, holdout or dropped, and summary.json says so, with the drop
table (`vlmrl.data.drops`: each reason, its count, an example and the fix). Only MathVista sources say
whether their numbers compare with published MathVista figures (`comparable_to_published`; None otherwise).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmrl.common.io import write_json_atomic, write_jsonl_atomic
from vlmrl.config.schema import Config
from vlmrl.data.collect import TokenCounter, collect_items
from vlmrl.data.drops import drop_table
from vlmrl.data.images import PIXEL_TOLERANCE, THUMB_SIDE, pixel_difference, thumbnail
from vlmrl.data.items import DataError, Dropped, Item, read_items
from vlmrl.data.splits import ImageKey, check_no_overlap, choose_holdout, find_contamination

log = logging.getLogger(__name__)

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
    comparable_to_published: bool | None  # None: not a MathVista source, nothing to compare with
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


def prepare_data(
    config: Config,
    run_dir: Path,
    *,
    token_counter: TokenCounter | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> PrepareResult:
    """Write `run_dir/data/` for `config.data`; see the module docstring for the steps.

    `token_counter(prompt_text, images)` counts a prompt's tokens with the model's processor (image tokens
    included); without one, prompt lengths are not checked and summary.json says so.
    """
    from vlmrl.run.claim import mark_if_new

    data, run_dir = config.data, Path(run_dir)
    mark_if_new(run_dir)  # a folder the Python API starts is a run folder, as one `vlmrl prepare` starts
    data_dir = run_dir / "data"
    fingerprint = config.data_fingerprint()
    previous_holdout = _previous_holdout(data_dir, fingerprint)

    # step 1-2: every row becomes a kept item (image stored) or a dropped row
    converted: dict[str, int] = {}
    if progress is None:
        from vlmrl.common.progress import counter

        progress = counter("prepare: reading rows and normalising images")
    kept, dropped, hashes = collect_items(config, run_dir, token_counter, progress, converted)
    _check_enough(config, data_dir, kept, dropped)

    # step 3: the holdout, reused when this config made it before
    pool = [i.id for i in kept if data.holdout_split is None or i.metadata.get("split") == data.holdout_split]
    holdout_ids = set(choose_holdout(pool, data.holdout_size, config.run.seed, previous_holdout))
    if data.holdout_split is not None:  # the held-out split's other items: neither trained on nor evaluated
        kept, spare = _set_aside(kept, set(pool) - holdout_ids)
        dropped += [Dropped(i.id, "beyond_holdout_size", f"split {data.holdout_split!r} has {len(pool)} usable "
                            f"items; data.holdout_size={data.holdout_size} of them are held out") for i in spare]
        _check_holdout_split(config, data_dir, len(pool), dropped)
    holdout = [i for i in kept if i.id in holdout_ids]
    train = [i for i in kept if i.id not in holdout_ids]
    reused = bool(previous_holdout) and set(previous_holdout) <= holdout_ids

    # step 4: no holdout image, nor a near-copy of one, in train
    mode = contamination_mode(config)
    keys = {i.id: [ImageKey(i.id, s, h) for s, h in zip(i.image_sha256, hashes[i.id])] for i in kept}
    found = [] if mode == "off" else find_contamination(
        [k for i in train for k in keys[i.id]], [k for i in holdout for k in keys[i.id]],
        near_duplicates=mode == "near", max_distance=data.contamination_max_distance,
        pixels=_stored_pixels(data_dir / "images"),
    )
    found = list({c.train_id: c for c in reversed(found)}.values())[::-1]  # one drop per item: its first image
    dropped += [Dropped(c.train_id, "contaminated_holdout", c.detail()) for c in found]
    contaminated = {c.train_id for c in found}
    train = [i for i in train if i.id not in contaminated]
    check_no_overlap(train, holdout, images=mode != "off")
    _check_trainable(config, data_dir, len(train), len(holdout), dropped)

    # step 5: manifests, then the summary last
    summary = _summary(config, fingerprint, train, holdout, dropped, converted)
    summary["holdout"]["reused"] = reused
    summary["contamination"] = mode
    summary["contamination_check"] = _contamination_note(config, mode)
    summary["token_budget"] = _budget_note(token_counter is not None, data.max_prompt_tokens)
    write_jsonl_atomic(data_dir / "train.jsonl", (i.to_json() for i in train))
    write_jsonl_atomic(data_dir / "holdout.jsonl", (i.to_json() for i in holdout))
    write_jsonl_atomic(data_dir / "dropped.jsonl", (d.to_json() for d in dropped))
    _remove_unused_images(data_dir / "images", {Path(p).name for i in train + holdout for p in i.images})
    write_json_atomic(data_dir / "summary.json", summary)
    if summary["message"]:
        log.warning(summary["message"])
    counts = summary["counts"]
    return PrepareResult(
        data_dir=data_dir,
        input_rows=counts["input_rows"],
        num_train=counts["train"],
        num_holdout=counts["holdout"],
        dropped_by_reason=summary["dropped_by_reason"],
        comparable_to_published=summary["comparable_to_published"],
        message=summary["message"],
        fingerprint=fingerprint,
        holdout_reused=reused,
        summary=summary,
    )


def load_prepared(run_dir: Path) -> tuple[list[Item], list[Item]]:
    """A run's (train, holdout) items, refusing a pair that overlaps (see `check_prepared`)."""
    data_dir = Path(run_dir) / "data"
    train, holdout = read_items(data_dir / "train.jsonl"), read_items(data_dir / "holdout.jsonl")
    check_prepared(run_dir, train, holdout)
    return train, holdout


def check_prepared(run_dir: Path, train: list[Item], holdout: list[Item]) -> None:
    """`check_no_overlap` as the run's data were prepared: shared ids always refused, shared images unless
    prepared with `data.contamination: off` (summary.json says)."""
    try:
        mode = json.loads((Path(run_dir) / "data" / "summary.json").read_text()).get("contamination")
    except (OSError, ValueError, AttributeError):
        mode = None
    check_no_overlap(train, holdout, images=mode != "off")


def contamination_mode(config: Config) -> str:
    """`data.contamination` with `auto` resolved: exact for synthetic figures, near for everything else."""
    mode = config.data.contamination
    if mode == "auto":  # template figures (a circle labelled r = 7 vs r = 8) differ in a few pixels only
        return "exact" if config.data.source == "synthetic" else "near"
    return mode


def _contamination_note(config: Config, mode: str) -> str:
    if mode == "near":
        return (f"sha256 + dHash <= {config.data.contamination_max_distance} bits, confirmed by pixels "
                f"({THUMB_SIDE}x{THUMB_SIDE}, within {PIXEL_TOLERANCE} levels)")
    if mode == "exact":
        return "sha256 (synthetic figures)" if config.data.source == "synthetic" else "sha256 (data.contamination: exact)"
    return "off (data.contamination: off): training items may show held-out pictures"


def _stored_pixels(images_dir: Path) -> Callable[[str, str], int]:
    """`images.pixel_difference` of two stored pictures, named by sha256 (thumbnails cached: the pairs the
    hash picks are few, and a holdout picture is compared again and again)."""
    from functools import lru_cache

    from PIL import Image

    @lru_cache(maxsize=4096)
    def thumb(sha: str) -> Any:
        with Image.open(images_dir / f"{sha[:16]}.png") as img:
            return thumbnail(img)

    return lambda a, b: pixel_difference(thumb(a), thumb(b))


def _set_aside(kept: list[Item], ids: set[str]) -> tuple[list[Item], list[Item]]:
    return [i for i in kept if i.id not in ids], [i for i in kept if i.id in ids]


def _check_holdout_split(config: Config, data_dir: Path, usable: int, dropped: list[Dropped]) -> None:
    if usable:
        return
    write_jsonl_atomic(data_dir / "dropped.jsonl", (d.to_json() for d in dropped))
    raise DataError(f"data.holdout_split {config.data.holdout_split!r}: no usable row in that split. "
                    f"{_top_reasons(dropped)} Every row and its reason: {data_dir / 'dropped.jsonl'}.")


def _check_enough(config: Config, data_dir: Path, kept: list[Item], dropped: list[Dropped]) -> None:
    """Refuse data that leaves nothing to train on; the drop report is written first so it can be read."""
    data = config.data
    if kept and (len(kept) > data.holdout_size or data.holdout_split is not None):
        return
    write_jsonl_atomic(data_dir / "dropped.jsonl", (d.to_json() for d in dropped))
    if not kept and not dropped:
        split = f" (split {data.split!r})" if data.split else ""
        raise DataError(f"data.source {data.source!r}{split} has no rows: the file is empty or holds only a header "
                        "line. Add rows, or point data.source at the data.")
    if not kept:
        raise DataError(
            f"data.source {data.source!r}: all {len(dropped)} rows were dropped. {_top_reasons(dropped)} "
            f"Every row and its reason: {data_dir / 'dropped.jsonl'}."
        )
    raise DataError(
        f"data.source {data.source!r}: only {len(kept)} usable rows ({len(dropped)} dropped), and "
        f"data.holdout_size={data.holdout_size} would leave nothing to train on. Lower data.holdout_size"
        + (" or raise data.num_synthetic." if data.source == "synthetic" else ".")
    )


def min_train_items(config: Config, world: int = 1) -> int:
    """Prompts in one generation batch: a training set smaller than this gives TRL no step to take.

    >>> from vlmrl.config.schema import load_config
    >>> min_train_items(load_config("demo", ["train.per_device_train_batch_size=8", "train.num_generations=4",
    ...                                      "train.gradient_accumulation_steps=2"]))
    4
    """
    t = config.train
    completions = t.per_device_train_batch_size * world * (t.steps_per_generation or t.gradient_accumulation_steps)
    return max(1, completions // t.num_generations)


def _check_trainable(config: Config, data_dir: Path, n_train: int, n_holdout: int, dropped: list[Dropped]) -> None:
    """Refuse a training set (after the holdout and the contamination filter) smaller than one generation
    batch; the drop report is written first so it can be read."""
    need = min_train_items(config)
    if n_train >= need:
        return
    write_jsonl_atomic(data_dir / "dropped.jsonl", (d.to_json() for d in dropped))
    reasons = _top_reasons(dropped) if dropped else "No row was dropped."
    raise DataError(
        f"data.source {config.data.source!r}: {n_train} training items left ({n_holdout} held out, "
        f"{len(dropped)} dropped), fewer than one generation batch ({need} prompts: per_device_train_batch_size x "
        f"steps_per_generation / num_generations), so training could take no step. {reasons} "
        f"Lower data.holdout_size or the batch size, or supply more data (drops: {data_dir / 'dropped.jsonl'})."
    )


def _summary(
    config: Config,
    fingerprint: str,
    train: list[Item],
    holdout: list[Item],
    dropped: list[Dropped],
    converted: dict[str, int],
) -> dict[str, Any]:
    data = config.data
    input_rows = len(train) + len(holdout) + len(dropped)  # every row lands in exactly one of the three
    comparable = None  # a claim about MathVista's published figures: made for MathVista sources only
    if any(i.source.startswith("mathvista-") for i in train + holdout):
        comparable = not (any(i.source == TESTMINI for i in train) and any(i.source == TESTMINI for i in holdout))
    return {
        "fingerprint": fingerprint,
        "source": data.source,
        "counts": {
            "input_rows": input_rows,
            "train": len(train),
            "holdout": len(holdout),
            "dropped": len(dropped),
        },
        "dropped_by_reason": dict(Counter(d.reason for d in dropped).most_common()),
        "drops": drop_table(dropped),
        "answer_types": dict(sorted(Counter(i.answer_type for i in train + holdout).items())),
        "converted": converted,
        "train_by_category": dict(sorted(Counter(i.category for i in train).items())),
        "holdout_by_category": dict(sorted(Counter(i.category for i in holdout).items())),
        "holdout": {"size": len(holdout), "requested": data.holdout_size, "seed": config.run.seed,
                    "split": data.holdout_split},
        "images": {
            "stored": len({s for i in train + holdout for s in i.image_sha256}),
            "size": data.image_size,
            "resize": data.resize,
        },
        "comparable_to_published": comparable,
        "message": NOT_COMPARABLE if comparable is False else None,
    }


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
        return {
            "checked": True,
            "max_prompt_tokens": limit,
            "note": "prompts counted with the model's processor",
        }
    return {
        "checked": False,
        "max_prompt_tokens": limit,
        "note": "no token counter was given: prompt lengths were not checked against data.max_prompt_tokens",
    }


def _remove_unused_images(images_dir: Path, used: set[str]) -> None:
    """Images of rows dropped late (contaminated) or left by an earlier run with another config."""
    if not images_dir.is_dir():
        return
    for path in images_dir.iterdir():
        if path.is_file() and path.name not in used and (path.suffix == ".png" or path.name.endswith(".tmp")):
            path.unlink()
