"""One load view across two gateways on real Envoy: two Envoy + standalone picker pairs share two
backends; the second picker decides on the first one's requests in flight (issue 16).

Each gateway takes its listener and its picker from its bootstrap (:mod:`inferlb.devstack.gateway`),
clusters and endpoints from the control plane; both pickers report to the control plane's load view.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator

import pytest
import requests

from inferlb.devstack import stack
from inferlb.devstack.gateway import gateway_bootstrap, start_gateway_picker
from tests.integration.conftest import Stack, start_stack, stop_stack, wait_until

pytestmark = pytest.mark.integration

HEAVY = 4  # slow requests of one session sent through gateway 1


@pytest.fixture(scope="module")
def two_gateways(tmp_path_factory) -> Iterator[tuple[Stack, list[str], list[stack.Proc]]]:
    s = start_stack(tmp_path_factory.mktemp("gateways"), [("v1", "a100"), ("v1", "a100")])
    procs: list[stack.Proc] = []
    listeners = []
    try:
        xds = f"127.0.0.1:{s.app.xds_port}"
        for i in (1, 2):
            picker_port, listener, admin = stack.free_port(), stack.free_port(), stack.free_port()
            procs.append(start_gateway_picker(xds, picker_port, s.workdir, f"gw-{i}"))
            boot = gateway_bootstrap(s.cfg, xds_address=xds, node_id=f"gw-{i}-envoy", admin_port=admin,
                                     listener_port=listener, picker_address=f"127.0.0.1:{picker_port}")
            envoy = stack.start_envoy(boot, s.workdir, admin, name=f"envoy-gw-{i}")
            procs.append(envoy)
            stack.wait_http(f"http://127.0.0.1:{admin}/ready", envoy, timeout=20)
            listeners.append(f"http://127.0.0.1:{listener}")
        yield s, listeners, procs
    finally:
        for p in reversed(procs):
            p.stop()
        stop_stack(s)


def pickers(s: Stack) -> dict[str, dict]:
    doc = requests.get(f"{s.admin}/api/v1/pickers", timeout=5).json()
    return {p["picker"]: p for p in doc["pickers"]}


def saturation(s: Stack) -> float:
    """The control plane's exported ``inferlb_cluster_saturation_ratio`` of chat-v1."""
    text = requests.get(f"{s.admin}/metrics", timeout=5).text
    [value] = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("inferlb_cluster_saturation_ratio{") and 'cluster="chat-v1"' in line]
    return value


def send(listener: str, headers: dict[str, str] | None = None, timeout: float = 30) -> requests.Response:
    return requests.post(f"{listener}/v1/chat/completions", json={"max_tokens": 8, "messages": []},
                         headers={"model-version": "v1", **(headers or {})}, timeout=timeout)


def served_by(listener: str) -> str:
    """The endpoint that answered one request through ``listener``; ``"held"`` when it did not answer
    within 10 s (a request sent to the endpoint whose requests the test holds)."""
    try:
        return send(listener, timeout=10).headers["x-served-by"]
    except requests.Timeout:
        return "held"


def test_the_second_picker_sees_the_first_pickers_requests_in_flight(two_gateways):
    s, (gw1, gw2), procs = two_gateways
    wait_until(lambda: {"gw-1", "gw-2"} <= set(pickers(s)), 15, what="both pickers report")
    for r in (send(gw1), send(gw2)):  # both gateways route (and their pickers pin: x-served-by is a backend)
        assert r.status_code == 200, r.text
    # The heavy session's endpoint holds its requests until the test lets them go (the "hang" fault), so
    # they stay in flight however slowly this machine runs; the other endpoint answers at once.
    first = send(gw1, {"x-session-id": "heavy"})
    assert first.status_code == 200, first.text
    busy = first.headers["x-served-by"]
    [held] = [b for b in s.backends if b.address == busy]
    held.fault(hang=True)
    heavy: list[requests.Response] = []
    threads = [threading.Thread(target=lambda: heavy.append(send(gw1, {"x-session-id": "heavy"})))
               for _ in range(HEAVY)]
    for t in threads:
        t.start()
    try:
        loaded = wait_until(lambda: (p := pickers(s)).get("gw-1", {}).get("in_flight") == HEAVY and p, 10,
                            what="gateway 1's requests in flight in the view")
        [row] = loaded["gw-1"]["endpoints"]
        assert row["endpoint"] == busy  # the session stayed on its endpoint
        assert loaded["gw-1"]["share"] == 1.0 and loaded["gw-2"]["in_flight"] == 0
        # The autoscaling signal counts the fleet's requests, not only the in-process picker's (0 here).
        capacity = sum(e.max_concurrency for e in s.cfg.services[0].versions[0].endpoints)
        assert saturation(s) == pytest.approx(HEAVY / capacity)
        seq = loaded["gw-2"]["seq"]
        wait_until(lambda: pickers(s)["gw-2"]["seq"] >= seq + 2, 5, what="gateway 2 got a view since")
        served = Counter(served_by(gw2) for _ in range(10))
        # Alone, picker 2 sees two idle endpoints and draws between them (about half each); with the
        # view, the endpoint holding gateway 1's requests is the more loaded one.
        assert set(served) == {b.address for b in s.backends} - {busy}, served
    finally:
        held.fault(reset=True)
        for t in threads:
            t.join(30)
    assert [r.status_code for r in heavy] == [200] * HEAVY
    wait_until(lambda: pickers(s)["gw-1"]["in_flight"] == 0, 10, what="completions reach picker 1")
    procs[0].stop()  # picker 1 dies: it stops counting
    wait_until(lambda: "gw-1" not in pickers(s), 5, what="picker 1 leaves the view")
