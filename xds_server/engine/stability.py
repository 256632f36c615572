"""Stability rules that keep weights from flapping."""

from __future__ import annotations


def hold(previous: int | None, target: int, hysteresis: float) -> int:
    """Keep ``previous`` when ``target`` differs from it by at most ``hysteresis`` (0–1, relative).

    >>> hold(100, 95, 0.1), hold(100, 80, 0.1), hold(None, 7, 0.1)
    (100, 80, 7)
    """
    if previous is None or previous <= 0:
        return target
    return previous if abs(target - previous) <= hysteresis * previous else target
