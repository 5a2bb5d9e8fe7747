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
    """The mean of `values` and its t-interval: mean +- t(1 - alpha/2, n - 1) * s / sqrt(n),
    with s the sample standard deviation. One value (or values all equal) has no spread to
    measure: the interval is the mean itself (nan for one value, where nothing is known)."""
    n = len(values)
    if n == 0:
        raise ValueError("t_interval: no values")
    mean = math.fsum(values) / n
    if n == 1:
        return Interval(mean, math.nan, math.nan, 1)
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(stats.t.ppf((1 + confidence) / 2, n - 1)) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)
