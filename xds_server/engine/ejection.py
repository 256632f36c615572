"""Outlier-ejection bookkeeping shared by the ejecting filters (pure).

Follows Envoy's outlier detection
(https://www.envoyproxy.io/docs/envoy/latest/intro/arch_overview/upstream/outlier):
an ejected host stays out for ``base_ejection_time x number of times it was ejected``, capped at
``max_ejection_time``; the multiplier decreases again while the host behaves (here: by one per
``base_ejection_s`` without being an outlier); at most ``max_ejection_percent`` of the cluster is
ejected at once, but at least one host may be ("will eject at least one host regardless of the
value", Envoy's ``max_ejection_percent``) — and never every host of the pool.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from pydantic import Field

from xds_server.engine.plugin import ClusterRound, PluginParams


class EjectionParams(PluginParams):
    """``base_ejection_s``: first ejection (s), grows by itself each repeat; ``max_ejection_s``: cap (s);
    ``max_ejection_percent``: share of the pool that may be ejected at once (0–100)."""

    base_ejection_s: float = Field(30.0, gt=0)
    max_ejection_s: float = Field(300.0, gt=0)
    max_ejection_percent: float = Field(30.0, ge=0, le=100)


@dataclass(frozen=True, slots=True)
class Ejection:
    """One endpoint's ejection record: ``times`` ejected (decaying), ejected ``until`` (s) or None,
    ``since``: start of the current calm period (s), for the decay."""

    times: int = 0
    until: float | None = None
    since: float = 0.0


def max_ejected(pool_size: int, percent: float) -> int:
    """How many endpoints of a pool of ``pool_size`` may be ejected at once (>= 1 unless pool <= 1, < pool)."""
    if pool_size <= 1:
        return 0
    return min(pool_size - 1, max(1, int(pool_size * percent / 100.0)))


def eject(rnd: ClusterRound, p: EjectionParams, state: Mapping[str, Ejection],
          outliers: Mapping[str, tuple[float, str]], what: str) -> tuple[dict[str, str], dict[str, Ejection]]:
    """One round of ejection decisions for the round's members.

    ``outliers``: ``{address: (severity, why)}`` of members that misbehave this round (the most
    severe are ejected first when the budget is short). ``state``: the records from the last round.
    Returns ``({address: reason}`` for members out this round, the new records for every address
    that has one). Records of endpoints not in the round (excluded by an earlier stage) are kept.
    """
    now = rnd.now
    new: dict[str, Ejection] = dict(state)
    reasons: dict[str, str] = {}
    ejected_now = 0
    members = rnd.index()
    # Records are few (endpoints ejected or still decaying): walk them, not every member.
    recorded = sorted((members[a], a) for a in state if a in members)
    for _, address in recorded:
        e = state[address]
        if e.until is None:
            continue
        if now < e.until:
            ejected_now += 1
            reasons[address] = (f"{what}: ejected for {e.until - now:.0f} s more "
                                f"(ejection #{e.times}, {min(p.max_ejection_s, p.base_ejection_s * e.times):g} s)")
        else:
            new[address] = replace(e, until=None, since=now)
    budget = max_ejected(rnd.pool_size, p.max_ejection_percent) - ejected_now
    ranked = sorted((a for a in outliers if a not in reasons), key=lambda a: (-outliers[a][0], a))
    for address in ranked:
        if budget <= 0:
            break
        e = new.get(address, Ejection())
        times = e.times + 1
        duration = min(p.max_ejection_s, p.base_ejection_s * times)
        new[address] = Ejection(times, now + duration, now)
        reasons[address] = f"{what}: {outliers[address][1]}; ejected for {duration:g} s (ejection #{times})"
        budget -= 1
    for address in [a for a in new if a in members]:
        e = new[address]
        if address in reasons or address in outliers:
            continue
        if e.times > 0 and now - e.since >= p.base_ejection_s:
            e = Ejection(e.times - 1, None, now)
        new[address] = e
        if e.times == 0:
            del new[address]
    return reasons, new
