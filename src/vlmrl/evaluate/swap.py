"""The visual control's image swap: each held-out item shown another item's image(s), by a fixed derangement.

The swap is a fixed derangement: within each family (record `category`) of >= 2 items, a seeded random
single cycle (Sattolo's algorithm), so no item keeps its own image and the question still matches the kind of
figure; the items of single-item families are deranged among themselves (cross-family, counted). The same seed
and held-out set give the same swap on every machine.

Public: `derangement`, `swap_images`, `VisualControlError`.
"""

from __future__ import annotations

import random

IMAGE_FIELDS = ("images", "image", "image_sha256")


class VisualControlError(RuntimeError):
    """The control cannot be run or computed from these items; the message names the file and the fix."""


def derangement(items: list[dict], seed: int) -> dict[str, str]:
    """Item id -> the id of the item whose image it is shown: no item keeps its own, within family where it can.

    >>> items = [{"id": f"a{k}", "category": "a"} for k in range(3)] + [{"id": "b0", "category": "b"}]
    >>> d = derangement(items, 0)
    >>> sorted(d) == ["a0", "a1", "a2", "b0"], all(k != v for k, v in d.items()), d == derangement(items, 0)
    (True, True, True)
    >>> sorted(d[k] for k in ("a0", "a1", "a2")), d["b0"][0]  # a family's images stay in it; a lone item borrows
    (['a0', 'a1', 'a2'], 'a')
    """
    if len(items) < 2:
        raise VisualControlError("the visual control needs at least 2 held-out items to swap images between.")
    groups: dict[str, list[str]] = {}
    for item in items:
        groups.setdefault(str(item.get("category") or "unknown"), []).append(item["id"])
    donors: dict[str, str] = {}
    lonely: list[str] = []
    for name in sorted(groups):
        ids = groups[name]
        if len(ids) < 2:
            lonely += ids
            continue
        donors.update(_cycle(ids, random.Random(f"{seed}:{name}")))
    if len(lonely) >= 2:
        donors.update(_cycle(lonely, random.Random(f"{seed}:cross-family")))
    elif lonely:  # one item alone in its family and no other alone: it borrows the first other item's image
        only = lonely[0]
        donors[only] = next(item["id"] for item in items if item["id"] != only)
    return donors


def _cycle(ids: list[str], rng: random.Random) -> dict[str, str]:
    """A uniformly random single cycle over `ids` (Sattolo): every id maps to another one.

    >>> c = _cycle(["x", "y", "z"], random.Random(1)); sorted(c.values()), any(k == v for k, v in c.items())
    (['x', 'y', 'z'], False)
    """
    order = list(ids)
    for i in range(len(order) - 1, 0, -1):
        j = rng.randrange(i)  # j < i, never i itself: this is what makes one cycle, hence no fixed point
        order[i], order[j] = order[j], order[i]
    return {ids[k]: order[k] for k in range(len(ids))}


def swap_images(items: list[dict], donors: dict[str, str]) -> list[dict]:
    """Copies of `items` whose image fields are their donor's, each naming its donor in `image_from`."""
    by_id = {item["id"]: item for item in items}
    out = []
    for item in items:
        donor = by_id[donors[item["id"]]]
        swapped = {k: v for k, v in item.items() if k not in IMAGE_FIELDS}
        swapped.update({k: donor[k] for k in IMAGE_FIELDS if k in donor}, image_from=donor["id"])
        out.append(swapped)
    return out


