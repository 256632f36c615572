"""Envoy's view of the endpoints: access-log completions -> client-side latency and 5xx per endpoint."""

from __future__ import annotations

import pytest
from envoy.config.core.v3 import address_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2
from google.protobuf import duration_pb2, wrappers_pb2

from ext_proc.accesslog import record_completions
from ext_proc.inflight import InFlight
from xds_server.metrics.sources.envoy import MIN_REQUESTS, ClientView, EnvoyView
from xds_server.metrics.stats import EndpointStats


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_summary_is_mean_p95_and_error_share_over_the_window():
    clock = Clock()
    view = ClientView(window_s=10, clock=clock)
    for ms in range(1, 101):   # 1..100 ms, every 10th a 503
        view.record("10.0.0.1:8000", float(ms), 503 if ms % 10 == 0 else 200)
    s = view.summary()["10.0.0.1:8000"]
    assert s.count == 100 and s.mean_ms == pytest.approx(50.5) and s.p95_ms == 95.0
    assert s.error_rate == pytest.approx(0.1) and s.age_s == 0.0
    clock.t += 11
    assert view.summary() == {}   # all outside the window


def test_bad_durations_are_ignored_and_memory_is_bounded():
    view = ClientView(window_s=10, max_per_endpoint=5, clock=Clock())
    view.record("a:1", float("nan"), 200)
    view.record("a:1", -1.0, 200)
    assert view.summary() == {}
    for ms in range(20):
        view.record("a:1", float(ms), 200)
    assert view.summary()["a:1"].count == 5 and view.summary()["a:1"].mean_ms == pytest.approx(17.0)
    with pytest.raises(ValueError):
        ClientView(window_s=0)


def _log(entries: list[tuple[str, int, int, float]]) -> bytes:
    """A StreamAccessLogsMessage: (upstream "IP:PORT", port, status, total ms) per entry."""
    msg = als_pb2.StreamAccessLogsMessage()
    for ip, port, status, ms in entries:
        e = msg.http_logs.log_entry.add()
        e.request.request_headers["x-inferlb-cluster"] = "chat-v1"
        e.common_properties.upstream_remote_address.CopyFrom(
            address_pb2.Address(socket_address=address_pb2.SocketAddress(address=ip, port_value=port)))
        d = duration_pb2.Duration()
        d.FromNanoseconds(int(ms * 1e6))
        e.common_properties.time_to_last_downstream_tx_byte.CopyFrom(d)
        e.response.response_code.CopyFrom(wrappers_pb2.UInt32Value(value=status))
    assert isinstance(msg.http_logs.log_entry[0], accesslog_pb2.HTTPAccessLogEntry)
    return msg.SerializeToString()


def test_access_log_entries_feed_the_view():
    view = ClientView(clock=Clock())
    n = record_completions(_log([("10.0.0.1", 8000, 200, 40.0), ("10.0.0.1", 8000, 500, 60.0),
                                 ("10.0.0.2", 8000, 200, 7.5)]),
                           InFlight(), "x-inferlb-cluster", "x-gateway-destination-endpoint", view)
    assert n == 3
    s = view.summary()
    assert s["10.0.0.1:8000"].mean_ms == pytest.approx(50.0) and s["10.0.0.1:8000"].error_rate == 0.5
    assert s["10.0.0.2:8000"].mean_ms == pytest.approx(7.5)


def test_the_view_records_upstream_time_not_the_wait_in_envoys_filters():
    """A request that waited 250 ms for the picker (Envoy's ext_proc timeout, then fail-open) and
    took 20 ms upstream counts 20 ms for its endpoint: the wait was not the endpoint's."""
    msg = als_pb2.StreamAccessLogsMessage.FromString(_log([("10.0.0.1", 8000, 200, 270.0)]))
    props = msg.http_logs.log_entry[0].common_properties
    props.time_to_first_upstream_tx_byte.FromNanoseconds(250_000_000)
    props.time_to_last_upstream_rx_byte.FromNanoseconds(270_000_000)
    view = ClientView(clock=Clock())
    record_completions(msg.SerializeToString(), InFlight(), "x-inferlb-cluster", "x-gateway-destination-endpoint",
                       view)
    assert view.summary()["10.0.0.1:8000"].mean_ms == pytest.approx(20.0)


def test_enrich_fills_only_client_inputs_and_never_the_age():
    view = ClientView(clock=Clock())
    for _ in range(MIN_REQUESTS):
        view.record("10.0.0.1:8000", 80.0, 200)
    view.record("10.0.0.2:8000", 10.0, 200)   # too few requests to use
    stats = {"inst-1": EndpointStats(latency_mean_ms=30.0, sample_age_s=40.0),
             "10.0.0.2:8000": EndpointStats(sample_age_s=1.0)}
    out = EnvoyView(view, {"10.0.0.1:8000": "inst-1"}).enrich(stats)
    assert out["inst-1"].client_latency_mean_ms == 80.0 and out["inst-1"].client_error_rate == 0.0
    assert out["inst-1"].latency_mean_ms == 30.0
    assert out["inst-1"].sample_age_s == 40.0   # stale backend metrics stay stale (C04)
    assert out["10.0.0.2:8000"].client_latency_mean_ms is None
