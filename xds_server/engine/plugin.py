"""The plugin contract of the weight engine: filters, scorers and factors.

A plugin is a pure function of one cluster's round (:class:`ClusterRound`), its parameters (a
frozen pydantic model: the YAML under ``engine.filters.<name>``, ``engine.scorers.<name>`` or
``engine.factors.<name>`` is validated into it) and its own state from the previous round
(``{address: value}``, immutable values). It returns its verdicts and its new state. A new plugin
is one module that builds one of :class:`Filter`, :class:`Scorer` or :class:`Factor`, plus one line
in :mod:`xds_server.engine.builtin`.

A round is columnar: the members' inputs are numpy ``float64`` arrays, one per
:class:`~xds_server.metrics.stats.EndpointStats` field (``NaN`` = no data), aligned with
``rnd.addresses``; plugins compute on whole arrays (a 60 000-endpoint cluster is one array
operation per step, not 60 000 Python calls).

- A **filter** returns ``{address: reason}`` for endpoints that must not take new traffic.
- A **scorer** returns an array of scores in [0, 1] (``NaN`` = no data; 1 = best), one per member.
- A **factor** returns an array of multipliers > 0 (capacity, slow start, balance correction), one
  per member; it sees the weights computed so far (an array, same order).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Generic, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict

from xds_server.engine.types import EndpointSpec, EngineParams
from xds_server.metrics.stats import STAT_FIELDS, EndpointStats, finite


class PluginParams(BaseModel):
    """Base of every plugin's parameters: frozen, unknown keys refused (the error names them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class NoParams(PluginParams):
    """For plugins without parameters."""


P = TypeVar("P", bound=PluginParams)

#: A plugin's state for one cluster: ``{address: value}`` (values immutable).
State = Mapping[str, Any]
Array = np.ndarray

_CAPACITY = operator.attrgetter("capacity")
_MAX_CONCURRENCY = operator.attrgetter("max_concurrency")
_MEMORY = operator.attrgetter("memory_mib")
_PREALLOCATED = operator.attrgetter("preallocated")
_ALL = operator.attrgetter(*STAT_FIELDS)
#: Members per piece in :meth:`Columns.of` (one C call each, ~2 ms of the GIL).
PIECE = 2048


@dataclass(frozen=True, slots=True)
class Columns:
    """One cluster's members as arrays: ``stats[field]`` (``float64``, NaN = no data) for every
    :class:`EndpointStats` field (the columns of ``matrix``, shape ``(n, len(STAT_FIELDS))``), and
    the configured ``capacity``, ``max_concurrency``, ``memory_mib`` (MiB) and ``preallocated`` (bool:
    a preallocated KV-cache pool, :attr:`EndpointSpec.preallocated`) of each member; all aligned,
    length ``n``."""

    matrix: Array
    capacity: Array
    max_concurrency: Array
    memory_mib: Array
    preallocated: Array
    dirty: Array
    """Per member: its stats held a NaN or ±Inf (read here as no data; ``EndpointStats.sanitized`` says so)."""
    stats: Mapping[str, Array] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stats", {name: self.matrix[:, k] for k, name in enumerate(STAT_FIELDS)})

    @staticmethod
    def of(specs: Sequence[EndpointSpec], stats: Sequence[EndpointStats]) -> Columns:
        """The columns of ``specs`` with their ``stats`` (NaN, ±Inf and None all read as no data).

        A value that is not a number (a source bug) is read as ``EndpointStats.sanitized`` reads it.
        Filled :data:`PIECE` members at a time, each piece's values through one list and one
        ``numpy.array`` call (60 000 x 17 values: ~75 ms, against ~95 ms field by field); one call
        over every member would hold the GIL, which the event loop shares, for ~40 ms."""
        n, width = len(stats), len(STAT_FIELDS)
        matrix = np.empty((n, width))
        dirty = np.zeros(n, dtype=bool)
        for start in range(0, n, PIECE):
            piece = stats[start:start + PIECE]
            rows = slice(start, start + len(piece))
            if not _fill_numbers(matrix[rows], dirty[rows], piece):
                _fill_any(matrix[rows], dirty[rows], piece)
        return Columns(matrix, np.array(list(map(_CAPACITY, specs)), dtype=float),
                       np.array(list(map(_MAX_CONCURRENCY, specs)), dtype=float),
                       np.array(list(map(_MEMORY, specs)), dtype=float),
                       np.array(list(map(_PREALLOCATED, specs)), dtype=bool), dirty)

    def take(self, index: Array) -> Columns:
        """The rows at ``index`` (an integer array), in that order."""
        return Columns(self.matrix[index], self.capacity[index], self.max_concurrency[index], self.memory_mib[index],
                       self.preallocated[index], self.dirty[index])




def _fill_numbers(out: Array, dirty: Array, stats: Sequence[EndpointStats]) -> bool:
    """Fill ``out`` (rows x fields) and ``dirty`` from ``stats`` when every field is a number in every
    row or None in every row, as in the first row (the common case: a source gives an input for every
    endpoint or for none); False, with nothing promised, otherwise. One ``numpy.fromiter`` over the
    fields present: no list of every value, no value by value check for None."""
    present = tuple(k for k, v in enumerate(_ALL(stats[0])) if v is not None)
    absent = [k for k in range(len(STAT_FIELDS)) if k not in present]
    if any(list(map(_FIELD[k], stats)).count(None) != len(stats) for k in absent):
        return False
    out[:, absent] = np.nan
    if not present:
        return True
    getter = _getter(present)
    try:
        values = np.fromiter(chain.from_iterable(map(getter, stats)) if len(present) > 1 else map(getter, stats),
                             dtype=float, count=len(stats) * len(present))
    except (TypeError, ValueError, OverflowError):  # None somewhere, or not a number
        return False
    values = values.reshape(len(stats), len(present))
    bad = ~np.isfinite(values)
    if bad.any():
        dirty |= bad.any(axis=1)
        values[bad] = np.nan
    out[:, list(present)] = values
    return True


def _fill_any(out: Array, dirty: Array, stats: Sequence[EndpointStats]) -> None:
    """:func:`_fill_numbers` for any values: None, NaN, ±Inf and what is not a number read as no data (NaN),
    each read as ``EndpointStats.sanitized`` reads it; ``dirty`` where a value was not None but no data."""
    width = len(STAT_FIELDS)
    flat = list(chain.from_iterable(map(_ALL, stats)))
    try:
        values = np.array(flat, dtype=float)
    except (TypeError, ValueError, OverflowError):  # not a number somewhere: read each as finite() does
        values = np.array([v if v is None or type(v) is float else finite(v) for v in flat], dtype=float)
    unknown = ~np.isfinite(values)
    if int(unknown.sum()) != flat.count(None):  # some are NaN, ±Inf or unreadable, not None
        for k in np.flatnonzero(unknown).tolist():
            dirty[k // width] |= flat[k] is not None
    values[unknown] = np.nan
    out[:] = values.reshape(-1, width)


_FIELD = tuple(operator.attrgetter(name) for name in STAT_FIELDS)


@functools.lru_cache(maxsize=64)
def _getter(fields: tuple[int, ...]) -> Callable[[EndpointStats], Any]:
    return operator.attrgetter(*(STAT_FIELDS[k] for k in fields))


@dataclass(frozen=True, slots=True)
class ClusterRound:
    """What a plugin sees: one cluster in one round.

    ``addresses``: the ``HOST:PORT`` of the endpoints this stage decides on (filters: those not
    excluded yet; scorers and factors: the eligible ones), ``specs`` their configuration and
    ``columns`` their inputs, all in the same order. ``pool_size``: endpoints of the cluster that are
    not draining. ``now``: the round's time (s, the clock the caller uses for every round).
    ``first_round``: the engine never decided this cluster before. ``engine``: the engine-wide parameters.
    """

    cluster: str
    now: float
    addresses: tuple[str, ...]
    specs: tuple[EndpointSpec, ...]
    columns: Columns
    pool_size: int
    first_round: bool
    engine: EngineParams
    _index: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    def stat(self, name: str) -> Array:
        """The members' input ``name`` (an :class:`EndpointStats` field), ``NaN`` = no data."""
        return self.columns.stats[name]

    def value(self, name: str, i: int) -> float | None:
        """Member ``i``'s input ``name`` as a float, ``None`` for no data."""
        v = float(self.columns.stats[name][i])
        return None if v != v else v

    def index(self) -> Mapping[str, int]:
        """``{address: position}`` of the members (built once per round, on first use)."""
        if not self._index and self.addresses:
            self._index.update((a, i) for i, a in enumerate(self.addresses))
        return self._index

    def take(self, index: Array) -> ClusterRound:
        """The same round over the members at ``index`` (an integer array), in that order."""
        return ClusterRound(self.cluster, self.now, tuple(self.addresses[i] for i in index.tolist()),
                            tuple(self.specs[i] for i in index.tolist()), self.columns.take(index),
                            self.pool_size, self.first_round, self.engine)


@dataclass(frozen=True, slots=True)
class Filter(Generic[P]):
    """``run(round, params, state) -> ({address: reason}, new state)``."""

    name: str
    params: type[P]
    run: Callable[[ClusterRound, P, State], tuple[Mapping[str, str], State]]


@dataclass(frozen=True, slots=True)
class Scorer(Generic[P]):
    """``run(round, params, state) -> (scores: float array, NaN = no data, new state)``; ``default_weight``
    in the mean."""

    name: str
    params: type[P]
    default_weight: float
    run: Callable[[ClusterRound, P, State], tuple[Array, State]]


@dataclass(frozen=True, slots=True)
class Factor(Generic[P]):
    """``run(round, params, state, weights so far: float array) -> (multipliers: float array, new state)``."""

    name: str
    params: type[P]
    run: Callable[[ClusterRound, P, State, Array], tuple[Array, State]]


@dataclass(frozen=True, slots=True)
class PluginSet:
    """The plugins one pipeline runs, by name, each table in run order (names unique across kinds)."""

    filters: Mapping[str, Filter]
    scorers: Mapping[str, Scorer]
    factors: Mapping[str, Factor]

    def params_model(self, name: str) -> type[PluginParams]:
        """The parameter model of plugin ``name``. Raises KeyError for an unknown name."""
        for table in (self.filters, self.scorers, self.factors):
            if name in table:
                return table[name].params
        raise KeyError(name)

    def scorer_weights(self, configured: Mapping[str, float]) -> dict[str, float]:
        """Each scorer's weight in the mean: ``configured`` where given, else the scorer's default."""
        return {name: configured.get(name, s.default_weight) for name, s in self.scorers.items()}


def stateless_scorer(name: str, params: type[P], default_weight: float,
                     fn: Callable[[ClusterRound, P], Array]) -> Scorer[P]:
    """A scorer without state from ``fn(round, params) -> scores`` (float array, NaN = no data)."""

    def run(rnd: ClusterRound, p: P, state: State) -> tuple[Array, State]:
        return fn(rnd, p), state

    return Scorer(name, params, default_weight, run)


def clamp01(x: Array) -> Array:
    """``x`` limited to [0, 1] (NaN -> 0), element-wise.

    >>> clamp01(np.array([-1.0, 0.25, 3.0, np.nan])).tolist()
    [0.0, 0.25, 1.0, 0.0]
    """
    return np.where(x > 0.0, np.minimum(x, 1.0), 0.0)


def score_where(known: Array, x: Array) -> Array:
    """``clamp01(x)`` where ``known`` (a boolean array), ``NaN`` (no data) elsewhere."""
    return np.where(known, clamp01(x), np.nan)
