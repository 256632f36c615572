"""CDS: one cluster per service version, and the picker's own cluster (pure).

An inference cluster is EDS-fed (ADS), uses ``envoy.load_balancing_policies.override_host`` so the
picker's pin wins, and falls back to weighted least request / round robin when there is no pin
(docs/envoy-facts.md: override_host ignores health, so the picker pins only healthy hosts).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import Any

from envoy.config.cluster.v3 import circuit_breaker_pb2, cluster_pb2, outlier_detection_pb2
from envoy.config.core.v3 import base_pb2, config_source_pb2, extension_pb2
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2
from envoy.extensions.load_balancing_policies.override_host.v3 import override_host_pb2
from envoy.extensions.load_balancing_policies.round_robin.v3 import round_robin_pb2
from envoy.type.v3 import percent_pb2
from google.protobuf import any_pb2, duration_pb2, json_format, wrappers_pb2
from google.protobuf.message import Message

from xds_server.config import CircuitBreakers, EnvoySide, EnvoyTls, OutlierDetection, ServiceConfig, split_hostport
from xds_server.config.model import UINT32_MAX
from xds_server.resources.names import EXT_PROC_CLUSTER, TYPE_PREFIX


def _loopback(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def upstream_tls(tls: EnvoyTls) -> dict:
    """An ``envoy.transport_sockets.tls`` transport socket (JSON form) for a cluster dialing inferlb.

    Verifies the server certificate against ``tls.ca`` (and its SAN against ``tls.server_name``
    when set); presents ``tls.cert``/``tls.key`` for mTLS; offers ALPN ``h2`` (gRPC).
    """
    validation: dict = {"trusted_ca": {"filename": tls.ca}}
    if tls.server_name:
        kind = "IP_ADDRESS" if re.fullmatch(r"[0-9.]+|[0-9a-fA-F:]+", tls.server_name) else "DNS"
        validation["match_typed_subject_alt_names"] = [{"san_type": kind, "matcher": {"exact": tls.server_name}}]
    common: dict = {"validation_context": validation, "alpn_protocols": ["h2"]}
    if tls.cert:
        common["tls_certificates"] = [{"certificate_chain": {"filename": tls.cert},
                                       "private_key": {"filename": tls.key}}]
    ctx: dict = {"@type": TYPE_PREFIX + "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                 "common_tls_context": common}
    if tls.server_name:
        ctx["sni"] = tls.server_name
    return {"name": "envoy.transport_sockets.tls", "typed_config": ctx}


PICKER_MAX_OUTBOUND_CONTROL_FRAMES = 10_000
"""Envoy's ``max_outbound_control_frames`` on the picker's connections (its default: 1 000). Every
ext_proc stream ends with an RST_STREAM from Envoy (the picker ends the stream first; Envoy resets its
open side: ``http2.tx_reset`` counts one per request), and Envoy counts each queued RST_STREAM as an
outbound control frame until its write to the socket drains it. One read of the picker's answers can
close every stream of the connection at once (up to the picker's 1 024), so at 2 000 concurrent
requests the default limit was passed: ``outbound_control_flood`` 1, the connection reset, 758
requests through without a decision (``failure_mode_allowed``). tests/integration/test_circuit_breakers.py
stalls the picker, then Envoy, so that Envoy reads a connection's worth of answers at once: at the
default limit 2 runs of 3 counted ``outbound_control_flood``, at this one none. The picker is this
deployment's own server, not a peer to protect against (Envoy's limit is its defence against peers
that make it queue PING and SETTINGS acknowledgements, envoy/source/common/http/http2/codec_impl.cc
``onBeforeFrameSend``, ``protocol_constraints.cc``); 10 000 RST_STREAM frames are 130 kB."""


def build_ext_proc_cluster(ext_proc_address: str, metadata: Mapping[str, Any] | None = None,
                           tls: EnvoyTls | None = None, limits: CircuitBreakers | None = None
                           ) -> cluster_pb2.Cluster:
    """CDS ``inferlb_ext_proc``: an HTTP/2 cluster for the picker at ``HOST:PORT`` (TLS when ``tls`` is
    given): STATIC for an IP, STRICT_DNS for a name (every address it resolves to is a picker).

    ``metadata``: the cluster's ``filter_metadata`` (``{namespace: JSON object}``); the app puts the
    picker's configuration there for pickers that subscribe over ADS. ``limits``: its circuit
    breakers (:func:`picker_limits`); None = Envoy's defaults (1024 streams).
    HTTP/2 options are Envoy's defaults on purpose (one connection per Envoy worker carries every
    stream; capping streams per connection, more connections, or smaller windows cost Envoy more CPU
    per request: ``inferlb bench ext-proc-config``, BENCHMARKS.md), but for
    :data:`PICKER_MAX_OUTBOUND_CONTROL_FRAMES`.
    """
    host, port = split_hostport(ext_proc_address)
    extra = {"transport_socket": upstream_tls(tls)} if tls is not None else {}
    if metadata:
        extra["metadata"] = {"filter_metadata": dict(metadata)}
    try:
        ipaddress.ip_address(host)
        kind = "STATIC"
    except ValueError:   # a DNS name (a Kubernetes Service, say): Envoy resolves it, every replica
        kind = "STRICT_DNS"
    cluster = json_format.ParseDict({**extra,
        "name": EXT_PROC_CLUSTER,
        "type": kind,
        "connect_timeout": "0.25s",
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": TYPE_PREFIX + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {
                "max_outbound_control_frames": PICKER_MAX_OUTBOUND_CONTROL_FRAMES}},
        }},
        "load_assignment": {"cluster_name": EXT_PROC_CLUSTER, "endpoints": [{"lb_endpoints": [{"endpoint": {
            "address": {"socket_address": {"address": _loopback(host), "port_value": port}}}}]}]},
    }, cluster_pb2.Cluster())
    if limits is not None:
        cluster.circuit_breakers.CopyFrom(circuit_breakers(limits))
    return cluster


def _policy(name: str, msg: Message) -> cluster_pb2.LoadBalancingPolicy.Policy:
    cfg = any_pb2.Any()
    cfg.Pack(msg)
    return cluster_pb2.LoadBalancingPolicy.Policy(
        typed_extension_config=extension_pb2.TypedExtensionConfig(name=name, typed_config=cfg)
    )


def _outlier(o: OutlierDetection, tiered: bool) -> outlier_detection_pb2.OutlierDetection:
    """Envoy outlier detection from the config (a per-try timeout counts as a gateway failure; a
    backend's own 5xx ejects by default only on a ``tiered`` cluster, see
    :class:`~xds_server.config.model.OutlierDetection`)."""
    enforcing_5xx = o.enforcing_consecutive_5xx
    if enforcing_5xx is None:
        enforcing_5xx = 100 if tiered else 0
    def dur(s: float) -> duration_pb2.Duration:
        d = duration_pb2.Duration()
        d.FromNanoseconds(int(s * 1e9))
        return d

    return outlier_detection_pb2.OutlierDetection(
        consecutive_5xx=wrappers_pb2.UInt32Value(value=o.consecutive_5xx),
        enforcing_consecutive_5xx=wrappers_pb2.UInt32Value(value=enforcing_5xx),
        consecutive_gateway_failure=wrappers_pb2.UInt32Value(value=o.consecutive_gateway_failure),
        enforcing_consecutive_gateway_failure=wrappers_pb2.UInt32Value(value=100),
        interval=dur(o.interval_s),
        base_ejection_time=dur(o.base_ejection_time_s),
        max_ejection_time=dur(max(o.max_ejection_time_s, o.base_ejection_time_s)),
        max_ejection_percent=wrappers_pb2.UInt32Value(value=o.max_ejection_percent),
    )


def circuit_breakers(limits: CircuitBreakers, envoy: EnvoySide | None = None) -> circuit_breaker_pb2.CircuitBreakers:
    """Envoy circuit breakers (DEFAULT priority) with every threshold set from ``limits`` (so none is
    Envoy's unchosen default of 1024) and, with ``envoy``, a retry budget instead of Envoy's fixed
    max_retries (3)."""
    th = circuit_breaker_pb2.CircuitBreakers.Thresholds(
        priority=base_pb2.DEFAULT,
        max_connections=wrappers_pb2.UInt32Value(value=limits.max_connections),
        max_pending_requests=wrappers_pb2.UInt32Value(value=limits.max_pending_requests),
        max_requests=wrappers_pb2.UInt32Value(value=limits.max_requests),
    )
    if envoy is not None:
        th.retry_budget.CopyFrom(circuit_breaker_pb2.CircuitBreakers.Thresholds.RetryBudget(
            budget_percent=percent_pb2.Percent(value=envoy.retry_budget_percent),
            min_retry_concurrency=wrappers_pb2.UInt32Value(value=envoy.min_retry_concurrency),
        ))
    return circuit_breaker_pb2.CircuitBreakers(thresholds=[th])


def picker_limits(envoy: EnvoySide, inference_clusters: int) -> CircuitBreakers:
    """The picker cluster's thresholds: ``envoy.picker_circuit_breakers``, or each the sum of
    ``max_requests + max_pending_requests`` over the inference clusters (capped at uint32): every
    request through the listener holds one ext_proc stream while it runs."""
    if envoy.picker_circuit_breakers is not None:
        return envoy.picker_circuit_breakers
    cb = envoy.circuit_breakers
    n = min(UINT32_MAX, max(1, inference_clusters) * (cb.max_requests + cb.max_pending_requests))
    return CircuitBreakers(max_connections=n, max_pending_requests=n, max_requests=n)


def build_cluster(name: str, service: ServiceConfig, override_host_header: str,
                  envoy: EnvoySide | None = None, tiered: bool = False) -> cluster_pb2.Cluster:
    """An EDS cluster over ADS whose LB policy is ``envoy.load_balancing_policies.override_host``.

    The picker pins a host through ``override_host_header``; unpinned requests (and hosts not in the
    cluster) go to the fallback policy, which honours EDS ``load_balancing_weight`` (see
    docs/envoy-facts.md: override_host ignores health, so the picker pins only healthy hosts).
    """
    fallback = (
        _policy("envoy.load_balancing_policies.least_request", least_request_pb2.LeastRequest())
        if service.lb_policy == "least_request"
        else _policy("envoy.load_balancing_policies.round_robin", round_robin_pb2.RoundRobin())
    )
    override = override_host_pb2.OverrideHost(
        override_host_sources=[override_host_pb2.OverrideHost.OverrideHostSource(header=override_host_header)],
        fallback_policy=cluster_pb2.LoadBalancingPolicy(policies=[fallback]),
    )
    timeout = duration_pb2.Duration()
    timeout.FromNanoseconds(int(service.connect_timeout_s * 1e9))
    cluster = cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.EDS,
        connect_timeout=timeout,
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(
            eds_config=config_source_pb2.ConfigSource(
                ads=config_source_pb2.AggregatedConfigSource(),
                resource_api_version=config_source_pb2.V3,
            )
        ),
        load_balancing_policy=cluster_pb2.LoadBalancingPolicy(
            policies=[_policy("envoy.load_balancing_policies.override_host", override)]
        ),
        common_lb_config=cluster_pb2.Cluster.CommonLbConfig(
            healthy_panic_threshold=percent_pb2.Percent(value=service.panic_threshold_percent)
        ),
    )
    if envoy is not None:
        cluster.outlier_detection.CopyFrom(_outlier(envoy.outlier_detection, tiered))
        cluster.circuit_breakers.CopyFrom(circuit_breakers(envoy.circuit_breakers, envoy))
    return cluster
