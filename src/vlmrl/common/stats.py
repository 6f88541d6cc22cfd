"""Small, exact statistics for held-out sets of ~100 items: bootstrap intervals and McNemar's exact test.

Numpy only; every function is deterministic for its seed so a report regenerated from the same records
shows the same intervals.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import numpy as np

BOOTSTRAP_SAMPLES = 10_000


def bootstrap_ci(values: Sequence[float], *, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean. (nan, nan) for an empty sample."""
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        return (math.nan, math.nan)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, data.size, size=(BOOTSTRAP_SAMPLES, data.size))
    means = data[idx].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, 1 - (1 - level) / 2])
    return (float(lo), float(hi))


def paired_bootstrap_ci(
    before: Sequence[float], after: Sequence[float], *, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Interval of mean(after - before), resampling items (pairs stay together)."""
    if len(before) != len(after):
        raise ValueError(f"paired samples differ in length: {len(before)} vs {len(after)}")
    diff = np.asarray(after, dtype=float) - np.asarray(before, dtype=float)
    return bootstrap_ci(diff, seed=seed, level=level)


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts b (0->1) and c (1->0).

    Under H0 the discordant pairs split Binomial(b + c, 1/2); p = min(1, 2 * P[X <= min(b, c)]).

    >>> mcnemar_exact(0, 0)
    1.0
    >>> round(mcnemar_exact(10, 0), 6)
    0.001953
    """
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else math.nan


def finite(value: object) -> bool:
    """A real number that is a finite float: neither NaN nor infinite, nor too large for a float (a bool is
    not a number here).

    >>> finite(0.5), finite(float("nan")), finite(True), finite("1"), finite(10**400)
    (True, False, False, False, False)
    """
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond the float range
        return False
