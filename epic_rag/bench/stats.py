"""Statistics for paired policy comparisons: every policy answers the same prompts, so a difference to
`full` is measured per prompt (paired bootstrap, exact McNemar), not between two independent rates.

- `proportion`: a rate with its 95% Wilson interval (sound at small n and at rates near 0 or 1).
- `paired_diff`: mean of x - y over pairs with a paired-bootstrap 95% interval (fixed seed), and for 0/1
  outcomes the exact McNemar p-value (two-sided binomial test on the discordant pairs).
- `mean_ci`: a mean with a bootstrap 95% interval (scores such as F1 against `full`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Z95 = 1.959963984540054  # two-sided 95% normal quantile
RESAMPLES = 10_000
SEED = 0


@dataclass(frozen=True, slots=True)
class Proportion:
    k: int
    n: int
    rate: float  # k / n (NaN when n == 0)
    low: float
    high: float


@dataclass(frozen=True, slots=True)
class PairedDiff:
    n: int  # pairs
    diff: float  # mean of x - y
    low: float  # paired-bootstrap interval of the mean difference
    high: float
    better: int  # pairs with x right and y wrong (0/1 outcomes; else 0)
    worse: int  # pairs with x wrong and y right
    p_value: float  # exact McNemar (0/1 outcomes; else NaN)


@dataclass(frozen=True, slots=True)
class Mean:
    n: int
    mean: float
    low: float
    high: float


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of k successes in n trials; (NaN, NaN) for n == 0."""
    if n == 0:
        return float("nan"), float("nan")
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # at k == 0 or k == n the bound is exactly 0 or 1, which floating point misses by a hair
    return (0.0 if k == 0 else centre - half), (1.0 if k == n else centre + half)


def proportion(outcomes: Sequence[float]) -> Proportion:
    """Rate of 0/1 outcomes with its Wilson interval."""
    n = len(outcomes)
    k = int(round(sum(outcomes)))
    low, high = wilson(k, n)
    return Proportion(k, n, k / n if n else float("nan"), low, high)


def mcnemar_exact(better: int, worse: int) -> float:
    """Two-sided exact McNemar p-value: the discordant pairs against Binomial(better + worse, 1/2)."""
    n = better + worse
    if n == 0:
        return 1.0
    from scipy.stats import binomtest

    return float(binomtest(better, n, 0.5, alternative="two-sided").pvalue)


def _bootstrap_means(values: np.ndarray, resamples: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = len(values)
    out = np.empty(resamples)
    step = max(1, 2_000_000 // max(n, 1))  # bounded memory: resample in blocks of indices
    for s in range(0, resamples, step):
        m = min(step, resamples - s)
        out[s : s + m] = values[rng.integers(0, n, size=(m, n))].mean(axis=1)
    return out


def mean_ci(values: Sequence[float], resamples: int = RESAMPLES, seed: int = SEED, level: float = 0.95) -> Mean:
    """Mean with a percentile-bootstrap interval; NaNs for no values."""
    v = np.asarray(values, dtype=float)
    if len(v) == 0:
        return Mean(0, float("nan"), float("nan"), float("nan"))
    means = _bootstrap_means(v, resamples, seed)
    a = (1 - level) / 2
    return Mean(len(v), float(v.mean()), float(np.quantile(means, a)), float(np.quantile(means, 1 - a)))


def paired_diff(
    x: Sequence[float], y: Sequence[float], resamples: int = RESAMPLES, seed: int = SEED, level: float = 0.95
) -> PairedDiff:
    """x - y over pairs (x[i], y[i]): mean, paired-bootstrap interval and, for 0/1 outcomes, exact McNemar."""
    if len(x) != len(y):
        raise ValueError(f"paired samples differ in length: {len(x)} vs {len(y)}")
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    m = mean_ci(xs - ys, resamples, seed, level)
    binary = bool(np.isin(xs, (0.0, 1.0)).all() and np.isin(ys, (0.0, 1.0)).all())
    better = int(((xs == 1) & (ys == 0)).sum()) if binary else 0
    worse = int(((xs == 0) & (ys == 1)).sum()) if binary else 0
    p = mcnemar_exact(better, worse) if binary else float("nan")
    return PairedDiff(m.n, m.mean, m.low, m.high, better, worse, p)
