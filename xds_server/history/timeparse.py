"""Times and durations in history queries: ``10m``, ``1h30m`` and RFC 3339 timestamps."""

from __future__ import annotations

import re
from datetime import datetime

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
#: ASCII digits only (``\d`` would take any Unicode digit); at most 12 per part.
_DURATION = re.compile(r"(?:[0-9]{1,12}(?:ms|s|m|h|d|w))+")
_PART = re.compile(r"([0-9]{1,12})(ms|s|m|h|d|w)")
#: The longest duration accepted: 100 years (s). Longer ones are refused, not turned into an overflow.
MAX_DURATION_S = 100 * 365.25 * 86400
# RFC 3339 section 5.6 date-time: a full date, "T" (or a space, as the RFC allows), a time, an offset.
_RFC3339 = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,9})?([Zz]|[+-][0-9]{2}:[0-9]{2})")


def parse_duration(text: str) -> float:
    """A duration such as ``90s``, ``10m``, ``1h30m``, ``2d``, ``500ms`` (Prometheus style) -> seconds.

    Units: ms, s, m, h, d, w; integers of ASCII digits (at most 12 per part); several parts add up.
    Raises ``ValueError`` (with an example of the expected form) for anything else, for a zero
    duration and for one longer than :data:`MAX_DURATION_S` (100 years).
    """
    if not _DURATION.fullmatch(text):
        raise ValueError(f"expected a duration such as 30s, 10m, 1h30m or 2d, got {text[:64]!r}")
    seconds = sum(int(n) * _UNITS[u] for n, u in _PART.findall(text))
    if seconds <= 0:
        raise ValueError(f"expected a duration longer than 0, got {text!r}")
    if seconds > MAX_DURATION_S:
        raise ValueError(f"expected a duration of at most 100 years, got {text!r}")
    return seconds


def parse_time(text: str, now: float) -> float:
    """A point in time -> Unix seconds: a duration ago (``10m`` = ``now - 600``) or an RFC 3339 timestamp.

    RFC 3339 needs the offset (``2026-01-02T03:04:05Z``, ``...+02:00``). Raises ``ValueError``
    naming both accepted forms.
    """
    if _RFC3339.fullmatch(text):
        try:
            return datetime.fromisoformat(text.upper().replace("Z", "+00:00")).timestamp()
        except (ValueError, OverflowError, OSError) as err:  # 0000-01-01, 0001-01-01T00:00:00+23:59
            raise ValueError(f"not a valid RFC 3339 time: {text!r} ({err})") from None
    try:
        return now - parse_duration(text)
    except ValueError:
        raise ValueError(f"expected a duration ago such as 10m or 2h (at most 100 years), or an RFC 3339 "
                         f"time such as 2026-01-02T03:04:05Z, got {text[:64]!r}") from None
