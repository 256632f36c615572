"""Envoy's gRPC access log (``envoy.service.accesslog.v3.AccessLogService``) -> request completions.

Envoy's ``envoy.access_loggers.http_grpc`` logger streams ``StreamAccessLogsMessage`` batches
(one stream per Envoy worker, flushed every ``buffer_flush_interval`` or when
``buffer_size_bytes`` fill up). The listener logs every request and adds the cluster and
override-host headers to each entry (``additional_request_headers_to_log``), so each entry names
exactly what the picker counted; an entry without the cluster header is a request the picker's
answer did not reach in time (Envoy failed open), matched to its pick by ``x-request-id``.

Each batch is decoded into one flat tuple per HTTP entry (:data:`ext_proc.wire.Completion`) by the
compiled decoder (``ext_proc._wire``) or, where it is not built or declines the bytes, by protobuf
(:func:`ext_proc.wire.access_log_py`); :func:`record_completions` has one path after that.
Per batch, medians of 5 interleaved rounds (BENCHMARKS.md, issue 14 third pass): 16 captured
entries of upstream requests (7.7 KB), 120 µs before (protobuf parse, field reads as needed) ->
39 µs (the compiled decode in it: 14 µs; the protobuf fallback: 124 µs); 45 captured entries
of the picker bench's direct_response requests (16 KB), 242 -> 96 µs (fallback: 292 µs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ext_proc.inflight import InFlight
from ext_proc.wire import access_log, access_log_py

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
                ttft_ms: float | None = None, load: float = 0.0, miss: bool = True, /) -> None: ...


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
            (``time_to_last_downstream_tx_byte``) and TTFT (``time_to_first_upstream_rx_byte``), ms,
            and the pick's load, miss and uncached share (:data:`ext_proc.inflight.Pick`).
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
    entries = access_log(data, cluster_header, override_host_header) if access_log is not None else None
    if entries is None:  # not built, or bytes the compiled decoder leaves to protobuf
        entries = access_log_py(data, cluster_header, override_host_header)
    counted = 0
    for (cluster, pin, rid, upstream_failed, attempts, address, port, first_upstream_tx, last_upstream_rx,
         last_downstream_tx, first_upstream_rx, status) in entries:
        applied = bool(cluster)
        if applied:
            pin = pin or None
        else:
            routed = inflight.routed(rid) if rid else None
            if routed is None:
                continue
            cluster, pin = routed
        pick = inflight.pop(cluster, pin, rid)
        counted += 1
        if applied and pin is not None and failed is not None:
            if upstream_failed:
                failed(pin, True)
            elif attempts > 1 and address and f"{address}:{port}" != pin:
                failed(pin, False)
        if last_downstream_tx is None:
            continue
        if pick is not None and costs is not None and pick[3] is not None and pick[4] is not None and status == 200:
            costs.observe(pick[5], pick[3], pick[4], last_downstream_tx / 1e6,
                          None if first_upstream_rx is None else first_upstream_rx / 1e6, pick[7], pick[8],
                          pick[10])
        if view is not None and address:
            if first_upstream_tx is not None and last_upstream_rx is not None:
                upstream_ms = (last_upstream_rx - first_upstream_tx) / 1e6
            else:  # no upstream timing logged: the whole request's time
                upstream_ms = last_downstream_tx / 1e6
            view.record(f"{address}:{port}", upstream_ms, status)
    return counted

