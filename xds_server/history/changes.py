"""Which endpoint states to record: a pure function of the round's weights and what was recorded last."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import orjson

from xds_server.engine.types import EndpointWeight
from xds_server.engine.verdicts import HEALTH_CODE, HEALTH_STATES, ClusterVerdicts, Table, Verdicts
from xds_server.history.types import CHANGE, KEYFRAME, HistoryRow, Layout, RowBatch
from xds_server.metrics.stats import STAT_FIELDS


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


@dataclass(frozen=True, slots=True)
class LastColumns:
    """What was last recorded for one cluster's endpoints ``addresses``, in columns: ``known`` (bool:
    a row was recorded), ``weight`` (int64), ``health`` (int8 codes of
    :data:`~xds_server.engine.verdicts.HEALTH_STATES`), ``t`` (Unix s; NaN where unknown)."""

    addresses: tuple[str, ...]
    known: np.ndarray
    weight: np.ndarray
    health: np.ndarray
    t: np.ndarray
    _index: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    def position(self, address: str) -> int:
        """Where ``address`` is in :attr:`addresses`, -1 if it is not."""
        if not self._index and self.addresses:
            self._index.update(zip(self.addresses, range(len(self.addresses)), strict=True))
        return self._index.get(address, -1)

    def aligned(self, addresses: tuple[str, ...]) -> LastColumns:
        """The same entries for ``addresses`` (unknown where there is none)."""
        if addresses == self.addresses:
            return self
        at = np.fromiter(map(self.position, addresses), dtype=np.int64, count=len(addresses))
        has = at >= 0
        if not has.any():
            n = len(addresses)
            return LastColumns(addresses, np.zeros(n, dtype=bool), np.zeros(n, dtype=np.int64),
                               np.zeros(n, dtype=np.int8), np.full(n, np.nan))
        at = np.where(has, at, 0)
        return LastColumns(addresses, has & self.known[at], self.weight[at], self.health[at],
                           np.where(has, self.t[at], np.nan))


class LastRecorded(Mapping[Key, Recorded]):
    """``{(cluster, endpoint): Recorded}`` kept as :class:`LastColumns` per cluster (read-only): a round
    compares its verdicts with them array-wise."""

    def __init__(self, clusters: Mapping[str, LastColumns]) -> None:
        self.clusters = clusters

    @staticmethod
    def of(last: Mapping[Key, Recorded]) -> LastRecorded:
        """``last`` in columns (itself when it is a :class:`LastRecorded`)."""
        if isinstance(last, LastRecorded):
            return last
        groups: dict[str, list[tuple[str, Recorded]]] = {}
        for (cluster, address), r in last.items():
            groups.setdefault(cluster, []).append((address, r))
        return LastRecorded({c: LastColumns(
            tuple(a for a, _ in entries), np.ones(len(entries), dtype=bool),
            np.array([r.weight for _, r in entries], dtype=np.int64),
            np.array([HEALTH_CODE[r.health] for _, r in entries], dtype=np.int8),
            np.array([r.t for _, r in entries], dtype=float)) for c, entries in groups.items()})

    def __getitem__(self, key: Key) -> Recorded:
        cols = self.clusters.get(key[0])
        i = -1 if cols is None else cols.position(key[1])
        if i < 0 or not cols.known[i]:  # type: ignore[union-attr]
            raise KeyError(key)
        return Recorded(int(cols.weight[i]), HEALTH_STATES[cols.health[i]], float(cols.t[i]))  # type: ignore[union-attr]

    def __iter__(self) -> Iterator[Key]:
        return ((c, a) for c, cols in self.clusters.items()
                for a, known in zip(cols.addresses, cols.known.tolist(), strict=True) if known)

    def __len__(self) -> int:
        return sum(int(cols.known.sum()) for cols in self.clusters.values())


def to_record(weights: Iterable[EndpointWeight], last: Mapping[Key, Recorded], now: float,
              snapshot_version: str | None, keyframe_s: float,
              keyframes_only: bool = False) -> tuple[RowBatch, LastRecorded]:
    """The rows to write for one round, and the updated ``last``.

    An endpoint gets a :data:`CHANGE` row when it has no previous row or its weight or health differs
    from its previous row, a :data:`KEYFRAME` row when its previous row is ``keyframe_s`` seconds old
    or older, and no row otherwise. Inputs, scores and reasons alone never make a row. A row holds
    the endpoint's inputs rounded to 3 decimals (as :meth:`EndpointStats.as_dict`), its scores and
    combined score rounded to 4, and its reasons.

    Args:
        weights: the round's engine verdicts (read from their columns: a
            :class:`~xds_server.engine.verdicts.Verdicts`, or made into one).
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
    verdicts, before = Verdicts.of(weights), LastRecorded.of(last)
    updated = dict(before.clusters)
    layouts = Table()
    positions: list[np.ndarray] = []
    pieces: list[dict[str, list]] = []
    for k, part in enumerate(verdicts.parts):
        old = before.clusters.get(part.cluster)
        was = old.aligned(part.addresses) if old is not None else LastColumns(part.addresses, *_unknown(len(part)))
        change = ~was.known | (was.weight != part.weight) | (was.health != part.health)
        with np.errstate(invalid="ignore"):
            keyframe = ~change & (now - was.t >= keyframe_s)
        chosen = keyframe if keyframes_only else change | keyframe
        updated[part.cluster] = LastColumns(
            part.addresses, was.known | chosen, np.where(chosen, part.weight, was.weight),
            np.where(chosen, part.health, was.health).astype(np.int8), np.where(chosen, now, was.t))
        index = np.flatnonzero(chosen)
        if len(index):
            positions.append(verdicts.positions(k)[index])
            pieces.append(_rows(part, index, change[index], layouts))
    columns = {name: [v for piece in pieces for v in piece[name]] for name in _ROW_COLUMNS}
    at = np.concatenate(positions) if positions else np.zeros(0, dtype=np.int64)
    if len(at) > 1 and (np.diff(at) < 0).any():  # clusters interleaved in ``weights``: rows in its order
        order = np.argsort(at, kind="stable")
        columns = {name: np.array(values, dtype=object)[order].tolist() for name, values in columns.items()}
    m = len(at)
    rows = RowBatch(t=[now] * m, snapshot_version=[snapshot_version] * m, layouts=list(layouts.values), **columns)
    return rows, LastRecorded(updated)


def _unknown(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    return np.zeros(n, dtype=bool), np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int8), np.full(n, np.nan)


_ROW_COLUMNS = ("cluster", "endpoint", "weight", "health", "score", "inputs", "scores", "reasons", "kind", "layout")
_HEALTH_NAMES = np.array(HEALTH_STATES, dtype=object)


def _rows(part: ClusterVerdicts, index: np.ndarray, change: np.ndarray, layouts: Table) -> dict[str, list]:
    """The row columns (as :class:`RowBatch` names them) of ``part``'s endpoints at ``index``; ``change``:
    which are :data:`CHANGE` rows (else :data:`KEYFRAME`). Scores are encoded per set of scorer names
    (the endpoints of one cluster's round share theirs; an excluded endpoint has none), reasons once per
    distinct tuple (the engine shares them: a few hundred among 60 000 endpoints); ``layouts`` collects
    the rows' layouts (the inputs' names and the scorers' names)."""
    m = len(index)
    sets = part.score_set[index]
    scores = np.empty(m, dtype=object)
    layout = np.empty(m, dtype=np.int64)
    for s in np.unique(sets).tolist():
        at = np.flatnonzero(sets == s)
        cols = list(part.score_sets[s])
        scores[at] = json_arrays(np.round(part.scores[index[at]][:, cols], 4))
        layout[at] = layouts.add(Layout(STAT_FIELDS, tuple(part.score_names[c] for c in cols)))
    reasons = np.array([orjson.dumps(r).decode() for r in part.reason_table], dtype=object)
    return {"cluster": [part.cluster] * m, "endpoint": np.array(part.addresses, dtype=object)[index].tolist(),
            "weight": part.weight[index].tolist(), "health": _HEALTH_NAMES[part.health[index]].tolist(),
            "score": [None if v != v else v for v in np.round(part.score[index], 4).tolist()],
            "inputs": json_arrays(np.round(part.stats[index], 3)), "scores": scores.tolist(),
            "reasons": reasons[part.reasons[index]].tolist(),
            "kind": np.where(change, CHANGE, KEYFRAME).astype(object).tolist(), "layout": layout.tolist()}


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
    values = np.ascontiguousarray(values)  # orjson writes C-ordered arrays only
    out: list[str] = []
    for start in range(0, rows, CHUNK_ROWS):
        text = orjson.dumps(values[start:start + CHUNK_ROWS], option=orjson.OPT_SERIALIZE_NUMPY).decode()
        out.extend(text[1:-1].replace("],[", "]\n[").split("\n"))
    return out
