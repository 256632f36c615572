"""Hostile request headers through the real Envoy to the picker: very long values, bytes that are not
UTF-8, repeated headers. No crash, bounded answers and log output, and a counter for each kind."""

from __future__ import annotations

import http.client
import logging
from collections import Counter

import pytest
from prometheus_client import REGISTRY

from tests.faults.conftest import Stack, all_healthy, wait_until

pytestmark = pytest.mark.integration


def raw_request(s: Stack, headers: list[tuple[str, bytes]]) -> tuple[int, bytes, dict[str, str]]:
    """POST through Envoy with header values sent as raw bytes (http.client passes them through)."""
    host, port = s.listener.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    body = b'{"max_tokens": 4, "messages": []}'
    conn.putrequest("POST", "/v1/chat/completions", skip_host=any(n == "host" for n, _ in headers))
    conn.putheader("content-type", "application/json")
    conn.putheader("content-length", str(len(body)))
    for name, value in headers:
        conn.putheader(name, value)
    conn.endheaders(body)
    r = conn.getresponse()
    out = r.status, r.read(), {k.lower(): v for k, v in r.getheaders()}
    conn.close()
    return out


def decisions(outcome: str) -> float:
    """Decisions with ``outcome``, whichever plugins decided them."""
    return sum(sample.value for metric in REGISTRY.collect() for sample in metric.samples
               if sample.name == "inferlb_ext_proc_decisions_total" and sample.labels.get("outcome") == outcome)


def settled_request(s: Stack, headers: list[tuple[str, bytes]]) -> tuple[int, bytes, dict[str, str]]:
    """One request, then wait until its completion has reached the picker (Envoy's completion log is
    batched): the next keyed request then meets an idle endpoint and is not spilled by the bound.
    Settled means back to the requests in flight before it, not to none: the stack is the package's,
    and a request another test left whose completion never came (an Envoy restart loses its
    access log) counts until the picker's expiry (130 s). Waiting for none failed 8 cases in one CI
    run, in a test order where such a request came first."""
    inflight = s.app.picker.control.inflight
    before = sum(inflight.clusters.values())
    out = raw_request(s, headers)
    wait_until(lambda: sum(inflight.clusters.values()) <= before, 5, 0.005, "the completion reached the picker")
    return out


def errors_total() -> float:
    return sum(s.value for m in REGISTRY.collect() if m.name == "inferlb_ext_proc_errors"
               for s in m.samples if s.name.endswith("_total"))


CASES = {
    # name: (headers, expected status, expected decision outcome)
    "long-version": ([("model-version", b"v" * 40_000)], 400, "invalid-version"),
    "non-utf8-version": ([("model-version", b"v1\xff\xfe\xc3")], 400, "invalid-version"),
    # (the simulated backend, aiohttp, refuses header lines over 8190 bytes: stay under that when it must answer)
    "long-session": ([("x-session-id", b"s" * 8_000), ("model-version", b"v1")], 200, "affinity"),
    "non-utf8-session": ([("x-session-id", b"\xff\xfe\x80session"), ("model-version", b"v2")], 200, "affinity"),
    "repeated-version": ([("model-version", b"v2"), ("model-version", b"v1")], 200, "least-loaded"),
    "repeated-session": ([("x-session-id", b"a"), ("x-session-id", b"b"), ("model-version", b"v1")], 200,
                         "affinity"),
    "huge-authority": ([("host", b"h" * 8_000)], 200, "least-loaded"),
    # the picker pins a 40 KB session key; then the backend refuses the header line (its 400, not ours)
    "long-session-to-the-picker": ([("x-session-id", b"s" * 40_000), ("model-version", b"v1")], 400, "affinity"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_header_is_answered_counted_and_logged_at_most_once(fault_stack: Stack, case: str, caplog):
    s = fault_stack
    wait_until(lambda: all_healthy(s), 20, 0.2, "every endpoint HEALTHY")
    headers, want_status, outcome = CASES[case]
    before, errors_before = decisions(outcome), errors_total()
    with caplog.at_level(logging.INFO):
        answers = [settled_request(s, headers) for _ in range(30)]
    assert {status for status, _, _ in answers} == {want_status}, {a[0]: a[1][:200] for a in answers}
    assert all(len(body) < 2048 for _, body, _ in answers), "an error body must not echo the whole value"
    assert decisions(outcome) - before == 30
    assert errors_total() == errors_before, "no internal error in the picker"
    # The picker's lines, and any warning from inferlb (the slow loop's weight changes are not about this).
    noisy = [r for r in caplog.records if r.name.startswith("ext_proc")
             or (r.name.startswith("xds_server") and r.levelno >= logging.WARNING)]
    assert len(noisy) <= 1, [r.getMessage()[:200] for r in noisy]
    assert sum(len(r.getMessage()) for r in noisy) < 4096
    if outcome == "affinity" and want_status == 200:   # pinned: the session's endpoint serves all
        assert Counter(h["x-served-by"] for _, _, h in answers).most_common(1)[0][1] == 30
    if want_status == 200:
        version = next(v for n, v in headers if n == "model-version") if any(
            n == "model-version" for n, _ in headers) else b"v1"
        assert {h["x-backend-version"] for _, _, h in answers} == {version.decode()}


def test_headers_past_envoys_limit_are_refused_by_envoy(fault_stack: Stack):
    status, _, _ = raw_request(fault_stack, [("x-session-id", b"s" * 70_000)])
    assert status == 431   # Envoy's max_request_headers_kb (60 KiB): the picker never sees it
