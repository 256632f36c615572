"""RDS ``inferlb``: one virtual host per service, routed by the picker's cluster header (pure).

With the picker, a route follows the cluster header it set; without it (picker down and
``failure_mode_allow``, or ``envoy.picker: false``) the version header picks the version's cluster
(so versions never mix), else the service's default version (or its default mix). A version
with no endpoints now (``unavailable_versions``) is answered 503 by Envoy itself (a direct
response), never routed to another version. Every route retries connect failures, resets, 5xx and
per-try timeouts on another host (case C13).
"""

from __future__ import annotations

from envoy.config.route.v3 import route_pb2
from google.protobuf import json_format

from xds_server.config import Config, ServiceConfig, cluster_name
from xds_server.errors import error_json
from xds_server.resources.names import ROUTE_NAME, TYPE_PREFIX, seconds


def _unavailable(s: ServiceConfig, version: str, header: str | None = None) -> dict:
    """A route action (JSON form) for a version with no endpoints: Envoy answers 503 itself, with the
    picker's error object for it (``ext_proc.picker``, code "version_unavailable"; ``param``: the
    version ``header`` when the request named the version in it, else null)."""
    body = error_json(503, "version_unavailable",
                      f"model version '{version}' of service '{s.name}' has no endpoints now", header)
    return {"direct_response": {"status": 503, "body": {"inline_string": body}},
            "response_headers_to_add": [{"header": {"key": "content-type", "value": "application/json"},
                                         "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]}


def _fallback(s: ServiceConfig, timeout: str, retry: dict) -> dict:
    """Where a request without the picker's cluster header goes: the default version, or the
    default mix's versions weighted by their shares (the picker is down: per-request split); a
    default with no endpoints now is a 503."""
    if s.default in s.unavailable_versions:
        return _unavailable(s, s.default)
    mix = s.mixes.get(s.default)
    if mix is None:
        target: dict = {"cluster": cluster_name(s.name, s.default)}
    else:
        shares = [(cluster_name(s.name, v), round(p * 100)) for v, p in sorted(mix.items()) if p > 0]
        target = {"weighted_clusters": {"clusters": [{"name": n, "weight": w} for n, w in shares]}}
    return {"route": {**target, "timeout": timeout, "retry_policy": retry}}


def retry_policy(cfg: Config) -> dict:
    """The routes' retry policy (JSON form): ``envoy.retries`` retries, each try bounded by
    ``envoy.per_try_timeout_s``, on another host (``previous_hosts`` predicate).

    ``5xx`` covers upstream 5xx, resets, connect failures and per-try timeouts (Envoy docs,
    "x-envoy-retry-on"); a backend that accepts and never answers costs one per-try timeout.
    """
    return {
        "retry_on": "5xx",
        "num_retries": cfg.envoy.retries,
        "per_try_timeout": seconds(cfg.envoy.per_try_timeout_s),
        "retry_host_predicate": [{
            "name": "envoy.retry_host_predicates.previous_hosts",
            "typed_config": {
                "@type": TYPE_PREFIX + "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"},
        }],
        "host_selection_retry_max_attempts": 3,
    }


def build_route_config(cfg: Config) -> route_pb2.RouteConfiguration:
    """RDS ``inferlb``: one virtual host per service (its ``hosts`` as domains).

    With the picker, a route follows the cluster header the picker set; without it
    (``envoy.picker: false``), one route per version matches the version header exactly (a version
    with no endpoints now: a 503). Either way the last route sends everything else to the
    service's default version (a 503 when it has no endpoints now).
    """
    vhosts = []
    for s in cfg.services:
        domains = []
        for h in s.hosts:
            domains += ["*"] if h == "*" else [h, f"{h}:*"]
        timeout = seconds(cfg.envoy.route_timeout_s)
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
        ] + [
            {"match": {"prefix": "/", "headers": [{"name": cfg.headers.version, "string_match": {"exact": v}}]},
             **_unavailable(s, v, cfg.headers.version)}
            for v in s.unavailable_versions
        ]
        vhosts.append({
            "name": s.name,
            "domains": domains,
            "routes": [
                *by_cluster_header,
                *by_version,
                {"match": {"prefix": "/"}, **_fallback(s, timeout, retry)},
            ],
        })
    return json_format.ParseDict({"name": ROUTE_NAME, "validate_clusters": False, "virtual_hosts": vhosts},
                                 route_pb2.RouteConfiguration())
