"""Requests in flight from picks and access-log completions; bounded loads fed by them."""

from __future__ import annotations

import math

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from ext_proc.accesslog import record_completions
from ext_proc.inflight import InFlight
from ext_proc.ring import HashRing


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_picks_minus_completions_per_endpoint_and_cluster():
    f = InFlight(expiry_s=10)
    f.picked("c1", "a:1")
    f.picked("c1", "a:1")
    f.picked("c1", None)
    f.picked("c2", "b:1")
    assert f.endpoints == {"a:1": 2, "b:1": 1}
    assert f.clusters == {"c1": 3, "c2": 1}
    assert f.completed("c1", "a:1")
    assert f.completed("c1", None)
    assert f.endpoints == {"a:1": 1, "b:1": 1}
    assert f.clusters == {"c1": 1, "c2": 1}
    assert f.completed("c1", "a:1") and f.completed("c2", "b:1")
    assert f.endpoints == {} and f.clusters == {}


def test_a_completion_nobody_waited_for_is_ignored():
    f = InFlight(expiry_s=10)
    assert not f.completed("c1", "a:1")
    f.picked("c1", "a:1")
    assert f.endpoints == {"a:1": 1}, "an earlier stray completion must not cancel a later pick"


def test_lost_records_expire_oldest_first():
    clock = Clock()
    f = InFlight(expiry_s=30, clock=clock)
    f.picked("c", "a:1")
    clock.now += 20
    f.picked("c", "a:1")
    clock.now += 15  # the first pick is 35 s old, the second 15 s
    assert f.expire() == 1
    assert f.endpoints == {"a:1": 1} and f.clusters == {"c": 1}
    clock.now += 20
    assert f.expire() == 1
    assert f.endpoints == {} and f.clusters == {}


def test_expiry_must_be_positive():
    with pytest.raises(ValueError, match="expiry_s"):
        InFlight(expiry_s=0)


def log_message(*entries: tuple[str | None, str | None], request_ids: tuple[str, ...] = ()) -> bytes:
    msg = als_pb2.StreamAccessLogsMessage()
    for i, (cluster, pin) in enumerate(entries):
        e = accesslog_pb2.HTTPAccessLogEntry()
        if i < len(request_ids):
            e.request.request_id = request_ids[i]
        if cluster is not None:
            e.request.request_headers["x-inferlb-cluster"] = cluster
        if pin is not None:
            e.request.request_headers["x-gateway-destination-endpoint"] = pin
        msg.http_logs.log_entry.append(e)
    return msg.SerializeToString()


def test_access_log_entries_complete_what_they_name():
    f = InFlight(expiry_s=10)
    for _ in range(2):
        f.picked("chat-v1", "10.0.0.1:8000")
    f.picked("chat-v2", None)
    data = log_message(("chat-v1", "10.0.0.1:8000"), ("chat-v2", None), (None, None))
    assert record_completions(data, f, "x-inferlb-cluster", "x-gateway-destination-endpoint") == 2
    assert f.endpoints == {"10.0.0.1:8000": 1} and f.clusters == {"chat-v1": 1}
    assert record_completions(log_message(("chat-v1", "10.0.0.1:8000")), f,
                              "x-inferlb-cluster", "x-gateway-destination-endpoint") == 1
    assert f.endpoints == {} and f.clusters == {}


def test_an_entry_without_the_pickers_headers_releases_the_pick_with_its_request_id():
    """Envoy failed open (the answer came after its ext_proc timeout): the entry has no cluster
    header, and its x-request-id names the pick; an unknown id releases nothing."""
    f = InFlight(expiry_s=10)
    f.picked("chat-v1", "10.0.0.1:8000", request_id=b"late")
    f.picked("chat-v1", "10.0.0.2:8000", request_id=b"on-time")
    names = ("x-inferlb-cluster", "x-gateway-destination-endpoint")
    assert record_completions(log_message((None, None), request_ids=("unknown",)), f, *names) == 0
    assert f.clusters == {"chat-v1": 2}
    assert record_completions(log_message((None, None), request_ids=("late",)), f, *names) == 1
    assert f.endpoints == {"10.0.0.2:8000": 1} and f.clusters == {"chat-v1": 1}
    assert record_completions(log_message(("chat-v1", "10.0.0.2:8000"), request_ids=("on-time",)), f, *names) == 1
    assert f.endpoints == {} and f.clusters == {} and f.requests == {}


def test_request_ids_are_forgotten_with_their_expired_picks():
    clock = Clock()
    f = InFlight(expiry_s=10, clock=clock)
    f.picked("c", "a:1", request_id=b"old")
    clock.now += 6
    f.picked("c", "a:1", request_id=b"new")
    clock.now += 5
    assert f.expire() == 1
    assert list(f.requests) == [b"new"]


ENDPOINTS = [f"10.1.0.{i}:8000" for i in range(5)]
RING = HashRing(ENDPOINTS, vnodes=40)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.booleans(), st.integers(0, 10_000)), min_size=1, max_size=300),
    st.sampled_from([1.0, 1.25, 2.0]),
)
def test_bounded_loads_fed_by_in_flight_never_exceed_ceil_c_average(ops, c):
    """Interleaved picks and completions: every pick lands on an endpoint below the bound
    ceil(c * (in flight + 1) / n), so right after it that endpoint holds at most the bound; while
    only picks happen (no completion shrinks the average), no endpoint is ever above it."""
    f = InFlight(expiry_s=1e9)
    live: list[str] = []
    completed = False
    for is_pick, k in ops:
        if is_pick or not live:
            total = sum(f.endpoints.values())
            bound = math.ceil(c * (total + 1) / len(ENDPOINTS))
            chosen = RING.lookup(b"s%d" % k, f.endpoints, c)
            assert f.endpoints.get(chosen, 0) < bound
            f.picked("c", chosen)
            live.append(chosen)
            assert f.endpoints[chosen] <= bound
            if not completed:
                assert max(f.endpoints.values()) <= bound
        else:
            done = live.pop(k % len(live))
            assert f.completed("c", done)
            completed = True
    assert sum(f.endpoints.values()) == len(live)


def test_a_burst_of_new_sessions_on_one_endpoint_is_spread():
    """Anti-herd: 100 new sessions that all hash to the same endpoint, within one snapshot period
    (no completion yet): bounded loads with the picker's own pick counts spread them."""
    target = RING.lookup(b"probe")
    keys = [k for k in (b"herd-%d" % i for i in range(5000)) if RING.lookup(k) == target][:100]
    assert len(keys) == 100
    f = InFlight(expiry_s=1e9)
    for k in keys:
        f.picked("c", RING.lookup(k, f.endpoints, 1.25))
    assert max(f.endpoints.values()) <= math.ceil(1.25 * 100 / len(ENDPOINTS))
    assert len(f.endpoints) == len(ENDPOINTS)
