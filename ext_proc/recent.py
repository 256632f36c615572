"""The endpoints a picker keeps prefix-cache state for: pinnable now, or within the last ``keep_s``.

An endpoint leaves the view's pinnable endpoints whenever its EDS health is not HEALTHY: a drain, an
ejection, or a single metrics round that found its samples stale. Its KV cache outlives such a flap.
Forgotten at once, the picker's prefix-cache index would route as if that cache were empty when the
endpoint came back. With ``picker.prefix_source: kv_events`` the loss is worse: the events
published meanwhile would be dropped, and with ``keys: vllm`` every block stored later on top of an
unseen one is unmatchable. The case was seen in CI: one 1 s stale flag during
``tests/integration/test_kv_events_envoy.py`` left a prompt's blocks missing from the index for good.
So :class:`ext_proc.requestcontrol.RequestControl`'s housekeeping (the index) and
:class:`ext_proc.kv_events.KvEventFeed` (the subscriptions) keep an endpoint for
:data:`KEEP_S` after it was last pinnable. The pickers still choose among the pinnable endpoints
only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from ext_proc.view import EndpointView

__all__ = ["KEEP_S", "RecentEndpoints", "pinnable"]

#: How long an endpoint that is no longer pinnable keeps its prefix-cache state (s): longer than a
#: stale-metrics flap or an outlier ejection's first back-off, short enough that a removed endpoint's
#: state does not linger.
KEEP_S = 60.0


def pinnable(view: EndpointView) -> list[str]:
    """Every pinnable endpoint of ``view``: each cluster's and its spill tier's (may repeat)."""
    return [e for p in view.clusters.values() for t in (p, p.spill) if t is not None for e in t.endpoints]


class RecentEndpoints:
    """The endpoints seen pinnable within the last ``keep_s`` seconds (s, >= 0) by ``clock`` (monotonic s).

    Raises:
        ValueError: ``keep_s`` is negative.
    """

    def __init__(self, keep_s: float = KEEP_S, clock: Callable[[], float] = time.monotonic) -> None:
        if keep_s < 0:
            raise ValueError(f"keep_s must be >= 0, got {keep_s}")
        self._keep, self._clock = keep_s, clock
        self._seen: dict[str, float] = {}

    def update(self, endpoints: Iterable[str]) -> set[str]:
        """Record ``endpoints`` as pinnable now; returns them with those pinnable within ``keep_s``.
        O(endpoints seen): call it once per housekeeping round, not per request."""
        now = self._clock()
        seen = self._seen
        seen.update(dict.fromkeys(endpoints, now))
        limit = now - self._keep
        for e in [e for e, at in seen.items() if at < limit]:
            del seen[e]
        return set(seen)
