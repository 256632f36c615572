"""The edge -> cloud figures of a run (bench/quality/tiers.py): client-side intervals, and the edge
nodes' own request spans for the peak (bench/quality/spans.py)."""

from __future__ import annotations

import pytest

from bench.quality.tiers import CALM_SLACK, tier_figures
from bench.quality.trace import TraceRequest
from inferlb.devstack.loadgen import Result, Session

EDGE, CLOUD = {"e1", "e2"}, {"c1"}


def run(requests: list[tuple[float, float, str, str | None]]):
    """``(send s, latency s, node, error)`` per request -> (trace, results); the replay started at 100."""
    trace = [TraceRequest(send, None, 0, None, None) for send, _, _, _ in requests]
    results = [Result(Session(None, None), 500 if error else 200, latency * 1000, node, "v1",
                      100.0 + send + latency, error, i) for i, (send, latency, node, error) in enumerate(requests)]
    return trace, results


def figures(requests, warmup_s=0.0, capacity=10, threshold=0.6, edge_spans=(), cloud_spans=()):
    trace, results = run(requests)
    return tier_figures(trace, results, warmup_s, 100.0, EDGE, CLOUD, capacity, threshold, edge_spans, cloud_spans)


def test_the_edge_peak_is_the_most_requests_the_edge_nodes_held_at_once_in_the_window():
    requests = [(0.0, 1.0, "e1", None), (0.1, 1.0, "e2", None), (0.3, 1.0, "c1", None)]
    # Node-side spans (wall s; the replay started at 100): three overlap at 100.25-100.3, one of them
    # before the 0.2 s warm-up ended; the four after it overlap two at a time.
    spans = [(100.0, 100.3), (100.1, 100.9), (100.25, 101.0), (102.0, 102.5), (102.4, 102.6), (102.55, 103.0)]
    f = figures(requests, edge_spans=spans)
    assert f["edge_peak_load"] == pytest.approx(0.3)
    assert figures(requests, warmup_s=0.35, edge_spans=spans)["edge_peak_load"] == pytest.approx(0.2)
    # The client saw two edge requests in flight; the peak is the nodes' count, not the client's.
    assert figures(requests)["edge_peak_load"] == 0.0
    assert f["cloud_share"] == pytest.approx(1 / 3) and f["edge_oom_rate"] == 0.0


def test_cloud_requests_count_as_calm_only_when_the_edge_nodes_were_well_under_the_threshold():
    # Threshold 0.6 x 10 = 6: calm = at most 6 - CALM_SLACK = 4 requests held by the edge nodes at
    # a request's arrival at its node (node-side spans, wall s; the replay started at 100).
    assert CALM_SLACK == 2
    busy = [(100.0 + 0.01 * i, 105.0) for i in range(6)]   # 6 held from 100.05 s to 105 s
    cloud = [(101.0, 101.1), (106.0, 106.1)]                 # arrived with 6 held, then with none
    f = figures([(0.0, 0.1, "e1", None)], edge_spans=busy, cloud_spans=cloud)
    # Calm: the first five edge arrivals (0-4 held before each) and the cloud one at 106 s.
    assert f["cloud_share_calm"] == pytest.approx(1 / 6)
    # The warm-up's arrivals are not counted: from 100.03 s, two edge arrivals (3 and 4 held) and 106 s.
    assert figures([(0.0, 0.1, "e1", None)], warmup_s=0.03, edge_spans=busy,
                   cloud_spans=cloud)["cloud_share_calm"] == pytest.approx(1 / 3)
    assert figures([(0.0, 0.1, "e1", None)])["cloud_share_calm"] is None   # nothing arrived


def test_edge_ooms_and_the_warm_up():
    f = figures([(0.0, 0.1, "e1", "oom"), (2.0, 0.1, "e1", "oom"), (2.5, 0.1, "e2", None), (3.0, 0.1, "c1", "oom")],
                warmup_s=1.0)
    assert f["edge_oom_rate"] == pytest.approx(1 / 2)   # the warm-up's OOM and the cloud's are not counted
    assert f["cloud_share"] == 0.0                      # of the successful measured requests


def test_a_zero_capacity_is_refused():
    with pytest.raises(ValueError, match="edge_capacity"):
        figures([(0.0, 0.1, "e1", None)], capacity=0)
