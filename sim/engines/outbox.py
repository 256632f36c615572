"""The events an engine has produced and not yet handed out (both engine kinds use it)."""

from __future__ import annotations

from sim.engines.api import EngineEvent, Failed, Finished, FirstToken, Tokens

_RANK = {FirstToken: 0, Tokens: 1, Finished: 2, Failed: 2}


class Outbox:
    """Request events waiting for :meth:`drain`; handed out in time order, ties in the order the
    requests were submitted (``order``), and per request a first token before tokens before its end."""

    def __init__(self) -> None:
        self._events: list[tuple[float, int, int, EngineEvent]] = []

    def add(self, t: float, order: int, event: EngineEvent) -> None:
        """Keep ``event`` (at ``t`` s) of the request submitted ``order``-th."""
        self._events.append((t, order, _RANK[type(event)], event))

    def drain(self) -> list[EngineEvent]:
        """Every kept event, sorted; the box is empty after."""
        if not self._events:
            return []
        self._events.sort(key=lambda e: e[:3])
        out = [e[3] for e in self._events]
        self._events = []
        return out
