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
from typing import NamedTuple

import numpy as np
from pydantic import Field

from xds_server.engine.ejection import Ejection, EjectionParams, eject
from xds_server.engine.plugin import Array, ClusterRound, Filter, State


class Params(EjectionParams):
    """``consecutive``: OOMs in a row that eject (>= 1); ejection parameters as :class:`EjectionParams`."""

    consecutive: int = Field(3, ge=1)


class OomState(NamedTuple):
    """Per endpoint: the counters seen last round, the current streak and the ejection record."""

    oom_total: float | None = None
    success_total: float | None = None
    streak: float = 0.0
    ejection: Ejection | None = None


def _delta(now: Array, before: Array) -> Array:
    """New counts since ``before`` (0 when either is unknown; a counter that went down restarted from 0)."""
    return np.where(np.isnan(now) | np.isnan(before), 0.0, np.where(now >= before, now - before, now))


def _same(a: Array, b: Array) -> Array:
    """Element-wise equality where two unknowns (NaN) are the same."""
    return (a == b) | (np.isnan(a) & np.isnan(b))


def _none(v: float) -> float | None:
    return None if v != v else v


def _run(rnd: ClusterRound, p: Params, state: State) -> tuple[Mapping[str, str], State]:
    counters: dict[str, OomState] = dict(state)
    fresh = OomState()
    olds = [counters.get(a, fresh) for a in rnd.addresses]
    nan = float("nan")
    old_oom = np.array([nan if o.oom_total is None else o.oom_total for o in olds], dtype=float)
    old_success = np.array([nan if o.success_total is None else o.success_total for o in olds], dtype=float)
    old_streak = np.array([o.streak for o in olds], dtype=float)
    oom, success = rnd.stat("oom_total"), rnd.stat("success_total")
    streak = np.where(_delta(success, old_success) > 0, 0.0, old_streak + _delta(oom, old_oom))
    changed = ~(_same(oom, old_oom) & _same(success, old_success) & (streak == old_streak))
    at = np.flatnonzero(changed).tolist()
    counters.update(zip([rnd.addresses[i] for i in at], map(OomState._make, zip(
        map(_none, oom[changed].tolist()), map(_none, success[changed].tolist()), streak[changed].tolist(),
        [olds[i].ejection for i in at], strict=True)), strict=True))
    outliers = {rnd.addresses[i]: (s, f"{s:.0f} consecutive out-of-memory refusals")
                for i, s in zip(np.flatnonzero(streak >= p.consecutive).tolist(),
                                streak[streak >= p.consecutive].tolist(), strict=True)}
    ejections = {a: s.ejection for a, s in counters.items() if s.ejection is not None}
    reasons, new = eject(rnd, p, ejections, outliers, "oom")
    # Kept: a record with a counter or an ejection. Only the ejected (before or now) change here.
    out = {a: s for a, s in counters.items()
           if s.oom_total is not None or s.success_total is not None or s.ejection is not None}
    for address in {*new, *ejections, *(reasons.keys() & outliers.keys())}:
        s = counters[address]
        e = new.get(address)
        streak_now = 0.0 if address in reasons and address in outliers else s.streak  # a fresh ejection restarts it
        if e is not None or s.oom_total is not None or s.success_total is not None:
            out[address] = s if (e is s.ejection and streak_now == s.streak) else OomState(
                s.oom_total, s.success_total, streak_now, e)
        else:
            out.pop(address, None)
    return reasons, out


PLUGIN = Filter("oom", Params, _run)
