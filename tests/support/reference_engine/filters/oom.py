"""``oom``: ejects an endpoint after ``consecutive`` out-of-memory refusals in a row.

From the cumulative counters ``oom_total`` and ``success_total``: each round adds the new OOMs to
the endpoint's streak, and any new success resets it (the order of requests inside one round is not
known, so a round with successes counts as "not consecutive"). A counter that goes down was reset
(the backend restarted) and counts from 0. The GPU-memory filter keeps requests away from a full
GPU before it refuses them; this one catches an endpoint that refuses everything (a loop on OOM).
Ejection times and ``max_ejection_percent`` follow :mod:`..ejection`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import Field

from tests.support.reference_engine.ejection import Ejection, EjectionParams, eject
from tests.support.reference_engine.plugin import ClusterRound, Filter, State


class Params(EjectionParams):
    """``consecutive``: OOMs in a row that eject (>= 1); ejection parameters as :class:`EjectionParams`."""

    consecutive: int = Field(3, ge=1)


@dataclass(frozen=True, slots=True)
class OomState:
    """Per endpoint: the counters seen last round, the current streak and the ejection record."""

    oom_total: float | None = None
    success_total: float | None = None
    streak: float = 0.0
    ejection: Ejection | None = None


def _delta(now: float | None, before: float | None) -> float:
    if now is None or before is None:
        return 0.0
    return now - before if now >= before else now


def _run(rnd: ClusterRound, p: Params, state: State) -> tuple[Mapping[str, str], State]:
    counters: dict[str, OomState] = dict(state)
    outliers: dict[str, tuple[float, str]] = {}
    fresh = OomState()
    for m in rnd.members:
        old = counters.get(m.address, fresh)
        st = m.stats
        ooms = _delta(st.oom_total, old.oom_total)
        successes = _delta(st.success_total, old.success_total)
        streak = 0.0 if successes > 0 else old.streak + ooms
        if (st.oom_total, st.success_total, streak) != (old.oom_total, old.success_total, old.streak):
            counters[m.address] = OomState(st.oom_total, st.success_total, streak, old.ejection)
        if streak >= p.consecutive:
            outliers[m.address] = (streak, f"{streak:.0f} consecutive out-of-memory refusals")
    ejections = {a: s.ejection for a, s in counters.items() if s.ejection is not None}
    reasons, new = eject(rnd, p, ejections, outliers, "oom")
    out: dict[str, OomState] = {}
    for address, s in counters.items():
        e = new.get(address)
        streak = 0.0 if address in reasons and address in outliers else s.streak  # a fresh ejection restarts it
        if e is not None or s.oom_total is not None or s.success_total is not None:
            out[address] = s if (e is s.ejection and streak == s.streak) else OomState(
                s.oom_total, s.success_total, streak, e)
    return reasons, out


PLUGIN = Filter("oom", Params, _run)
