"""Stability rules that keep weights from flapping (pure, element-wise over float arrays; a scalar
works too): bounded change, quantisation, hysteresis. A previous weight of ``NaN`` (or ``None``) is
"none"."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike


def bound(previous: ArrayLike, target: ArrayLike, max_change: float | None) -> np.ndarray:
    """``target`` limited to ``[previous / (1 + max_change), previous x (1 + max_change)]``.

    No previous weight (NaN, or <= 0), or ``max_change`` None: unchanged.

    >>> [float(bound(p, t, 1.0)) for p, t in ((100, 500.0), (100, 10.0), (None, 7.0))], float(bound(100, 500.0, None))
    ([200.0, 50.0, 7.0], 500.0)
    """
    previous, target = np.asarray(previous, dtype=float), np.asarray(target, dtype=float)
    if max_change is None:
        return target
    grow = 1.0 + max_change
    return np.where(previous > 0, np.minimum(previous * grow, np.maximum(previous / grow, target)), target)


def quantize(target: ArrayLike, step: int) -> np.ndarray:
    """``target`` rounded to a multiple of ``step`` (>= 1; halves to even, as ``round``), and at least ``step``.

    >>> [float(quantize(t, s)) for t, s in ((74.9, 1), (75.0, 2), (0.2, 5), (12.4, 5))]
    [75.0, 76.0, 5.0, 10.0]
    """
    step = max(1, step)
    # Past 2**52 every float is an integer already (and far above any weight an Envoy accepts).
    return np.maximum(step, np.rint(np.minimum(np.asarray(target, dtype=float) / step, 2.0**52)) * step)


def hold(previous: ArrayLike, target: ArrayLike, hysteresis: float) -> np.ndarray:
    """Keep ``previous`` when ``target`` differs from it by at most ``hysteresis`` (0–1, relative).

    >>> [float(hold(p, t, 0.1)) for p, t in ((100, 95), (100, 80), (None, 7))]
    [100.0, 80.0, 7.0]
    """
    previous, target = np.asarray(previous, dtype=float), np.asarray(target, dtype=float)
    with np.errstate(invalid="ignore"):
        return np.where((previous > 0) & (np.abs(target - previous) <= hysteresis * previous), previous, target)
