"""Times and durations in history queries: ``10m``, ``1h30m`` and RFC 3339 timestamps.

The grammar is given as regular expressions (:data:`DURATION_RE`, :data:`STEP_RE`, :data:`RFC3339_RE`,
:data:`TIME_RE`); the admin API's OpenAPI document carries the same patterns (a test checks they are
equal), so what the document calls valid is what the server accepts.
"""

from __future__ import annotations

import re
from datetime import datetime

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_N = "(?:0|[1-9][0-9]{0,11})"  # ASCII digits (``\d`` takes any Unicode digit), no leading zero, <= 12
_U = "(?:ms|s|m|h|d|w)"
#: A duration: one or more ``<integer><unit>`` parts (units ms s m h d w), e.g. ``1h30m``; 0 allowed.
DURATION_RE = f"(?:{_N}{_U})+"
#: A duration with at least one part that is not 0 (``step`` must be longer than 0).
STEP_RE = f"(?:{_N}{_U})*[1-9][0-9]{{0,11}}{_U}(?:{_N}{_U})*"
#: RFC 3339 section 5.6 date-time: full date, ``T`` (or ``t``, or a space as the RFC allows), time with
#: optional fraction (at most 9 digits), and an offset (``Z`` or ``+HH:MM``). A date that does not exist
#: (February 30) matches and is refused by :func:`parse_time`.
RFC3339_RE = (r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])[Tt ](?:[01][0-9]|2[0-3]):[0-5][0-9]:"
              r"[0-5][0-9](?:\.[0-9]{1,9})?(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])")
#: ``since`` / ``until``: a duration ago or an RFC 3339 time.
TIME_RE = f"(?:{DURATION_RE}|{RFC3339_RE})"
_DURATION, _STEP, _RFC3339 = re.compile(DURATION_RE), re.compile(STEP_RE), re.compile(RFC3339_RE)
_PART = re.compile(f"({_N})({_U})")


def parse_duration(text: str, allow_zero: bool = False) -> float:
    """A duration such as ``90s``, ``10m``, ``1h30m``, ``2d``, ``500ms`` (Prometheus style) -> seconds.

    Units: ms, s, m, h, d, w; integers of ASCII digits without leading zeros, at most 12 per part (so
    the result is always a finite float); several parts add up. Raises ``ValueError`` (with an
    example of the expected form) for anything else, and for a zero duration unless ``allow_zero``.
    """
    if not (_DURATION if allow_zero else _STEP).fullmatch(text):
        if _DURATION.fullmatch(text):
            raise ValueError(f"expected a duration longer than 0, got {text!r}")
        raise ValueError(f"expected a duration such as 30s, 10m, 1h30m or 2d, got {text[:64]!r}")
    return sum(int(n) * _UNITS[u] for n, u in _PART.findall(text))


def parse_time(text: str, now: float) -> float:
    """A point in time -> Unix seconds: a duration ago (``10m`` = ``now - 600``, ``0s`` = now) or an
    RFC 3339 timestamp.

    RFC 3339 needs the offset (``2026-01-02T03:04:05Z``, ``...+02:00``). Raises ``ValueError``
    naming both accepted forms, or saying the date does not exist.
    """
    if _RFC3339.fullmatch(text):
        try:
            return datetime.fromisoformat(text.upper().replace("Z", "+00:00")).timestamp()
        except (ValueError, OverflowError, OSError) as err:  # February 30; year 0000
            raise ValueError(f"not a valid RFC 3339 time: {text!r} ({err})") from None
    try:
        return now - parse_duration(text, allow_zero=True)
    except ValueError:
        raise ValueError(f"expected a duration ago such as 10m or 2h, or an RFC 3339 time such as "
                         f"2026-01-02T03:04:05Z, got {text[:64]!r}") from None
