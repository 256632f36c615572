"""The plugin contract of the weight engine: filters, scorers and factors.

A plugin is a pure function of one cluster's round (:class:`ClusterRound`), its parameters (a
frozen pydantic model: the YAML under ``engine.filters.<name>``, ``engine.scorers.<name>`` or
``engine.factors.<name>`` is validated into it) and its own state from the previous round
(``{address: value}``, immutable values). It returns its verdicts and its new state. A new plugin
is one module that builds one of :class:`Filter`, :class:`Scorer` or :class:`Factor`, plus one line
in :mod:`tests.support.reference_engine.builtin`.

- A **filter** returns ``{address: reason}`` for endpoints that must not take new traffic.
- A **scorer** returns ``{address: score in [0, 1] or None}`` (``None`` = no data; 1 = best).
- A **factor** returns ``{address: multiplier > 0}`` applied to the weight (capacity, slow start,
  balance correction); it sees the weights computed so far.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict

from xds_server.engine.types import EndpointSpec, EngineParams
from xds_server.metrics.stats import EndpointStats


class PluginParams(BaseModel):
    """Base of every plugin's parameters: frozen, unknown keys refused (the error names them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class NoParams(PluginParams):
    """For plugins without parameters."""


P = TypeVar("P", bound=PluginParams)

#: A plugin's state for one cluster: ``{address: value}`` (values immutable).
State = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Member:
    """One endpoint in a round: its configuration and its (sanitised) statistics; ``address``: its
    ``HOST:PORT`` (``spec.address``, kept as a field: plugins read it per endpoint per round)."""

    spec: EndpointSpec
    stats: EndpointStats
    address: str = ""

    def __post_init__(self) -> None:
        if not self.address:
            object.__setattr__(self, "address", self.spec.address)


@dataclass(frozen=True, slots=True)
class ClusterRound:
    """What a plugin sees: one cluster in one round.

    ``members``: the endpoints this stage decides on (filters: those not excluded yet; scorers and
    factors: the eligible ones). ``pool_size``: endpoints of the cluster that are not draining.
    ``now``: the round's time (s, the clock the caller uses for every round). ``first_round``: the
    engine never decided this cluster before. ``engine``: the engine-wide parameters.
    """

    cluster: str
    now: float
    members: tuple[Member, ...]
    pool_size: int
    first_round: bool
    engine: EngineParams


@dataclass(frozen=True, slots=True)
class Filter(Generic[P]):
    """``run(round, params, state) -> ({address: reason}, new state)``."""

    name: str
    params: type[P]
    run: Callable[[ClusterRound, P, State], tuple[Mapping[str, str], State]]


@dataclass(frozen=True, slots=True)
class Scorer(Generic[P]):
    """``run(round, params, state) -> ({address: score or None}, new state)``; ``default_weight`` in the mean."""

    name: str
    params: type[P]
    default_weight: float
    run: Callable[[ClusterRound, P, State], tuple[Mapping[str, float | None], State]]


@dataclass(frozen=True, slots=True)
class Factor(Generic[P]):
    """``run(round, params, state, weights so far) -> ({address: multiplier}, new state)``."""

    name: str
    params: type[P]
    run: Callable[[ClusterRound, P, State, Mapping[str, float]], tuple[Mapping[str, float], State]]


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


def per_endpoint_filter(name: str, params: type[P],
                        fn: Callable[[Member, P, ClusterRound], str | None]) -> Filter[P]:
    """A stateless filter from ``fn(member, params, round) -> reason or None``."""

    def run(rnd: ClusterRound, p: P, state: State) -> tuple[Mapping[str, str], State]:
        out = {}
        for m in rnd.members:
            reason = fn(m, p, rnd)
            if reason:
                out[m.address] = reason
        return out, state

    return Filter(name, params, run)


def per_endpoint_scorer(name: str, params: type[P], default_weight: float,
                        fn: Callable[[Member, P, ClusterRound], float | None]) -> Scorer[P]:
    """A stateless scorer from ``fn(member, params, round) -> score or None``."""

    def run(rnd: ClusterRound, p: P, state: State) -> tuple[Mapping[str, float | None], State]:
        return {m.address: fn(m, p, rnd) for m in rnd.members}, state

    return Scorer(name, params, default_weight, run)


def clamp01(x: float) -> float:
    """``x`` limited to [0, 1] (NaN -> 0)."""
    return 0.0 if not x > 0.0 else 1.0 if x > 1.0 else x
