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
from itertools import repeat
from operator import itemgetter

import numpy as np
from pydantic import Field

from xds_server.engine.ejection import Ejection, EjectionParams, eject
from xds_server.engine.plugin import Array, ClusterRound, Filter, State


class Params(EjectionParams):
    """``consecutive``: OOMs in a row that eject (>= 1); ejection parameters as :class:`EjectionParams`."""

    consecutive: int = Field(3, ge=1)


#: Per endpoint: ``(oom_total, success_total, streak, ejection)``: the counters seen last round (NaN:
#: unknown), the current streak of OOMs and the ejection record (None: never ejected, or decayed).
#: A plain tuple, built by ``zip`` over the round's columns: with a named tuple made per endpoint whose
#: counters moved (every endpoint, in the scale benchmark) the filter took 57–79 ms a round at 60 000
#: endpoints, 26–40 ms with these (GC off as in a round of ``inferlb serve``; 3 interleaved runs, medians
#: of 7 rounds).
_BLANK: tuple[float, float, float, Ejection | None] = (float("nan"), float("nan"), 0.0, None)
#: Endpoints whose state is written per C call (2-4 ms of the GIL each, timed alone with the GC off).
PIECE = 4096


def _delta(now: Array, before: Array) -> Array:
    """New counts since ``before`` (0 when either is unknown; a counter that went down restarted from 0)."""
    return np.where(np.isnan(now) | np.isnan(before), 0.0, np.where(now >= before, now - before, now))


def _run(rnd: ClusterRound, p: Params, state: State) -> tuple[Mapping[str, str], State]:
    n = len(rnd.addresses)
    olds = list(map(state.get, rnd.addresses, repeat(_BLANK, n)))
    old_oom, old_success, old_streak = (np.fromiter(map(itemgetter(k), olds), dtype=float, count=n) for k in range(3))
    oom, success = rnd.stat("oom_total"), rnd.stat("success_total")
    streak = np.where(_delta(success, old_success) > 0, 0.0, old_streak + _delta(oom, old_oom))
    flagged = np.flatnonzero(streak >= p.consecutive).tolist()
    outliers = {rnd.addresses[i]: (streak[i], f"{streak[i]:.0f} consecutive out-of-memory refusals") for i in flagged}
    ejections = {a: s[3] for a, s in state.items() if s[3] is not None}
    reasons, records = eject(rnd, p, ejections, outliers, "oom")
    for a in reasons.keys() & outliers.keys():  # a fresh ejection restarts the streak
        streak[rnd.index()[a]] = 0.0
    out = dict(state)  # endpoints not in this round (an earlier filter took them) keep theirs
    # (their ejection records too: ``eject`` changes members' records only)
    # In pieces: one C call over 60 000 endpoints holds the GIL for ~20 ms, GC off (the event loop waits);
    # between pieces other threads can take it.
    addresses, columns = rnd.addresses, (oom.tolist(), success.tolist(), streak.tolist())
    for start in range(0, n, PIECE):
        end = start + PIECE
        out.update(zip(addresses[start:end], zip(*(c[start:end] for c in columns),
                                                 map(records.get, addresses[start:end]), strict=True), strict=True))
    # Kept: a record with a counter or an ejection (an endpoint that never reported either is forgotten).
    for i in np.flatnonzero(np.isnan(oom) & np.isnan(success)).tolist():
        if out[rnd.addresses[i]][3] is None:
            del out[rnd.addresses[i]]
    return reasons, out


PLUGIN = Filter("oom", Params, _run)
