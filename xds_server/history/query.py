"""History queries: URL parameters -> :class:`HistoryQuery` -> a JSON time series per endpoint.

The series are step functions: a point's values hold until the endpoint's next point, and the last
one until ``until``. Without ``step`` the points are the recorded rows, preceded by the row in force
at ``since`` (kind ``carried``, stamped at ``since``); with ``step`` there is one point per step time
``since + k x step`` carrying the row in force then (none before an endpoint's first row).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from xds_server.config.model import normalize_endpoint_address
from xds_server.history.timeparse import parse_duration, parse_time
from xds_server.history.types import HistoryRow, HistoryStore

DEFAULT_SINCE = "1h"
DEFAULT_LIMIT = 10_000
MAX_LIMIT = 100_000
#: Most step points per series (the same bound Prometheus puts on a range query).
MAX_STEPS = 11_000
CARRIED = "carried"


class QueryError(ValueError):
    """A bad query parameter; ``param`` names it, ``str(err)`` says what was expected."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True, slots=True)
class HistoryQuery:
    """A validated history query. Times in Unix seconds; ``step`` in seconds or None (raw rows)."""

    since: float
    until: float
    cluster: str | None = None
    endpoint: str | None = None
    step: float | None = None
    limit: int = DEFAULT_LIMIT


def parse_query(params: Mapping[str, str], now: float | None = None) -> HistoryQuery:
    """Validate ``cluster``, ``endpoint``, ``since`` (default 1h), ``until`` (default now), ``step``, ``limit``.

    ``since``/``until``: a duration ago (``10m``) or an RFC 3339 time; ``step``: a duration;
    ``limit``: 1..100000 rows read (default 10000); ``endpoint`` in the config's spelling
    (``127.0.0.1:08002`` is ``127.0.0.1:8002``, as for a drain). Raises :class:`QueryError` naming the first bad
    parameter. Other keys are not read here: the admin API refuses an unknown or repeated parameter
    on every route before (``xds_server.admin.app.check_query``, from the OpenAPI document).
    """
    now = time.time() if now is None else now
    values = {}
    for name, default in (("since", DEFAULT_SINCE), ("until", None)):
        raw = params.get(name, default)
        try:
            values[name] = now if raw is None else parse_time(raw, now)
        except ValueError as err:
            raise QueryError(name, str(err)) from None
    since, until = values["since"], values["until"]
    if since >= until:
        raise QueryError("since", f"must be before until ({since:.3f} >= {until:.3f} Unix s)")
    step = None
    if "step" in params:
        try:
            step = parse_duration(params["step"])
        except ValueError as err:
            raise QueryError("step", str(err)) from None
        if (until - since) / step + 1 > MAX_STEPS:
            raise QueryError("step", f"too small for the range: more than {MAX_STEPS} points per series; "
                                     f"use a step of at least {(until - since) / (MAX_STEPS - 1):.3f} s")
    limit = DEFAULT_LIMIT
    if "limit" in params:
        raw = params["limit"]
        if not re.fullmatch(r"[0-9]{1,6}", raw) or not 1 <= int(raw) <= MAX_LIMIT:
            raise QueryError("limit", f"expected an integer 1..{MAX_LIMIT}, got {raw[:64]!r}")
        limit = int(raw)
    for name in ("cluster", "endpoint"):
        if name in params and not params[name]:
            raise QueryError(name, "must not be empty (leave it out to match all)")
    endpoint = params.get("endpoint")
    if endpoint is not None:
        try:  # the config and the history keep one spelling per socket address (as drain reads it)
            endpoint = normalize_endpoint_address(endpoint)
        except ValueError:
            pass  # not IP:PORT: matched as written (a 404 if nothing has that name)
    return HistoryQuery(since, until, params.get("cluster"), endpoint, step, limit)


def _point(row: HistoryRow, t: float, kind: str) -> dict:
    return {"t": t, "weight": row.weight, "health": row.health, "score": row.score, "scores": dict(row.scores),
            "inputs": dict(row.inputs), "reasons": list(row.reasons), "kind": kind}


def build_series(q: HistoryQuery, carried: Iterable[HistoryRow], rows: Iterable[HistoryRow]) -> list[dict]:
    """``[{"cluster", "endpoint", "points": [...]}]`` sorted by cluster then endpoint (pure).

    ``carried``: per endpoint the newest row before ``q.since``; ``rows``: the rows in
    ``[q.since, q.until]``, oldest first.
    """
    per: dict[tuple[str, str], list[tuple[HistoryRow, float, str]]] = {}
    for r in carried:
        per.setdefault((r.cluster, r.endpoint), []).append((r, q.since, CARRIED))
    for r in rows:
        per.setdefault((r.cluster, r.endpoint), []).append((r, r.t, r.kind))
    out = []
    for (cluster, endpoint), entries in sorted(per.items()):
        if q.step is None:
            points = [_point(r, t, kind) for r, t, kind in entries]
        else:
            points, i = [], -1
            n = int((q.until - q.since) // q.step) + 1
            for k in range(n):
                at = q.since + k * q.step
                while i + 1 < len(entries) and entries[i + 1][1] <= at:
                    i += 1
                if i >= 0:
                    points.append(_point(entries[i][0], at, entries[i][2]))
        out.append({"cluster": cluster, "endpoint": endpoint, "points": points})
    return out


def run_query(store: HistoryStore, q: HistoryQuery) -> dict:
    """Read the store and build the ``/api/v1/history`` document (blocking: call it off the event loop).

    Returns ``{"since", "until", "step", "truncated", "series"}``; ``truncated`` is true when more than
    ``q.limit`` rows were in range (the newest were left out). Raises ``HistoryError`` from the store.
    """
    carried = store.last_before(q.since, q.cluster, q.endpoint)
    rows = store.rows(q.since, q.until, q.cluster, q.endpoint, q.limit + 1)
    truncated = len(rows) > q.limit
    return {"since": q.since, "until": q.until, "step": q.step, "truncated": truncated,
            "series": build_series(q, carried, rows[: q.limit])}
