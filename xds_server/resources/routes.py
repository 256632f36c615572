"""RDS ``inferlb``: one virtual host per service, routed by the picker's cluster header (pure).

With the picker, a route follows the cluster header it set; without it (picker down and
``failure_mode_allow``, or ``envoy.picker: false``) the version header picks the version's cluster
(so versions never mix), a mix's name its versions by their shares, a name of ``models`` the
default version; a version header naming none of these is answered 400 by Envoy itself, never by
the default version (a version the picker knows may reach Envoy's route only a push later). No
version header: the service's default version (or its default mix). A version with no endpoints
now (``unavailable_versions``) is answered 503 by Envoy itself (a direct response), never routed
to another version. Every route retries connect failures, resets, 5xx and per-try timeouts on
another host (case C13). ``GET /v1/models`` is answered by Envoy itself: the service's served
names as an OpenAI ``list`` object (:func:`models_list`), with the picker off for that route; so is
``GET /v1/models/{name}`` (the name's entry, or a 404 ``model_not_found``).
"""

from __future__ import annotations

import json
from urllib.parse import quote

from envoy.config.route.v3 import route_pb2

# Imported for its side effect: it registers ExtProcPerRoute, which ParseDict resolves.
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2  # noqa: F401
from google.protobuf import json_format

from xds_server.config import Config, ServiceConfig, cluster_name
from xds_server.errors import error_json
from xds_server.resources.names import ROUTE_NAME, TYPE_PREFIX, seconds

MODELS_PATH = "/v1/models"


def served_names(s: ServiceConfig) -> list[str]:
    """What a client may send as ``model`` (or in the version header) and be served: the service's
    ``models`` (names of its default version), its versions with endpoints and its mixes, in that
    order, each group sorted. A version without endpoints now (``unavailable_versions``) is left out,
    and so are the ``models`` while the default version is one.

    The picker's unknown-model 404 lists the same names in the same order
    (``ext_proc.picker.served_names``, from its routing table).
    """
    models = [] if s.default in s.unavailable_versions else sorted(s.models)
    return [*models, *sorted(v.name for v in s.versions), *sorted(s.mixes)]


def models_list(s: ServiceConfig) -> dict:
    """The OpenAI ``GET /v1/models`` answer for ``s`` (the ``list`` object of ``model`` objects, as
    OpenAI's API reference and vLLM's server give it): one entry per :func:`served_names` name,
    ``owned_by`` the service's name, ``created`` 0 (a config has no creation time; clients read it
    as a Unix time), and ``root`` the name's version (a mix: the mix)."""
    roots = {m: s.default for m in s.models}
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": s.name, "root": roots.get(name, name)}
        for name in served_names(s)]}


def _answered(match: dict, status: int, body: str, reading: bool = True,
              headers: tuple[tuple[str, str], ...] = ()) -> dict:
    """A route (JSON form) Envoy answers itself with ``body`` (JSON) and ``headers``: no picker call
    (ext_proc disabled on the route, so the request is neither decided nor counted in flight), no
    upstream. ``reading``: only for ``GET`` and ``HEAD`` (Envoy sends a HEAD answer's headers alone);
    False: for any method."""
    methods = [{"name": ":method", "string_match": {"safe_regex": {"regex": "GET|HEAD"}}}] if reading else []
    return {"match": {**match, **({"headers": methods} if methods else {})},
            "direct_response": {"status": status, "body": {"inline_string": body}},
            "response_headers_to_add": [
                {"header": {"key": k, "value": v}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
                for k, v in (("content-type", "application/json"), *headers)],
            "typed_per_filter_config": {"envoy.filters.http.ext_proc": {
                "@type": TYPE_PREFIX + "envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                "disabled": True}}}


def _spellings(name: str) -> list[str]:
    """The path segments a client may send for model ``name``: as it is, and percent-encoded (RFC 3986)
    with ``/`` kept and escaped (the openai client sends ``Qwen%2FQwen3-0.6B``; Envoy matches the raw
    path), each once."""
    return list(dict.fromkeys((name, quote(name, safe="/"), quote(name, safe=""))))


def _models_routes(s: ServiceConfig) -> list[dict]:
    """``GET /v1/models`` (:func:`models_list`), ``GET /v1/models/{name}`` for each name it lists (that
    entry: OpenAI's retrieve), a 404 ``model_not_found`` (``param`` ``model``) for any other name
    under ``/v1/models/``, and a 405 ``method_not_allowed`` (``Allow: GET, HEAD``) for another method
    there (a backend would answer with its own view), answered by Envoy; ``HEAD`` as ``GET``. Before,
    a name the list showed was retrieved from a backend, which knows only its own model name (a
    version's name got the backend's 404)."""
    listed = models_list(s)
    served = ", ".join(m["id"] for m in listed["data"])
    refused = error_json(405, "method_not_allowed", f"{MODELS_PATH} is read with GET or HEAD")
    return [
        _answered({"path": MODELS_PATH}, 200, json.dumps(listed, separators=(",", ":"))),
        *(_answered({"path": f"{MODELS_PATH}/{path}"}, 200, json.dumps(m, separators=(",", ":")))
          for m in listed["data"] for path in _spellings(m["id"])),
        _answered({"prefix": f"{MODELS_PATH}/"}, 404,
                  error_json(404, "model_not_found", f"no such model here; served models: {served}", "model")),
        *(_answered(match, 405, refused, reading=False, headers=(("allow", "GET, HEAD"),))
          for match in ({"path": MODELS_PATH}, {"prefix": f"{MODELS_PATH}/"})),
    ]


def _unavailable(s: ServiceConfig, version: str, header: str | None = None) -> dict:
    """A route action (JSON form) for a version with no endpoints: Envoy answers 503 itself, with the
    picker's error object for it (``ext_proc.picker``, code "version_unavailable"; ``param``: the
    version ``header`` when the request named the version in it, else null)."""
    body = error_json(503, "version_unavailable",
                      f"model version '{version}' of service '{s.name}' has no endpoints now", header)
    return {"direct_response": {"status": 503, "body": {"inline_string": body}},
            "response_headers_to_add": [{"header": {"key": "content-type", "value": "application/json"},
                                         "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]}


def _to(s: ServiceConfig, name: str, timeout: str, retry: dict) -> dict:
    """A route action (JSON form) to version ``name``'s cluster, or to mix ``name``'s versions
    weighted by their shares (the picker is down: a per-request split)."""
    mix = s.mixes.get(name)
    if mix is None:
        target: dict = {"cluster": cluster_name(s.name, name)}
    else:
        shares = [(cluster_name(s.name, v), round(p * 100)) for v, p in sorted(mix.items()) if p > 0]
        target = {"weighted_clusters": {"clusters": [{"name": n, "weight": w} for n, w in shares]}}
    return {"route": {**target, "timeout": timeout, "retry_policy": retry}}


def _fallback(s: ServiceConfig, timeout: str, retry: dict) -> dict:
    """Where a request without the picker's cluster header or a version header goes: the default
    version, or the default mix; a default with no endpoints now is a 503."""
    if s.default in s.unavailable_versions:
        return _unavailable(s, s.default)
    return _to(s, s.default, timeout, retry)


def _unknown(s: ServiceConfig, header: str) -> dict:
    """A route action (JSON form) for a version header that names no version or mix Envoy's route
    knows: Envoy answers 400 itself with the picker's error object for it (code "unknown_version",
    ``param`` the header). Envoy's direct response cannot quote the header's value, so the message
    lists the known names instead."""
    known = ", ".join(sorted([*(v.name for v in s.versions), *s.mixes, *s.models]))
    body = error_json(400, "unknown_version", f"unknown model version in header '{header}'; known versions: {known}",
                      header)
    return {"direct_response": {"status": 400, "body": {"inline_string": body}},
            "response_headers_to_add": [{"header": {"key": "content-type", "value": "application/json"},
                                         "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]}


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

    First, ``GET /v1/models`` and ``GET /v1/models/{name}``: the service's served names
    (:func:`models_list`), answered by Envoy.
    With the picker, a route follows the cluster header the picker set; without it (``envoy.picker:
    false``, or a picker that failed open), one route per version and per mix matches the version
    header exactly (a version with no endpoints now: a 503; a name of ``models``: the default
    version), then any other value of the version header is a 400. The last route sends requests
    without a version header to the service's default version (a 503 when it has no endpoints now).
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
            {"match": {"prefix": "/", "headers": [{"name": cfg.headers.version, "string_match": {"exact": name}}]},
             **_to(s, name, timeout, retry)}
            for name in [*(v.name for v in s.versions), *sorted(s.mixes)]
        ] + [
            {"match": {"prefix": "/", "headers": [{"name": cfg.headers.version, "string_match": {"exact": m}}]},
             **_fallback(s, timeout, retry)}
            for m in sorted(s.models)
        ] + [
            {"match": {"prefix": "/", "headers": [{"name": cfg.headers.version, "string_match": {"exact": v}}]},
             **_unavailable(s, v, cfg.headers.version)}
            for v in s.unavailable_versions
        ] + [
            {"match": {"prefix": "/", "headers": [{"name": cfg.headers.version, "present_match": True}]},
             **_unknown(s, cfg.headers.version)}
        ]
        vhosts.append({
            "name": s.name,
            "domains": domains,
            "routes": [
                *_models_routes(s),
                *by_cluster_header,
                *by_version,
                {"match": {"prefix": "/"}, **_fallback(s, timeout, retry)},
            ],
        })
    return json_format.ParseDict({"name": ROUTE_NAME, "validate_clusters": False, "virtual_hosts": vhosts},
                                 route_pb2.RouteConfiguration())
