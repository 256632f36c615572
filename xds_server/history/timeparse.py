"""Times and durations in history queries: ``10m``, ``1h30m`` and RFC 3339 timestamps."""

from __future__ import annotations

import re
from datetime import datetime

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION = re.compile(r"(?:\d+(?:ms|s|m|h|d|w))+")
_PART = re.compile(r"(\d+)(ms|s|m|h|d|w)")
# RFC 3339 section 5.6 date-time: a full date, "T" (or a space, as the RFC allows), a time, an offset.
_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})")


def parse_duration(text: str) -> float:
    """A duration such as ``90s``, ``10m``, ``1h30m``, ``2d``, ``500ms`` (Prometheus style) -> seconds.

    Units: ms, s, m, h, d, w; integers only; several parts add up. Raises ``ValueError`` (with an
    example of the expected form) for anything else, and for a zero duration.
    """
    if not _DURATION.fullmatch(text):
        raise ValueError(f"expected a duration such as 30s, 10m, 1h30m or 2d, got {text!r}")
    seconds = sum(int(n) * _UNITS[u] for n, u in _PART.findall(text))
    if seconds <= 0:
        raise ValueError(f"expected a duration longer than 0, got {text!r}")
    return seconds


def parse_time(text: str, now: float) -> float:
    """A point in time -> Unix seconds: a duration ago (``10m`` = ``now - 600``) or an RFC 3339 timestamp.

    RFC 3339 needs the offset (``2026-01-02T03:04:05Z``, ``...+02:00``). Raises ``ValueError``
    naming both accepted forms.
    """
    if _RFC3339.fullmatch(text):
        try:
            return datetime.fromisoformat(text.upper().replace("Z", "+00:00")).timestamp()
        except ValueError as err:
            raise ValueError(f"not a valid RFC 3339 time: {text!r} ({err})") from None
    try:
        return now - parse_duration(text)
    except ValueError:
        raise ValueError(f"expected a duration ago such as 10m or 2h, or an RFC 3339 time such as "
                         f"2026-01-02T03:04:05Z, got {text!r}") from None
