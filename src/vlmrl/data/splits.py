"""The held-out split, and the guard that keeps its images out of training.

Holdout choice: every usable id is ranked by sha256(f"{seed}:holdout:{id}") and the first `holdout_size` are
held out. Ranking by a per-id hash (instead of shuffling a list) means adding or dropping other rows never
changes which of the remaining ids are held out; a previous holdout is kept first when it is reused.

Contamination guard: a training item any of whose stored images equals a holdout item's image (same sha256
after normalisation: the same pixels), or, in near mode, is a near-duplicate of one (64-bit dHash within
`max_distance` bits, then every pixel of 32x32 thumbnails within `images.PIXEL_TOLERANCE`: re-encodes,
resizes, small brightness changes), is removed from TRAIN. The hash only picks the pairs to compare: simple
drawings on white share hashes. The holdout is never touched, so evaluation ids stay stable.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from vlmrl.data.images import PIXEL_TOLERANCE
from vlmrl.data.items import DataError, Item

NEAR_DUPLICATE_BITS = 4


@dataclass(frozen=True)
class ImageKey:
    """What the guard compares: an item's id, its stored image's sha256, and its dHash."""

    id: str
    sha256: str
    dhash: int


@dataclass(frozen=True)
class Contamination:
    train_id: str
    holdout_id: str
    kind: str  # "exact" (same sha256) | "near" (dHash distance <= max_distance, pixels within tolerance)
    distance: int
    pixels: int | None = None  # the pixel difference that confirmed a near copy (None: not compared)

    def detail(self) -> str:
        if self.kind == "exact":
            return f"same image as holdout item {self.holdout_id}"
        pixels = f", pixels within {self.pixels} levels" if self.pixels is not None else ""
        return f"near-duplicate of holdout item {self.holdout_id}'s image (dHash distance {self.distance}{pixels})"


def choose_holdout(ids: Sequence[str], size: int, seed: int, previous: Sequence[str] = ()) -> list[str]:
    """`size` ids to hold out: the still-present `previous` ones first, then the lowest-ranked others."""
    available = set(ids)
    kept = [i for i in dict.fromkeys(previous) if i in available][:size]
    chosen = set(kept)
    ranked = sorted((i for i in ids if i not in chosen), key=lambda i: _rank(seed, i))
    return kept + ranked[: size - len(kept)]


def find_contamination(
    train: Sequence[ImageKey],
    holdout: Sequence[ImageKey],
    *,
    near_duplicates: bool = True,
    max_distance: int = NEAR_DUPLICATE_BITS,
    pixels: Callable[[str, str], int] | None = None,
    tolerance: int = PIXEL_TOLERANCE,
) -> list[Contamination]:
    """Training items whose image is in the holdout, exactly or (when `near_duplicates`) nearly.

    `pixels(train_sha256, holdout_sha256)` measures two stored pictures (`images.pixel_difference`): a pair
    within `max_distance` dHash bits is a near copy only when it gives at most `tolerance`. Without it, the
    hash alone decides."""
    if not holdout:
        return []
    by_sha = {key.sha256: key.id for key in holdout}
    hashes = np.array([key.dhash for key in holdout], dtype=np.uint64)  # [H]
    found = []
    for key in train:
        if key.sha256 in by_sha:
            found.append(Contamination(key.id, by_sha[key.sha256], "exact", 0))
        elif near_duplicates:
            distances = _popcount(hashes ^ np.uint64(key.dhash))  # [H]
            close = np.flatnonzero(distances <= max_distance)  # candidates, nearest hash first
            for index in close[np.argsort(distances[close], kind="stable")]:
                other = holdout[int(index)]
                difference = pixels(key.sha256, other.sha256) if pixels is not None else None
                if difference is None or difference <= tolerance:
                    found.append(Contamination(key.id, other.id, "near", int(distances[index]), difference))
                    break
    return found


def check_no_overlap(train_items: Sequence[Item], holdout_items: Sequence[Item], *, images: bool = True) -> None:
    """Refuse a train/holdout pair that shares an id or (unless `images` is False: `data.contamination: off`)
    an image: evaluation on it would flatter the model."""
    holdout_ids = {item.id for item in holdout_items}
    holdout_images = {sha: item.id for item in holdout_items for sha in item.image_sha256} if images else {}
    shared_ids = [item.id for item in train_items if item.id in holdout_ids]
    shared_images = [
        (item.id, holdout_images[sha])
        for item in train_items
        for sha in dict.fromkeys(item.image_sha256)
        if sha in holdout_images
    ]
    if not shared_ids and not shared_images:
        return
    problems = []
    if shared_ids:
        problems.append(
            f"{len(shared_ids)} id(s) in both train and holdout (e.g. {', '.join(shared_ids[:5])})"
        )
    if shared_images:
        pairs = ", ".join(f"{t} ~ {h}" for t, h in shared_images[:5])
        problems.append(f"{len(shared_images)} training image(s) identical to holdout images (e.g. {pairs})")
    raise DataError(
        "train and holdout overlap: " + "; ".join(problems) + ". Held-out results would not be held out. "
        "Re-run `vlmrl prepare` (its contamination guard removes such items from train)."
    )


def _rank(seed: int, item_id: str) -> str:
    return hashlib.sha256(f"{seed}:holdout:{item_id}".encode()).hexdigest()


def _popcount(values: np.ndarray) -> np.ndarray:
    bits = np.unpackbits(values.astype(">u8").view(np.uint8).reshape(-1, 8), axis=1)  # [H, 64]
    return bits.sum(axis=1)
