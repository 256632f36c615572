"""Edge -> cloud figures of one run (pure), for scenarios with cloud nodes (``edge_cloud``).

- ``edge_peak_load``: the most requests in flight on the edge nodes at once during the measured
  window, over the edge tier's max concurrency (0-1 at or under it; the picker's threshold is
  ``picker.spill_threshold``, 0.6 by default). Counted from the edge nodes' own request spans
  (:mod:`bench.quality.spans`: from a request's arrival at the node to the release of its slot), so
  it is what the edge ran and queued, not requests still on their way to it;
- ``cloud_share``: share of the measured successful requests the cloud nodes served;
- ``cloud_share_calm``: the share of the requests that reached a node during the measured window
  (node-side spans, edge and cloud) that reached a cloud node, among those that arrived while the
  edge nodes held at most ``threshold x capacity - CALM_SLACK`` requests: the edge was under the
  threshold with room to spare. The slack covers what the nodes have and the picker does not see
  yet, or still counts: a pick on its way to its node, and a completion that reaches the picker
  a few ms after the node let it go (Envoy's access-log flush). The client's view is not used
  for it: in a traced run (2026-12-02) it counted up to 3 requests fewer on the edge than the
  edge nodes held at the moments the picker spilled (its own send and answer times lag);
- ``edge_oom_rate``: share of the measured requests answered by an edge node that were an OOM.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from bench.quality.spans import in_flight_at, peak_in_flight
from bench.quality.trace import TraceRequest
from inferlb.devstack.loadgen import Result

TIER_FIGURES: tuple[str, ...] = ("edge_peak_load", "cloud_share", "cloud_share_calm", "edge_oom_rate")
#: Requests below the threshold that count as "under it" for ``cloud_share_calm``.
CALM_SLACK = 2


def _rate(n: int, d: int) -> float | None:
    return None if d == 0 else n / d


def tier_figures(trace: Sequence[TraceRequest], results: Sequence[Result], warmup_s: float, started: float,
                 edge: Collection[str], cloud: Collection[str], edge_capacity: int,
                 threshold: float, edge_spans: Sequence[tuple[float, float]],
                 cloud_spans: Sequence[tuple[float, float]]) -> dict[str, float | None]:
    """The figures of the module docstring. ``started``: wall time (s) the replay began (trace time 0);
    ``edge`` / ``cloud``: node addresses; ``edge_capacity``: the edge's max concurrency (> 0);
    ``edge_spans`` / ``cloud_spans``: every edge / cloud node's request spans (wall s), together.

    Raises:
        ValueError: ``edge_capacity`` <= 0 or a result without its trace index.
    """
    if edge_capacity <= 0:
        raise ValueError(f"edge_capacity must be > 0, got {edge_capacity}")
    if any(r.index is None for r in results):
        raise ValueError("every result needs its trace index (use loadgen.replay)")
    window_start = started + warmup_s
    peak = peak_in_flight(edge_spans, window_start)
    edge_held = in_flight_at(edge_spans)
    calm_limit = threshold * edge_capacity - CALM_SLACK
    calm_edge = sum(1 for a, _ in edge_spans if a >= window_start and edge_held(a) <= calm_limit)
    calm_cloud = sum(1 for a, _ in cloud_spans if a >= window_start and edge_held(a) <= calm_limit)
    measured = [r for r in results if trace[r.index].at_s >= warmup_s]  # type: ignore[index]
    ok = [r for r in measured if 200 <= r.status < 300 and (r.served_by in edge or r.served_by in cloud)]
    edge_answers = [r for r in measured if r.served_by in edge]
    return {
        "edge_peak_load": peak / edge_capacity,
        "cloud_share": _rate(sum(1 for r in ok if r.served_by in cloud), len(ok)),
        "cloud_share_calm": _rate(calm_cloud, calm_edge + calm_cloud),
        "edge_oom_rate": _rate(sum(1 for r in edge_answers if r.error == "oom"), len(edge_answers)),
    }
