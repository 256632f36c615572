"""A round's verdicts in columns: one :class:`ClusterVerdicts` per cluster, read as :class:`EndpointWeight` s.

The engine decides a cluster array-wise, and its readers in the round (the snapshot build, the
picker's memory samples, the change log, the history) read arrays: a round at 60 000 endpoints
makes no Python object per endpoint. :class:`Verdicts` is also a ``Sequence[EndpointWeight]``: an
item is made when it is read (the admin API, the exposition, tests), from the columns.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, overload

import numpy as np

from xds_server.engine.types import DRAINING, HEALTHY, UNHEALTHY, EndpointWeight
from xds_server.metrics.stats import EndpointStats, stats_matrix

#: Health states by code: ``ClusterVerdicts.health`` holds indices into it.
HEALTH_STATES: tuple[str, ...] = (HEALTHY, UNHEALTHY, DRAINING)
HEALTH_CODE = {h: i for i, h in enumerate(HEALTH_STATES)}
_EMPTY: Mapping = MappingProxyType({})


class Table:
    """Distinct values in first-seen order, each with its index (values compared by ``key(value)``)."""

    __slots__ = ("values", "_ids")

    def __init__(self) -> None:
        self.values: list[Any] = []
        self._ids: dict[Hashable, int] = {}

    def add(self, value: Any, key: Hashable | None = None) -> int:
        """The index of ``value`` (``key``: its identity for sharing; default the value itself)."""
        k = value if key is None else key
        i = self._ids.get(k)
        if i is None:
            i = self._ids[k] = len(self.values)
            self.values.append(value)
        return i


def mapping_key(m: Mapping) -> tuple:
    """A hashable key of a mapping's content (its items, in order)."""
    return tuple(m.items())


@dataclass(frozen=True, slots=True, eq=False)
class ClusterVerdicts:
    """One cluster's verdicts, one entry per endpoint in every column (meanings and units as in
    :class:`EndpointWeight`).

    ``weight``: ``int64``; ``health``: ``int8`` indices into :data:`HEALTH_STATES`; ``removed``:
    bool; ``score``: ``float64`` (NaN = None); ``target``: ``int64`` (-1 = None); ``inputs``: the
    :class:`EndpointStats` each was decided on, and ``stats`` the same as a ``float64`` matrix
    ``(n, len(STAT_FIELDS))`` (NaN = no data). ``scores``: a ``float64`` matrix ``(n,
    len(score_names))`` (NaN = no data); endpoint ``i``'s scores are the columns
    ``score_sets[score_set[i]]`` (an endpoint that was not scored has the empty set). ``reasons``,
    ``filters``, ``factors``: indices into ``reason_table``, ``filter_table``, ``factor_table``
    (the distinct values: a few hundred among 60 000 endpoints).
    """

    cluster: str
    addresses: tuple[str, ...]
    weight: np.ndarray
    health: np.ndarray
    removed: np.ndarray
    score: np.ndarray
    target: np.ndarray
    inputs: Sequence[EndpointStats]
    stats: np.ndarray
    score_names: tuple[str, ...]
    scores: np.ndarray
    score_sets: tuple[tuple[int, ...], ...]
    score_set: np.ndarray
    reasons: np.ndarray
    reason_table: tuple[tuple[str, ...], ...]
    filters: np.ndarray
    filter_table: tuple[Mapping[str, str], ...]
    factors: np.ndarray
    factor_table: tuple[Mapping[str, float], ...]

    def __len__(self) -> int:
        return len(self.addresses)

    def row(self, i: int) -> EndpointWeight:
        """Endpoint ``i``'s verdict as an :class:`EndpointWeight`."""
        cols = self.score_sets[self.score_set[i]]
        if cols or self.score_set[i]:
            values = self.scores[i, list(cols)].tolist()
            scores: Mapping = MappingProxyType({self.score_names[c]: None if v != v else v
                                                for c, v in zip(cols, values, strict=True)})
        else:
            scores = {}
        score, target = float(self.score[i]), int(self.target[i])
        return EndpointWeight(self.cluster, self.addresses[i], int(self.weight[i]), HEALTH_STATES[self.health[i]],
                              None if score != score else score, self.inputs[i], scores,
                              self.reason_table[self.reasons[i]], self.filter_table[self.filters[i]],
                              self.factor_table[self.factors[i]], None if target < 0 else target,
                              bool(self.removed[i]))

    def take(self, index: np.ndarray) -> ClusterVerdicts:
        """The endpoints at ``index`` (an integer array or a boolean mask), in that order."""
        index = np.flatnonzero(index) if index.dtype == bool else index
        at = index.tolist()
        return ClusterVerdicts(
            self.cluster, tuple(self.addresses[i] for i in at), self.weight[index], self.health[index],
            self.removed[index], self.score[index], self.target[index], [self.inputs[i] for i in at],
            self.stats[index], self.score_names, self.scores[index], self.score_sets, self.score_set[index],
            self.reasons[index], self.reason_table, self.filters[index], self.filter_table, self.factors[index],
            self.factor_table)

    def all_draining(self) -> bool:
        """True when the cluster has endpoints and every one is DRAINING."""
        return len(self.health) > 0 and bool((self.health == HEALTH_CODE[DRAINING]).all())

    def health_names(self) -> list[str]:
        """Each endpoint's health as its name (HEALTHY, UNHEALTHY or DRAINING)."""
        return np.array(HEALTH_STATES, dtype=object)[self.health].tolist()

    @staticmethod
    def of(cluster: str, weights: Sequence[EndpointWeight]) -> ClusterVerdicts:
        """The columns of ``weights`` (all of ``cluster``), e.g. verdicts made one by one."""
        n = len(weights)
        names, sets = Table(), Table()
        sets.add(())
        score_set = np.zeros(n, dtype=np.int32)
        for i, w in enumerate(weights):
            if w.scores:
                score_set[i] = sets.add(tuple(names.add(k) for k in w.scores))
        scores = np.full((n, len(names.values)), np.nan)
        for i, w in enumerate(weights):
            for c, v in zip(sets.values[score_set[i]], w.scores.values(), strict=True):
                scores[i, c] = np.nan if v is None else v
        reasons, filters, factors = Table(), Table(), Table()
        inputs = [w.inputs for w in weights]
        return ClusterVerdicts(
            cluster, tuple(w.address for w in weights), np.array([w.weight for w in weights], dtype=np.int64),
            np.array([HEALTH_CODE[w.health] for w in weights], dtype=np.int8),
            np.array([w.removed for w in weights], dtype=bool),
            np.array([np.nan if w.score is None else w.score for w in weights], dtype=float),
            np.array([-1 if w.target is None else w.target for w in weights], dtype=np.int64),
            inputs, stats_matrix(inputs), tuple(names.values), scores, tuple(sets.values), score_set,
            np.array([reasons.add(w.reasons) for w in weights], dtype=np.int32), tuple(reasons.values),
            np.array([filters.add(w.filters, mapping_key(w.filters)) for w in weights], dtype=np.int32),
            tuple(filters.values),
            np.array([factors.add(w.factors, mapping_key(w.factors)) for w in weights], dtype=np.int32),
            tuple(factors.values))


class Verdicts(Sequence[EndpointWeight]):
    """A round's verdicts: ``parts`` (one :class:`ClusterVerdicts` per cluster) and, per part, the
    positions of its endpoints in the sequence (``positions``; None: the parts one after another).

    Read-only. Equal to any sequence of the same :class:`EndpointWeight` s."""

    __slots__ = ("parts", "_positions", "_where")

    def __init__(self, parts: Sequence[ClusterVerdicts], positions: Sequence[np.ndarray] | None = None) -> None:
        self.parts = tuple(parts)
        self._positions = None if positions is None else tuple(positions)
        self._where: tuple[np.ndarray, np.ndarray] | None = None

    @staticmethod
    def of(weights: Iterable[EndpointWeight]) -> Verdicts:
        """``weights`` as columns (itself when it is a :class:`Verdicts`), in the same order."""
        if isinstance(weights, Verdicts):
            return weights
        groups: dict[str, list[int]] = {}
        weights = list(weights)
        for i, w in enumerate(weights):
            groups.setdefault(w.cluster, []).append(i)
        return Verdicts([ClusterVerdicts.of(c, [weights[i] for i in at]) for c, at in groups.items()],
                        [np.array(at, dtype=np.int64) for at in groups.values()])

    def served(self) -> Verdicts:
        """The endpoints not ``removed``, cluster by cluster (each cluster's order kept)."""
        return Verdicts([p if not p.removed.any() else p.take(~p.removed) for p in self.parts])

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    def positions(self, k: int) -> np.ndarray:
        """The positions in the sequence of part ``k``'s endpoints, in the part's order."""
        if self._positions is not None:
            return self._positions[k]
        start = sum(len(p) for p in self.parts[:k])
        return np.arange(start, start + len(self.parts[k]))

    def locate(self) -> tuple[np.ndarray, np.ndarray]:
        """``(part, row)``: for each position in the sequence, its part's index and its row in it."""
        if self._where is None:
            n = len(self)
            part, row = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
            for k, p in enumerate(self.parts):
                at = self.positions(k)
                part[at], row[at] = k, np.arange(len(p))
            self._where = (part, row)
        return self._where

    @overload
    def __getitem__(self, i: int) -> EndpointWeight: ...
    @overload
    def __getitem__(self, i: slice) -> list[EndpointWeight]: ...

    def __getitem__(self, i):
        part, row = self.locate()
        if isinstance(i, slice):
            return [self.parts[k].row(r) for k, r in zip(part[i].tolist(), row[i].tolist(), strict=True)]
        return self.parts[part[i]].row(int(row[i]))

    def __iter__(self) -> Iterator[EndpointWeight]:
        part, row = self.locate()
        for k, r in zip(part.tolist(), row.tolist(), strict=True):
            yield self.parts[k].row(r)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Verdicts({list(self)!r})"

    def changed(self, before: Sequence[EndpointWeight]) -> np.ndarray:
        """The positions (ascending) whose weight or health differ from ``before``'s verdict for the same
        cluster and address (or that ``before`` has none for)."""
        old = {p.cluster: p for p in Verdicts.of(before).parts}
        out = [np.zeros(0, dtype=np.int64)]
        for k, p in enumerate(self.parts):
            prev = old.get(p.cluster)
            if prev is not None and prev.addresses == p.addresses:
                diff = (prev.weight != p.weight) | (prev.health != p.health)
            else:
                seen = {} if prev is None else dict(zip(prev.addresses, zip(
                    prev.weight.tolist(), prev.health.tolist(), strict=True), strict=True))
                diff = np.fromiter((seen.get(a) != wh for a, wh in zip(p.addresses, zip(
                    p.weight.tolist(), p.health.tolist(), strict=True), strict=True)), dtype=bool, count=len(p))
            out.append(self.positions(k)[diff])
        return np.sort(np.concatenate(out))


class ClusterBuilder:
    """The columns of one cluster's verdicts while the engine decides them (``n`` endpoints). Every
    endpoint starts HEALTHY with weight 1, no score, target or scores, no reasons, and empty filter
    verdicts and factors; the engine sets groups of endpoints array-wise and singled-out ones with
    :meth:`one`, then :meth:`build` makes the :class:`ClusterVerdicts`."""

    def __init__(self, n: int) -> None:
        self.weight = np.ones(n, dtype=np.int64)
        self.health = np.zeros(n, dtype=np.int8)
        self.removed = np.zeros(n, dtype=bool)
        self.score = np.full(n, np.nan)
        self.target = np.full(n, -1, dtype=np.int64)
        self.score_set = np.zeros(n, dtype=np.int32)
        self.reasons = np.zeros(n, dtype=np.int32)
        self.filters = np.zeros(n, dtype=np.int32)
        self.factors = np.zeros(n, dtype=np.int32)
        self.reason_table, self.filter_table, self.factor_table = Table(), Table(), Table()
        self.reason_table.add(())
        self.filter_table.add(_EMPTY, ())
        self.factor_table.add(_EMPTY, ())

    def filter_id(self, verdicts: Mapping[str, str]) -> int:
        """The index of ``verdicts`` (per filter) in the filter table."""
        return self.filter_table.add(verdicts, mapping_key(verdicts))

    def one(self, i: int, weight: int, health: str, reasons: tuple[str, ...], filters: Mapping[str, str] = _EMPTY,
            removed: bool = False) -> None:
        """Endpoint ``i``: not scored (no score, target, scores or factors)."""
        self.weight[i], self.health[i], self.removed[i] = weight, HEALTH_CODE[health], removed
        self.reasons[i] = self.reason_table.add(reasons)
        self.filters[i] = self.filter_id(filters)

    def build(self, cluster: str, addresses: tuple[str, ...], inputs: Sequence[EndpointStats], stats: np.ndarray,
              score_names: tuple[str, ...], scores: np.ndarray) -> ClusterVerdicts:
        """The verdicts; an endpoint with ``score_set`` 1 has every scorer of ``score_names``."""
        return ClusterVerdicts(cluster, addresses, self.weight, self.health, self.removed, self.score, self.target,
                               inputs, stats, score_names, scores, ((), tuple(range(len(score_names)))),
                               self.score_set, self.reasons, tuple(self.reason_table.values), self.filters,
                               tuple(self.filter_table.values), self.factors, tuple(self.factor_table.values))


def group_rows(columns: Sequence[np.ndarray], n: int) -> tuple[np.ndarray, np.ndarray]:
    """``(group, first)``: for ``n`` rows of equal values across ``columns`` (integer or float arrays of
    length ``n``), each row's group number and each group's first row.

    The columns are packed into one integer key (a column of one value is skipped; a float column
    with several is numbered first), so there is one sort, not one per column.

    >>> group, first = group_rows([np.array([3, 1, 3, 1]), np.array([0.5, 0.5, 0.5, 2.0])], 4)
    >>> group.tolist(), first.tolist()
    ([2, 0, 2, 1], [1, 3, 0])
    """
    key = np.zeros(n, dtype=np.int64)
    card = 1
    for col in columns:
        if not n or (col == col[0]).all():
            continue
        if col.dtype.kind == "f":
            _, col = np.unique(col, return_inverse=True)
            col = col.reshape(-1)
        lo = int(col.min())
        span = int(col.max()) - lo + 1
        if card * span >= 2**62:  # number the groups so far again, then the column's values
            _, key = np.unique(key, return_inverse=True)
            key, card = key.reshape(-1), int(key.max()) + 1
            if card * span >= 2**62:
                _, col = np.unique(col, return_inverse=True)
                col, lo = col.reshape(-1), 0
                span = int(col.max()) + 1
        key = key * span + (col - lo)
        card *= span
    _, first, group = np.unique(key, return_index=True, return_inverse=True)
    return group.reshape(-1), first


#: :func:`unserved`'s reasons where Envoy lists no endpoint of the cluster: every one draining (the assignment
#: withdraws them: :meth:`xds_server.resources.build.BuildMemo.assignment`) or every one removed.
EVERY_DRAINING, EVERY_REMOVED = "every endpoint is draining", "every endpoint was removed (drained, or gone)"


def unserved(verdicts: Verdicts) -> dict[str, str]:
    """``{cluster: why}`` for each cluster of ``verdicts`` with no HEALTHY endpoint left (Envoy answers
    its requests 503 ``no healthy upstream``): "every endpoint is draining", how many are draining
    and how many unhealthy, or, when every endpoint it has was removed (drained until idle, or
    past ``engine.drain_timeout_s``), "every endpoint was removed". Removed endpoints do not count
    beside others. One numpy pass per cluster."""
    out = {}
    for part in verdicts.parts:
        health = part.health[~part.removed] if part.removed.any() else part.health
        if len(health) == 0:
            if len(part.health):  # endpoints it had, every one removed: Envoy has none to send to
                out[part.cluster] = EVERY_REMOVED
            continue
        if (health == HEALTH_CODE[HEALTHY]).any():
            continue
        draining = int((health == HEALTH_CODE[DRAINING]).sum())
        out[part.cluster] = (EVERY_DRAINING if draining == len(health) else
                             f"no endpoint is healthy ({draining} draining, {len(health) - draining} unhealthy)")
    return out
