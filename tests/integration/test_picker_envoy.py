"""The picker on real Envoy: in-flight counting from the access log, sessions, body routing,
canary split, admission control, hung picker.

One stack for the module (simulated backends at time scale 0.2, real Prometheus, inferlb, Envoy).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from .conftest import Stack, start_stack, stop_stack, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def picker_stack(tmp_path_factory) -> Iterator[Stack]:
    """v1: two A100-class backends; v2: one."""
    s = start_stack(tmp_path_factory.mktemp("picker"), [("v1", "a100"), ("v1", "a100"), ("v2", "a100")])
    yield s
    stop_stack(s)


def test_in_flight_counts_follow_envoy_access_log_completions(picker_stack: Stack):
    s = picker_stack
    inflight = s.app.picker.inflight
    s.send({"x-session-id": "warm-up"})
    wait_until(lambda: inflight.streams >= 1 and not inflight.clusters, 5, 0.02,
               "Envoy's access-log stream and the first completion")
    v1 = {b.address for b in s.backends if b.version == "v1"}
    for b in s.backends:
        b.fault(slow_factor=20)  # ~200 ms per request at time scale 0.2
    try:
        results: list[int] = []
        threads = [threading.Thread(target=lambda i=i: results.append(
            s.send({"x-session-id": f"inflight-{i}"}).status_code)) for i in range(6)]
        for t in threads:
            t.start()
        seen = wait_until(lambda: dict(inflight.endpoints) if sum(inflight.endpoints.values()) == 6 else None,
                          3, 0.005, "six pinned requests in flight")
        assert set(seen) <= v1
        assert inflight.clusters == {"chat-v1": 6}
        for t in threads:
            t.join()
        assert results == [200] * 6
        # Completions arrive within the flush interval (5 ms) plus Envoy's batching.
        wait_until(lambda: not inflight.endpoints and not inflight.clusters, 1, 0.005,
                   "every completion to come back")
    finally:
        for b in s.backends:
            b.fault(reset=True)
