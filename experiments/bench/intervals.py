"""How sure a speed ratio is: ours over a peer round by round, a bootstrap interval, a verdict.

Chunk i of every variant runs in round i of the schedule, close together in time, so the ratio of
two variants' chunks in one round cancels how fast the machine was in that round. The estimate is
the geometric mean of those per-round ratios (the mean of their logarithms: ours/peer and peer/ours
then agree, and with a dozen rounds it is a tighter estimate than their median, whose bootstrap jumps
between a few order statistics); its 95% interval is the percentile bootstrap over rounds (rounds
drawn with replacement, a fixed seed, so the same rounds always give the same interval).
Ours is ahead of a peer when the whole interval of ours/peer lies above 1.0, behind when it lies
below 1.0, and tied with it when it holds 1.0.
"""

from __future__ import annotations

import numpy as np

LEVEL = 0.95
RESAMPLES = 10_000
RANDOM_SEED = 0
AHEAD, TIE, BEHIND = "ahead", "tie", "behind"


def per_round(ours_seconds: list[float], other_seconds: list[float]) -> list[float]:
    """Ours' speed over the other's, one ratio a round (chunk seconds: theirs / ours)."""
    return [theirs / mine for mine, theirs in zip(ours_seconds, other_seconds)]


def bootstrap_interval(
    values: list[float], *, level: float = LEVEL, resamples: int = RESAMPLES, seed: int = RANDOM_SEED
) -> tuple[float, float]:
    """The percentile bootstrap interval of the geometric mean of `values` (positive, at least one)."""
    logs = np.log(np.asarray(values, dtype=float))
    rng = np.random.default_rng(seed)
    means = logs[rng.integers(0, len(logs), size=(resamples, len(logs)))].mean(axis=1)
    tail = (1.0 - level) / 2 * 100
    low, high = np.exp(np.percentile(means, [tail, 100 - tail]))
    return float(low), float(high)


def geometric_mean(values: list[float]) -> float:
    return float(np.exp(np.log(np.asarray(values, dtype=float)).mean()))


def verdict(low: float, high: float) -> str:
    """Ours against a peer, from the interval of ours/peer: ahead above 1.0, behind below it, else a tie."""
    if low > 1.0:
        return AHEAD
    if high < 1.0:
        return BEHIND
    return TIE


def summary(ours_seconds: list[float], other_seconds: list[float]) -> dict | None:
    """The per-round ratios, their geometric mean, min-max and 95% interval (width too) and the verdict;
    None when either variant has no chunks."""
    ratios = per_round(ours_seconds, other_seconds)
    if not ratios:
        return None
    low, high = bootstrap_interval(ratios)
    return {
        "geomean": geometric_mean(ratios),
        "low": low,
        "high": high,
        "width": high - low,
        "min": min(ratios),
        "max": max(ratios),
        "rounds": len(ratios),
        "per_round": ratios,
        "verdict": verdict(low, high),
    }
