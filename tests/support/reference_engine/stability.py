"""Stability rules that keep weights from flapping (pure): bounded change, quantisation, hysteresis."""

from __future__ import annotations


def bound(previous: int | None, target: float, max_change: float | None) -> float:
    """``target`` limited to ``[previous / (1 + max_change), previous x (1 + max_change)]``.

    No previous weight, or ``max_change`` None: unchanged.

    >>> bound(100, 500.0, 1.0), bound(100, 10.0, 1.0), bound(None, 7.0, 1.0), bound(100, 500.0, None)
    (200.0, 50.0, 7.0, 500.0)
    """
    if previous is None or previous <= 0 or max_change is None:
        return target
    return min(previous * (1.0 + max_change), max(previous / (1.0 + max_change), target))


def quantize(target: float, step: int) -> int:
    """``target`` rounded to a multiple of ``step`` (>= 1), and at least ``step``.

    >>> quantize(74.9, 1), quantize(75.0, 2), quantize(0.2, 5), quantize(12.4, 5)
    (75, 76, 5, 10)
    """
    step = max(1, step)
    return max(step, int(round(target / step)) * step)


def hold(previous: int | None, target: int, hysteresis: float) -> int:
    """Keep ``previous`` when ``target`` differs from it by at most ``hysteresis`` (0–1, relative).

    >>> hold(100, 95, 0.1), hold(100, 80, 0.1), hold(None, 7, 0.1)
    (100, 80, 7)
    """
    if previous is None or previous <= 0:
        return target
    return previous if abs(target - previous) <= hysteresis * previous else target
