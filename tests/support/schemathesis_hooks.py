"""Schemathesis hooks for fuzzing the admin API (``SCHEMATHESIS_HOOKS=tests.support.schemathesis_hooks``).

The OpenAPI document describes each query parameter exactly (patterns included), but JSON Schema
cannot say two rules the history API documents across parameters: ``since`` is before ``until``, and
``step`` gives at most 11000 points over the range; nor that a date must exist (February 30). Cases
that break one of those are dropped here, evaluated independently of the server's own parser, so
every other schema-valid request must be accepted and every schema-invalid one refused.
"""

from __future__ import annotations

import re
import time
from datetime import datetime

import schemathesis

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
MAX_STEPS = 11_000


def _seconds(text: str) -> float:
    return sum(int(n) * _UNITS[u] for n, u in re.findall(r"([0-9]+)(ms|s|m|h|d|w)", text))


def _at(text: str, now: float) -> float | None:
    """Unix seconds of a since/until value; None for a date-like value whose date does not exist."""
    if "-" in text[:5] or ":" in text:
        try:
            return datetime.fromisoformat(text.upper().replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return now - _seconds(text)


@schemathesis.hook
def filter_query(ctx, query) -> bool:
    """False for a history query that breaks a documented cross-parameter rule."""
    if not isinstance(query, dict) or "/history" not in getattr(ctx.operation, "path", ""):
        return True
    since, until, step = query.get("since", "1h"), query.get("until", "0s"), query.get("step")
    if not all(isinstance(v, str) for v in (since, until)) or not isinstance(step, str | None):
        return True
    now = time.time()
    a, b = _at(since, now), _at(until, now)
    if a is None or b is None:
        return False
    if a >= b - 1.0:  # the server's "now" is a little later than ours
        return False
    return step is None or _seconds(step) <= 0 or (b - a) / _seconds(step) + 1 <= MAX_STEPS - 10
