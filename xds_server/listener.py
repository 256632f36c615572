"""LDS, RDS and the picker's cluster: what Envoy needs besides the inference clusters (pure).

The listener's HTTP connection manager
- strips client copies of the routing headers with ``early_header_mutation_extensions`` (a
  ``header_mutation`` HTTP filter would run after the route is chosen: case C06, ENVOY-NOTES);
- asks the picker (ext_proc, request headers only) for the cluster and the host;
- routes by the cluster header the picker set, or, without it (picker down and
  ``failure_mode_allow``), by the version header straight to that version's cluster (so versions
  never mix while the picker is down), else to the service's default version (or its default mix);
  all through the weighted fallback;
- retries connect failures, resets, 5xx and per-try timeouts on another host (case C13);
- logs every request the picker routed (it carries the cluster header) to the picker's
  ``AccessLogService`` over the picker's own cluster, so the picker learns when requests end and
  counts requests in flight (ENVOY-NOTES: the ext_proc stream ends long before the request).
With ``envoy.picker: false`` there is no ext_proc filter: routes match the version header and
Envoy's weighted fallback policy picks every host (EDS weights only).
"""

from __future__ import annotations

import ipaddress
import re

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.access_loggers.grpc.v3 import als_pb2  # noqa: F401

# Imported for their side effect: they register the Any types ParseDict resolves.
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2  # noqa: F401
from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2  # noqa: F401
from envoy.extensions.http.early_header_mutation.header_mutation.v3 import header_mutation_pb2  # noqa: F401
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2  # noqa: F401
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2  # noqa: F401
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2  # noqa: F401
from google.protobuf import json_format

from ext_proc.settings import METADATA_KEY

from xds_server.config import Config, EnvoyTls, ServiceConfig, cluster_name, split_hostport

LISTENER_NAME = "inferlb"
ROUTE_NAME = "inferlb"
EXT_PROC_CLUSTER = "inferlb_ext_proc"
_ADS = {"ads": {}, "resource_api_version": "V3"}
_T = "type.googleapis.com/"


def _seconds(s: float) -> str:
    return f"{s:.3f}s"


def _loopback(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def _fallback(s: ServiceConfig) -> dict:
    """Where a request without the picker's cluster header goes: the default version, or the
    default mix's versions weighted by their shares (the picker is down: per-request split)."""
    mix = s.mixes.get(s.default)
    if mix is None:
        return {"cluster": cluster_name(s.name, s.default)}
    shares = [(cluster_name(s.name, v), round(p * 100)) for v, p in sorted(mix.items()) if p > 0]
    return {"weighted_clusters": {"clusters": [{"name": n, "weight": w} for n, w in shares]}}


def retry_policy(cfg: Config) -> dict:
    """The routes' retry policy (JSON form): ``envoy.retries`` retries, each try bounded by
    ``envoy.per_try_timeout_s``, on another host (``previous_hosts`` predicate).

    ``5xx`` covers upstream 5xx, resets, connect failures and per-try timeouts (Envoy docs,
    "x-envoy-retry-on"); a backend that accepts and never answers costs one per-try timeout.
    """
    return {
        "retry_on": "5xx",
        "num_retries": cfg.envoy.retries,
        "per_try_timeout": _seconds(cfg.envoy.per_try_timeout_s),
        "retry_host_predicate": [{
            "name": "envoy.retry_host_predicates.previous_hosts",
            "typed_config": {"@type": _T + "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"},
        }],
        "host_selection_retry_max_attempts": 3,
    }


def build_route_config(cfg: Config) -> route_pb2.RouteConfiguration:
    """RDS ``inferlb``: one virtual host per service (its ``hosts`` as domains).

    With the picker, a route follows the cluster header the picker set; without it
    (``envoy.picker: false``), one route per version matches the version header exactly. Either
    way the last route sends everything else to the service's default version.
    """
    vhosts = []
    for s in cfg.services:
        domains = []
        for h in s.hosts:
            domains += ["*"] if h == "*" else [h, f"{h}:*"]
        timeout = _seconds(cfg.envoy.route_timeout_s)
        retry = retry_policy(cfg)
        by_cluster_header = [
            {"match": {"prefix": "/", "headers": [{"name": cfg.headers.cluster, "present_match": True}]},
             "route": {"cluster_header": cfg.headers.cluster, "timeout": timeout, "retry_policy": retry}}
        ] if cfg.envoy.picker else []
        by_version = [
            {"match": {"prefix": "/", "headers": [{"name": cfg.headers.version,
                                                   "string_match": {"exact": v.name}}]},
             "route": {"cluster": cluster_name(s.name, v.name), "timeout": timeout, "retry_policy": retry}}
            for v in s.versions
        ]
        vhosts.append({
            "name": s.name,
            "domains": domains,
            "routes": [
                *by_cluster_header,
                *by_version,
                {"match": {"prefix": "/"}, "route": {**_fallback(s), "timeout": timeout, "retry_policy": retry}},
            ],
        })
    return json_format.ParseDict({"name": ROUTE_NAME, "validate_clusters": False, "virtual_hosts": vhosts},
                                 route_pb2.RouteConfiguration())


def build_listener(cfg: Config) -> listener_pb2.Listener:
    """LDS ``inferlb`` on ``cfg.envoy.listener`` with the header strip, the picker and the router.

    ``envoy.picker: false`` leaves the picker (ext_proc filter) out.
    """
    host, port = split_hostport(cfg.envoy.listener)
    timeout = _seconds(cfg.envoy.ext_proc_timeout_s)
    hcm = {
        "@type": _T + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "inferlb",
        "early_header_mutation_extensions": [{
            "name": "envoy.http.early_header_mutation.header_mutation",
            "typed_config": {
                "@type": _T + "envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
                "mutations": [{"remove": cfg.headers.override_host}, {"remove": cfg.headers.cluster}],
            },
        }],
        "rds": {"route_config_name": ROUTE_NAME, "config_source": _ADS},
        "access_log": [completion_log(cfg)] if cfg.envoy.picker else [],
        "http_filters": [
            *([{"name": "envoy.filters.http.ext_proc", "typed_config": {
                "@type": _T + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                "grpc_service": {"envoy_grpc": {"cluster_name": EXT_PROC_CLUSTER}, "timeout": timeout},
                "failure_mode_allow": cfg.envoy.failure_mode_allow,
                # Body routing: the picker asks for a request's body only when it needs it.
                "allow_mode_override": cfg.picker.body_max_bytes > 0,
                "message_timeout": timeout,
                "processing_mode": {
                    "request_header_mode": "SEND", "response_header_mode": "SKIP",
                    "request_body_mode": "NONE", "response_body_mode": "NONE",
                    "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP",
                },
            }}] if cfg.envoy.picker else []),
            {"name": "envoy.filters.http.router",
             "typed_config": {"@type": _T + "envoy.extensions.filters.http.router.v3.Router"}},
        ],
    }
    return json_format.ParseDict({
        "name": LISTENER_NAME,
        "address": {"socket_address": {"address": host, "port_value": port}},
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                        "typed_config": hcm}]}],
    }, listener_pb2.Listener())


def completion_log(cfg: Config) -> dict:
    """The HCM access log (JSON form) that reports each request the picker routed to the picker.

    ``envoy.access_loggers.http_grpc`` over the ``inferlb_ext_proc`` cluster: one gRPC stream per
    Envoy worker, entries batched for ``picker.access_log_flush_s`` or ``access_log_buffer_bytes``.
    Only requests with the picker's cluster header are logged, each with its cluster and
    override-host header values.
    """
    p = cfg.picker
    return {
        "name": "envoy.access_loggers.http_grpc",
        "filter": {"header_filter": {"header": {"name": cfg.headers.cluster, "present_match": True}}},
        "typed_config": {
            "@type": _T + "envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": {
                "log_name": "inferlb_completions",
                "grpc_service": {"envoy_grpc": {"cluster_name": EXT_PROC_CLUSTER}},
                "transport_api_version": "V3",
                "buffer_flush_interval": _seconds(p.access_log_flush_s),
                "buffer_size_bytes": p.access_log_buffer_bytes,
            },
            "additional_request_headers_to_log": [cfg.headers.cluster, cfg.headers.override_host],
        },
    }


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
    ctx: dict = {"@type": _T + "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                 "common_tls_context": common}
    if tls.server_name:
        ctx["sni"] = tls.server_name
    return {"name": "envoy.transport_sockets.tls", "typed_config": ctx}


def build_ext_proc_cluster(ext_proc_address: str, picker: dict | None = None,
                           tls: EnvoyTls | None = None) -> cluster_pb2.Cluster:
    """CDS ``inferlb_ext_proc``: an HTTP/2 cluster for the picker at ``HOST:PORT`` (TLS when ``tls`` is
    given): STATIC for an IP, STRICT_DNS for a name (every address it resolves to is a picker).

    ``picker``: the picker's configuration (``ext_proc.settings.to_wire``), carried in the
    cluster's metadata (``filter_metadata["inferlb.picker"]``) for pickers that subscribe over ADS.
    """
    host, port = split_hostport(ext_proc_address)
    extra = {"transport_socket": upstream_tls(tls)} if tls is not None else {}
    if picker is not None:
        extra["metadata"] = {"filter_metadata": {METADATA_KEY: picker}}
    try:
        ipaddress.ip_address(host)
        kind = "STATIC"
    except ValueError:   # a DNS name (a Kubernetes Service, say): Envoy resolves it, every replica
        kind = "STRICT_DNS"
    return json_format.ParseDict({**extra,
        "name": EXT_PROC_CLUSTER,
        "type": kind,
        "connect_timeout": "0.25s",
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": _T + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }},
        "load_assignment": {"cluster_name": EXT_PROC_CLUSTER, "endpoints": [{"lb_endpoints": [{"endpoint": {
            "address": {"socket_address": {"address": _loopback(host), "port_value": port}}}}]}]},
    }, cluster_pb2.Cluster())
