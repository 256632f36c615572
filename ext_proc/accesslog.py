"""Envoy's gRPC access log (``envoy.service.accesslog.v3.AccessLogService``) -> request completions.

Envoy's ``envoy.access_loggers.http_grpc`` logger streams ``StreamAccessLogsMessage`` batches
(one stream per Envoy worker, flushed every ``buffer_flush_interval`` or when
``buffer_size_bytes`` fill up). The listener logs every request and adds the cluster and
override-host headers to each entry (``additional_request_headers_to_log``), so each entry names
exactly what the picker counted; an entry without the cluster header is a request the picker's
answer did not reach in time (Envoy failed open), matched to its pick by ``x-request-id``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2

from ext_proc.inflight import InFlight

__all__ = ["CompletionSink", "CostSink", "record_completions"]


class CompletionSink(Protocol):
    """Where finished requests go, one call each (Envoy's view of the endpoints)."""

    def record(self, endpoint: str, duration_ms: float, status: int) -> None:
        """``endpoint``: the upstream ``HOST:PORT``; ``duration_ms``: the upstream time, from the
        first byte sent upstream to the last byte received from it (ms; the whole request's time
        when Envoy logged no upstream timing); ``status``: the HTTP response code (0 when none was
        sent)."""
        ...


class CostSink(Protocol):
    """Where finished requests with known tokens go (the request cost model)."""

    def observe(self, gpu_class: str, prompt_tokens: float, output_tokens: float, duration_ms: float,
                ttft_ms: float | None = None, /) -> None: ...


def record_completions(data: bytes, inflight: InFlight, cluster_header: str, override_host_header: str,
                       view: CompletionSink | None = None, costs: CostSink | None = None,
                       failed: Callable[[str, bool], None] | None = None) -> int:
    """Count the completions in one serialized ``StreamAccessLogsMessage``.

    Args:
        data: the message bytes.
        inflight: where completions are counted.
        cluster_header, override_host_header: lower-case header names the entries were logged with.
        view: also record each entry's upstream host, status and upstream time there (Envoy's
            view). Upstream time, not the whole request's: the time the request waited in Envoy's
            filters (this picker's own answer, or its timeout when Envoy failed open) is not the
            endpoint's latency, and counted there it made a latency outlier of whichever endpoint
            served the late requests.
        costs: each completion of a pick whose tokens were known, with its duration
            (``time_to_last_downstream_tx_byte``) and TTFT (``time_to_first_upstream_rx_byte``), ms.
        failed: called with the pinned ``HOST:PORT`` of an entry whose pinned host failed, and
            whether that is certain: Envoy flagged an upstream connection failure, reset or
            termination (certain), or served it from another host after a retry (not certain: a
            5xx answer is retried too) (issue 15 item 13).

    Returns:
        The number of HTTP entries matched to a cluster: by the logged cluster header, else by the
        request id of a pick in flight (its pin was not applied, so no failure is flagged for it);
        other entries are skipped (the picker did not route them).

    Raises:
        google.protobuf.message.DecodeError: ``data`` is not a ``StreamAccessLogsMessage``.
    """
    message = als_pb2.StreamAccessLogsMessage.FromString(data)
    counted = 0
    for entry in message.http_logs.log_entry:
        logged = entry.request.request_headers
        rid = entry.request.request_id.encode()
        cluster = logged.get(cluster_header)
        applied = bool(cluster)
        if applied:
            pin = logged.get(override_host_header) or None
        else:
            routed = inflight.routed(rid) if rid else None
            if routed is None:
                continue
            cluster, pin = routed
        pick = inflight.pop(cluster, pin, rid)
        counted += 1
        props = entry.common_properties
        if applied and pin is not None and failed is not None:
            certain = retried = False
            if props.HasField("response_flags"):  # absent on a clean request: no per-flag reads
                flags = props.response_flags
                certain = (flags.upstream_connection_failure or flags.upstream_remote_reset
                           or flags.upstream_connection_termination)
            if not certain and props.upstream_request_attempt_count > 1:
                upstream = props.upstream_remote_address.socket_address
                retried = bool(upstream.address) and f"{upstream.address}:{upstream.port_value}" != pin
            if certain or retried:
                failed(pin, certain)
        if pick is not None and costs is not None and pick[3] is not None and pick[4] is not None \
                and props.HasField("time_to_last_downstream_tx_byte") and entry.response.response_code.value == 200:
            ttft = (props.time_to_first_upstream_rx_byte.ToNanoseconds() / 1e6
                    if props.HasField("time_to_first_upstream_rx_byte") else None)
            costs.observe(pick[5], pick[3], pick[4], props.time_to_last_downstream_tx_byte.ToNanoseconds() / 1e6,
                          ttft)
        if view is not None:
            upstream = props.upstream_remote_address.socket_address
            if upstream.address and props.HasField("time_to_last_downstream_tx_byte"):
                view.record(f"{upstream.address}:{upstream.port_value}", _upstream_ms(props),
                            entry.response.response_code.value)
    return counted


def _upstream_ms(props: accesslog_pb2.AccessLogCommon) -> float:
    """From the first byte sent upstream to the last byte received from it (ms), else (no upstream
    timing logged) the whole request's time. Both are offsets from the request's start (Envoy docs,
    ``data.accesslog.v3.AccessLogCommon``)."""
    if props.HasField("time_to_first_upstream_tx_byte") and props.HasField("time_to_last_upstream_rx_byte"):
        return (props.time_to_last_upstream_rx_byte.ToNanoseconds()
                - props.time_to_first_upstream_tx_byte.ToNanoseconds()) / 1e6
    return props.time_to_last_downstream_tx_byte.ToNanoseconds() / 1e6
