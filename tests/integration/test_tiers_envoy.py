"""Edge -> cloud tiers on real Envoy: the picker spills to the cloud tier at the edge's threshold, and
without the picker Envoy's priority levels send the cloud tier traffic only when the edge is not
healthy enough.

Layout (both stacks): v1 = two edge backends (max_concurrency 2 each: capacity 4, so at the default
threshold of 60 % the edge holds 3 requests) and one cloud backend.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator

import pytest
import requests

from inferlb.devstack.envoy_admin import envoy_hosts
from tests.integration.conftest import Stack, start_stack, stop_stack, wait_until

pytestmark = pytest.mark.integration

LAYOUT = [("v1", "a100"), ("v1", "a100"), ("v1", "a100")]
TIERS = {"services": [{"versions": [{"endpoints": [{"max_concurrency": 2}, {"max_concurrency": 2},
                                                   {"tier": "cloud"}]}]}]}


@pytest.fixture(scope="module")
def picker_stack(tmp_path_factory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("tiers-picker"), LAYOUT, config=TIERS)
    yield s
    stop_stack(s)


@pytest.fixture(scope="module")
def fallback_stack(tmp_path_factory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("tiers-fallback"), LAYOUT, config={**TIERS, "envoy": {"picker": False}})
    yield s
    stop_stack(s)


def served_by(s: Stack, n: int, headers: dict[str, str] | None = None) -> Counter:
    """``{backend address: requests}`` of ``n`` sequential requests (each answered 200)."""
    out: Counter = Counter()
    for i in range(n):
        r = s.send({"x-request-id": f"tiers-{i}", **(headers or {})})
        assert r.status_code == 200, r.text
        out[r.headers["x-served-by"]] += 1
    return out


def test_the_picker_keeps_requests_on_the_edge_under_the_threshold_and_spills_at_it(picker_stack: Stack):
    s = picker_stack
    edge, cloud = [b.address for b in s.backends[:2]], s.backends[2].address

    def on_edge() -> int:
        return sum(s.app.picker.control.inflight.endpoints.get(e, 0) for e in edge)

    # One at a time the edge is never above 1/4 of its capacity: the cloud gets nothing.
    seen = served_by(s, 20) + served_by(s, 10, {"x-session-id": "tiers-one"})
    assert seen[cloud] == 0 and sum(seen.values()) == 30
    # Hold requests on the edge: the first 3 (3/4 >= 60 % after the third) stay there, the rest spill.
    for b in s.backends[:2]:
        b.fault(hang=True)
    held = [threading.Thread(target=lambda: requests.post(f"{s.listener}/v1/chat/completions", json={
        "max_tokens": 8, "messages": []}, timeout=30), daemon=True) for _ in range(3)]
    try:
        for n, t in enumerate(held, start=1):
            t.start()
            wait_until(lambda n=n: on_edge() == n, 10, 0.02, "the held request to be counted on the edge")
        spilled = served_by(s, 6) + served_by(s, 4, {"x-session-id": "tiers-two"})
        assert spilled == Counter({cloud: 10})
        assert on_edge() == 3
    finally:
        for b in s.backends[:2]:
            b.fault(reset=True)
        for t in held:
            t.join(30)
    # The held requests finished: the edge takes the traffic again.
    wait_until(lambda: on_edge() == 0, 10, what="the held requests' completions")
    assert served_by(s, 10)[cloud] == 0


def unhealthy(s: Stack, addresses: list[str]) -> None:
    """Stop the backends' metrics until Envoy has them UNHEALTHY (stale metrics, from the engine over EDS)."""
    for b in s.backends:
        if b.address in addresses:
            b.fault(metrics="error")
    wait_until(lambda: all(envoy_hosts(s.envoy_admin)["chat-v1"][a]["health"] == "UNHEALTHY" for a in addresses),
               30, what=f"{addresses} UNHEALTHY in Envoy")


def healthy(s: Stack) -> None:
    for b in s.backends:
        b.fault(reset=True)
    wait_until(lambda: all(h["health"] == "HEALTHY" for h in envoy_hosts(s.envoy_admin)["chat-v1"].values()), 30,
               what="every endpoint HEALTHY in Envoy")


def test_without_the_picker_envoy_sends_the_cloud_traffic_only_when_the_edge_is_not_healthy_enough(
        fallback_stack: Stack):
    """Envoy's priority load with the default overprovisioning factor 1.4: all of it on priority 0
    while the edge is healthy; 50 % of the edge healthy -> 70 % edge / 30 % cloud; none -> all cloud."""
    s = fallback_stack
    edge, cloud = [b.address for b in s.backends[:2]], s.backends[2].address
    seen = served_by(s, 40)
    assert seen[cloud] == 0 and set(seen) <= set(edge)
    try:
        unhealthy(s, edge[:1])
        seen = served_by(s, 200)
        assert seen[edge[0]] == 0
        assert 0.15 < seen[cloud] / 200 < 0.45, seen   # 30 % expected: binomial sd 3.2 %
        unhealthy(s, edge)
        assert served_by(s, 20) == Counter({cloud: 20})
    finally:
        healthy(s)
    seen = served_by(s, 40)
    assert seen[cloud] == 0
