"""Which endpoint states to record: a pure function of the round's weights and what was recorded last."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np
import orjson

from xds_server.engine.types import EndpointWeight
from xds_server.history.types import CHANGE, KEYFRAME, HistoryRow, Layout, RowBatch
from xds_server.metrics.stats import STAT_FIELDS, rounded, stats_matrix


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
              keyframes_only: bool = False) -> tuple[RowBatch, dict[Key, Recorded]]:
    """The rows to write for one round, and the updated ``last``.

    An endpoint gets a :data:`CHANGE` row when it has no previous row or its weight or health differs
    from its previous row, a :data:`KEYFRAME` row when its previous row is ``keyframe_s`` seconds old
    or older, and no row otherwise. Inputs, scores and reasons alone never make a row. A row holds
    the endpoint's inputs rounded to 3 decimals (as :meth:`EndpointStats.as_dict`), its scores and
    combined score rounded to 4, and its reasons.

    Args:
        weights: the round's engine verdicts.
        last: what was recorded last per endpoint (not mutated).
        now: the time to stamp on the rows (Unix s).
        snapshot_version: the snapshot carrying ``weights`` (None when unknown).
        keyframe_s: seconds after which an unchanged endpoint is recorded again.
        keyframes_only: write no :data:`CHANGE` rows (for a timer that reads weights which may be
            newer than the last published snapshot: their changes arrive with that snapshot).
    Returns:
        ``(rows, last)``: the rows in ``weights`` order, built array-wise (no Python object per row
        but its strings), and ``last`` updated with them.
    """
    chosen: list[EndpointWeight] = []
    kinds: list[str] = []
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
        chosen.append(w)
        kinds.append(kind)
        updated[key] = Recorded(w.weight, w.health, now)
    m = len(chosen)
    scores, layout, layouts = _scores(chosen)
    rows = RowBatch(t=[now] * m, cluster=[w.cluster for w in chosen], endpoint=[w.address for w in chosen],
                    weight=[w.weight for w in chosen], health=[w.health for w in chosen],
                    score=rounded([w.score for w in chosen], 4),
                    inputs=json_arrays(np.round(stats_matrix([w.inputs for w in chosen]), 3)), scores=scores,
                    reasons=_reasons(chosen), kind=kinds, snapshot_version=[snapshot_version] * m,
                    layout=layout, layouts=layouts)
    return rows, updated


def _reasons(chosen: Sequence[EndpointWeight]) -> list[str]:
    """Each verdict's reasons as JSON text, encoded once per distinct tuple (the engine shares them:
    a few hundred among 60 000 endpoints)."""
    texts: dict[tuple[str, ...], str] = {}
    out = []
    for w in chosen:
        text = texts.get(w.reasons)
        if text is None:
            text = texts[w.reasons] = orjson.dumps(w.reasons).decode()
        out.append(text)
    return out


def _scores(chosen: Sequence[EndpointWeight]) -> tuple[list[str], list[int], list[Layout]]:
    """Each verdict's scores (rounded to 4) as JSON array text, array-wise per set of scorer names (the
    endpoints of one cluster's round share theirs; an excluded endpoint has none); with each row's
    layout (an index into the layouts returned: the inputs' names and its scorers' names)."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, w in enumerate(chosen):
        groups.setdefault(tuple(w.scores), []).append(i)
    out: list[str] = [""] * len(chosen)
    layout: list[int] = [0] * len(chosen)
    for k, (names, at) in enumerate(groups.items()):
        values = np.empty((len(at), len(names)))
        for start in range(0, len(at), CHUNK_ROWS):  # one short C call per piece (the GIL: see CHUNK_ROWS)
            piece = at[start:start + CHUNK_ROWS]
            values[start:start + len(piece)] = np.array([tuple(chosen[i].scores.values()) for i in piece],
                                                        dtype=float).reshape(len(piece), len(names))
        for i, text in zip(at, json_arrays(np.round(values, 4)), strict=True):
            out[i] = text
            layout[i] = k
    return out, layout, [Layout(STAT_FIELDS, names) for names in groups]


#: Rows per piece in :func:`json_arrays`: each piece is one C call holding the GIL (~2 ms), so the
#: event loop, which shares the GIL with the history writer thread, is never held for long.
CHUNK_ROWS = 2048


def json_arrays(values: np.ndarray) -> list[str]:
    """One JSON array text per row of ``values`` (shape ``(rows, width)``, float), NaN and ±Inf as
    ``null``, numbers in their shortest round-tripping form (as ``orjson.dumps`` writes a float).

    Array-wise: orjson writes each piece of :data:`CHUNK_ROWS` rows at once, and the text is cut into rows.

    >>> json_arrays(np.array([[1.5, np.nan], [0.25, 2.0]]))
    ['[1.5,null]', '[0.25,2.0]']
    """
    rows, width = values.shape
    if not width:
        return ["[]"] * rows
    out: list[str] = []
    for start in range(0, rows, CHUNK_ROWS):
        text = orjson.dumps(values[start:start + CHUNK_ROWS], option=orjson.OPT_SERIALIZE_NUMPY).decode()
        out.extend(text[1:-1].replace("],[", "]\n[").split("\n"))
    return out
