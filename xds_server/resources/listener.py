"""LDS: the listener Envoy serves inference traffic on (pure).

The listener's HTTP connection manager
- strips client copies of the routing headers with ``early_header_mutation_extensions`` (a
  ``header_mutation`` HTTP filter would run after the route is chosen: case C06, docs/envoy-facts.md);
- asks the picker (ext_proc, request headers only) for the cluster and the host;
- routes by the cluster header the picker set, or, without it (picker down and
  ``failure_mode_allow``), by the version header straight to that version's cluster (so versions
  never mix while the picker is down), else to the service's default version (or its default mix);
  all through the weighted fallback;
- retries connect failures, resets, 5xx and per-try timeouts on another host (case C13);
- answers Envoy's own errors (no healthy upstream, headers or body too large, ...) as OpenAI error
  objects (``local_reply_config``: :mod:`xds_server.resources.local_reply`);
- logs every request the picker routed (it carries the cluster header) to the picker's
  ``AccessLogService`` over the picker's own cluster, so the picker learns when requests end and
  counts requests in flight (docs/envoy-facts.md: the ext_proc stream ends long before the request).
Each part's cost to Envoy (the ext_proc call, the mutation with ``clear_route_cache``, the access
log and its flush settings, ``allow_mode_override``, ``envoy_grpc`` rather than ``google_grpc``) is
measured by ``inferlb bench ext-proc-config`` (BENCHMARKS.md): nothing here costs measurably more
than the behaviour needs.
With ``envoy.picker: false`` there is no ext_proc filter: routes match the version header and
Envoy's weighted fallback policy picks every host (EDS weights only).
"""

from __future__ import annotations

from envoy.config.listener.v3 import listener_pb2
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

from xds_server.config import Config, split_hostport
from xds_server.resources.local_reply import local_reply_config
from xds_server.resources.names import ADS_SOURCE, EXT_PROC_CLUSTER, LISTENER_NAME, ROUTE_NAME, TYPE_PREFIX, seconds


def build_listener(cfg: Config) -> listener_pb2.Listener:
    """LDS ``inferlb`` on ``cfg.envoy.listener`` with the header strip, the picker and the router.

    ``envoy.picker: false`` leaves the picker (ext_proc filter) out.
    """
    host, port = split_hostport(cfg.envoy.listener)
    timeout = seconds(cfg.envoy.ext_proc_timeout_s)
    hcm = {
        "@type": TYPE_PREFIX + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "inferlb",
        "early_header_mutation_extensions": [{
            "name": "envoy.http.early_header_mutation.header_mutation",
            "typed_config": {
                "@type": TYPE_PREFIX + "envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
                "mutations": [{"remove": cfg.headers.override_host}, {"remove": cfg.headers.cluster}],
            },
        }],
        "rds": {"route_config_name": ROUTE_NAME, "config_source": ADS_SOURCE},
        "local_reply_config": local_reply_config(),
        "access_log": [completion_log(cfg)] if cfg.envoy.picker else [],
        "http_filters": [
            *([{"name": "envoy.filters.http.ext_proc", "typed_config": {
                "@type": TYPE_PREFIX + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
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
             "typed_config": {"@type": TYPE_PREFIX + "envoy.extensions.filters.http.router.v3.Router"}},
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
    Every request is logged, with its cluster and override-host header values: one the picker
    answered too late for (Envoy failed open or answered 500) has neither and is matched to its
    pick by its ``x-request-id``, so its count does not stay in flight until the expiry.
    """
    p = cfg.picker
    return {
        "name": "envoy.access_loggers.http_grpc",
        "typed_config": {
            "@type": TYPE_PREFIX + "envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": {
                "log_name": "inferlb_completions",
                "grpc_service": {"envoy_grpc": {"cluster_name": EXT_PROC_CLUSTER}},
                "transport_api_version": "V3",
                "buffer_flush_interval": seconds(p.access_log_flush_s),
                "buffer_size_bytes": p.access_log_buffer_bytes,
            },
            "additional_request_headers_to_log": [cfg.headers.cluster, cfg.headers.override_host],
        },
    }


