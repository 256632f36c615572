"""Which endpoint states to record: a pure function of the round's weights and what was recorded last."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

from xds_server.engine.types import EndpointWeight
from xds_server.history.types import CHANGE, KEYFRAME, HistoryRow
from xds_server.metrics.stats import as_dicts, rounded


class Recorded(NamedTuple):
    """What was last recorded for one endpoint: its weight, health and when (Unix s)."""

    weight: int
    health: str
    t: float


Key = tuple[str, str]  # (cluster, endpoint)


def last_recorded(rows: Iterable[HistoryRow]) -> dict[Key, Recorded]:
    """``{(cluster, endpoint): Recorded}`` from stored rows (the newest per endpoint wins)."""
    out: dict[Key, Recorded] = {}
    for r in sorted(rows, key=lambda r: r.t):
        out[(r.cluster, r.endpoint)] = Recorded(r.weight, r.health, r.t)
    return out


def to_record(weights: Iterable[EndpointWeight], last: Mapping[Key, Recorded], now: float,
              snapshot_version: str | None, keyframe_s: float,
              keyframes_only: bool = False) -> tuple[list[HistoryRow], dict[Key, Recorded]]:
    """The rows to write for one round, and the updated ``last``.

    An endpoint gets a :data:`CHANGE` row when it has no previous row or its weight or health differs
    from its previous row, a :data:`KEYFRAME` row when its previous row is ``keyframe_s`` seconds old
    or older, and no row otherwise. Inputs, scores and reasons alone never make a row.

    Args:
        weights: the round's engine verdicts.
        last: what was recorded last per endpoint (not mutated).
        now: the time to stamp on the rows (Unix s).
        snapshot_version: the snapshot carrying ``weights`` (None when unknown).
        keyframe_s: seconds after which an unchanged endpoint is recorded again.
        keyframes_only: write no :data:`CHANGE` rows (for a timer that reads weights which may be
            newer than the last published snapshot: their changes arrive with that snapshot).
    """
    chosen: list[tuple[EndpointWeight, str]] = []
    updated = dict(last)
    for w in weights:
        key = (w.cluster, w.address)
        prev = last.get(key)
        if prev is None or prev.weight != w.weight or prev.health != w.health:
            if keyframes_only:
                continue
            kind = CHANGE
        elif now - prev.t >= keyframe_s:
            kind = KEYFRAME
        else:
            continue
        chosen.append((w, kind))
        updated[key] = Recorded(w.weight, w.health, now)
    # Rounded all at once (numbers of every row in one array): per value, Python's round() was most of a row's cost.
    inputs = as_dicts([w.inputs for w, _ in chosen])
    scores = iter(rounded([v for w, _ in chosen for v in w.scores.values()], 4))
    combined = rounded([w.score for w, _ in chosen], 4)
    rows = [HistoryRow(t=now, cluster=w.cluster, endpoint=w.address, weight=w.weight, health=w.health, score=score,
                       inputs=ins, scores={k: next(scores) for k in w.scores}, reasons=tuple(w.reasons), kind=kind,
                       snapshot_version=snapshot_version)
            for (w, kind), ins, score in zip(chosen, inputs, combined, strict=True)]
    return rows, updated
