"""Statistics: exact McNemar values, bootstrap intervals that cover what they should."""

from __future__ import annotations

import doctest
import math

from vlmrl.common import stats


def test_doctests():
    assert doctest.testmod(stats).failed == 0


def test_mcnemar_exact_values():
    # b=3, c=1: P[X<=1] for Binomial(4, 1/2) = 5/16, two-sided 10/16
    assert math.isclose(stats.mcnemar_exact(3, 1), 0.625)
    # symmetric in b and c
    assert stats.mcnemar_exact(1, 3) == stats.mcnemar_exact(3, 1)
    # b=c gives p = 1 (capped)
    assert stats.mcnemar_exact(5, 5) == 1.0
    # 12 vs 2: 2 * (1 + 14 + 91) / 2**14
    assert math.isclose(stats.mcnemar_exact(12, 2), 2 * 106 / 2**14)


def test_bootstrap_interval_contains_mean_and_is_deterministic():
    values = [0, 1] * 50
    lo, hi = stats.bootstrap_ci(values, seed=1)
    assert lo < 0.5 < hi and 0.35 < lo and hi < 0.65
    assert stats.bootstrap_ci(values, seed=1) == (lo, hi)


def test_constant_sample_has_zero_width_interval():
    assert stats.bootstrap_ci([1.0] * 10) == (1.0, 1.0)


def test_paired_interval_excludes_zero_for_a_clear_improvement():
    before = [0.0] * 60 + [1.0] * 40
    after = [1.0] * 60 + [1.0] * 40
    lo, hi = stats.paired_bootstrap_ci(before, after)
    assert lo > 0.45 and hi <= 0.75


def test_empty_sample_is_nan():
    lo, hi = stats.bootstrap_ci([])
    assert math.isnan(lo) and math.isnan(hi)
