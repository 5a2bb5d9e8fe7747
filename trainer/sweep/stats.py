"""What a setting's runs say together: the mean of its metric over its seeds or folds, and
the 95% confidence interval of that mean (Student's t, n - 1 degrees of freedom)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from scipy import stats

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """The mean of `values` and its t-interval, scipy's: t(n - 1) around the mean, scaled by
    the standard error of the mean. One value (or values all equal) has no spread to measure:
    the interval is the mean itself (nan for one value, where nothing is known); scipy's
    t-distribution takes no zero scale."""
    n = len(values)
    if n == 0:
        raise ValueError("t_interval: no values")
    mean = math.fsum(values) / n
    if n == 1:
        return Interval(mean, math.nan, math.nan, 1)
    standard_error = float(stats.sem(values))
    if standard_error == 0:
        return Interval(mean, mean, mean, n)
    low, high = stats.t.interval(confidence, n - 1, loc=mean, scale=standard_error)
    return Interval(mean, float(low), float(high), n)
