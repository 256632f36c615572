"""Envoy's gRPC access log (``envoy.service.accesslog.v3.AccessLogService``) -> request completions.

Envoy's ``envoy.access_loggers.http_grpc`` logger streams ``StreamAccessLogsMessage`` batches
(one stream per Envoy worker, flushed every ``buffer_flush_interval`` or when
``buffer_size_bytes`` fill up). The listener logs only requests that carry the picker's cluster
header and adds the cluster and override-host headers to each entry
(``additional_request_headers_to_log``), so each entry names exactly what the picker counted.
"""

from __future__ import annotations

from typing import Protocol

from envoy.service.accesslog.v3 import als_pb2

from ext_proc.inflight import InFlight

__all__ = ["CompletionSink", "record_completions"]


class CompletionSink(Protocol):
    """Where finished requests go, one call each (Envoy's view of the endpoints)."""

    def record(self, endpoint: str, duration_ms: float, status: int) -> None:
        """``endpoint``: the upstream ``HOST:PORT``; ``duration_ms``: until the last byte sent
        downstream (ms); ``status``: the HTTP response code (0 when none was sent)."""
        ...


def record_completions(data: bytes, inflight: InFlight, cluster_header: str, override_host_header: str,
                       view: CompletionSink | None = None) -> int:
    """Count the completions in one serialized ``StreamAccessLogsMessage``.

    Args:
        data: the message bytes.
        inflight: where completions are counted.
        cluster_header, override_host_header: lower-case header names the entries were logged with.
        view: also record each entry's upstream host, status and total time there (Envoy's view).

    Returns:
        The number of HTTP entries that named a cluster (entries without the cluster header are
        skipped: the picker did not route them).

    Raises:
        google.protobuf.message.DecodeError: ``data`` is not a ``StreamAccessLogsMessage``.
    """
    message = als_pb2.StreamAccessLogsMessage.FromString(data)
    counted = 0
    for entry in message.http_logs.log_entry:
        logged = entry.request.request_headers
        cluster = logged.get(cluster_header) or entry.common_properties.upstream_cluster
        if not cluster:
            continue
        inflight.completed(cluster, logged.get(override_host_header) or None)
        counted += 1
        if view is not None:
            props = entry.common_properties
            upstream = props.upstream_remote_address.socket_address
            if upstream.address and props.HasField("time_to_last_downstream_tx_byte"):
                view.record(f"{upstream.address}:{upstream.port_value}",
                            props.time_to_last_downstream_tx_byte.ToNanoseconds() / 1e6,
                            entry.response.response_code.value)
    return counted

