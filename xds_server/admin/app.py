"""Admin HTTP API (aiohttp): health, readiness, metrics, weights, nodes, history, decisions, the page.

- ``GET /healthz`` 200 while the process runs.
- ``GET /readyz`` 200 once the first snapshot is published, else 503; ``{"ready", "warnings"}``
  (:func:`warnings`: a cluster without a healthy endpoint, say).
- ``GET /metrics`` Prometheus exposition: the process's registry plus this control plane's
  endpoint and node collectors (:mod:`xds_server.admin.exposition`).
- ``GET /api/v1/weights`` ``{"clusters": [{"name", "warning", "endpoints": [{"address", "weight", "health",
  "score", "scores", "inputs", "reasons", "filters", "factors", "target", "removed", "sources"}]}], "warnings",
  "metrics_source": {"name", "ok", "last_round_at", "configured", "fallback", "fallback_active",
  "sources"}, "snapshot_version"}``.
- ``GET /api/v1/nodes`` ``{"nodes": [{"node_id", "node_cluster", "peer", "protocol" ("sotw" | "delta"),
  "connected_since", "sent_bytes", "types": {"Cluster": {"acked_version", "sent_version",
  "pending_nonces", "last_nack", "last_nack_at", "acks", "nacks", "wildcard", "subscribed",
  ("resources_known" in delta)}, ...}}], "rejected_resources": [{"type", "name", "version",
  "problems", "kept"}]}`` (one entry per ADS stream; rejected = failed validation, not sent).
- ``GET /api/v1/history`` weight history (:mod:`xds_server.history.query`); 400 names a bad parameter,
  404 a ``cluster`` or ``endpoint`` known neither to the config nor to the history (:func:`check_target`).
- ``GET /api/v1/decisions`` a sample of recent picker decisions (any :class:`DecisionLog`; the app
  passes the picker's sampler).
- ``GET /api/v1/cost-model`` the picker's request cost model per GPU class (any :class:`CostModelView`;
  the app passes the in-process picker's).
- ``GET /api/v1/pickers`` the shared load view: each picker's live load per endpoint and its share
  (:meth:`xds_server.loadview.table.LoadTable.shares`).
- ``GET /openapi.json`` the OpenAPI 3.1 document of all of the above (``openapi.yaml``, as data).
- ``GET /`` the built-in page (``static/``): live weights table and weight-history chart.

Every route takes only the query parameters the OpenAPI document declares for it (none where it
declares none), each at most once: anything else is a 400 naming the parameter
(:func:`check_query`), as the history API's own parser answers.

Write operations (need the bearer token, see :class:`WriteAuth`):
- ``POST /api/v1/endpoints/{address}/drain`` DRAINING at once: no new requests (Envoy's load
  balancer and the picker skip it), in-flight ones finish (case C11); ``DELETE`` undoes it.
- ``POST /api/v1/reload`` reads the config file again (refused with the reason when invalid).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import yaml
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.log import server_logger
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, generate_latest

from xds_server.admin.exposition import AutoscalingCollector, EndpointCollector, NodeCollector
from xds_server.ads.server import AdsServicer, short_type
from xds_server.autoscaling import cluster_loads
from xds_server.config.model import cluster_name, normalize_endpoint_address
from xds_server.control import ControlPlane
from xds_server.errors import error_document
from xds_server.history.query import HistoryQuery, QueryError, parse_query, run_query
from xds_server.history.timeparse import STEP_RE, TIME_RE
from xds_server.history.types import HistoryError, HistoryStore
from xds_server.loadview.table import LoadTable
from xds_server.metrics.stats import as_dicts

HERE = Path(__file__).parent
STATIC = HERE / "static"


#: The largest ``limit`` of ``GET /api/v1/decisions`` (the sampler keeps far fewer).
MAX_DECISIONS_LIMIT = 1_000_000


def openapi_document() -> dict:
    """The OpenAPI document (``openapi.yaml`` next to this module) as a dict, with the history API's
    time and duration patterns filled in from :mod:`xds_server.history.timeparse` (the grammar the
    server parses with), so the document cannot drift from what the server accepts."""
    doc = yaml.safe_load((HERE / "openapi.yaml").read_text())
    patterns = {"since": TIME_RE, "until": TIME_RE, "step": STEP_RE}
    for param in doc["paths"]["/api/v1/history"]["get"]["parameters"]:
        if param["name"] in patterns:
            param["schema"]["pattern"] = f"^{patterns[param['name']]}$"
    return doc


def declared_parameters(doc: dict) -> dict[tuple[str, str], tuple[str, ...]]:
    """``{(METHOD, path): names of its query parameters}`` for every operation of an OpenAPI document
    (``path`` as written there, e.g. ``/api/v1/history``)."""
    return {(method.upper(), path): tuple(p["name"] for p in op.get("parameters", ()) if p["in"] == "query")
            for path, item in doc["paths"].items() for method, op in item.items()}


def check_query(request: web.Request, known: Sequence[str]) -> None:
    """Raise :class:`QueryError` naming the first query parameter of ``request`` that is not in
    ``known`` or is given more than once (the answer the history API's parser gives)."""
    for name in request.query:
        if name not in known:
            raise QueryError(name, f"unknown parameter; known: {', '.join(known)}" if known
                             else "unknown parameter; this endpoint takes none")
        if len(request.query.getall(name)) > 1:
            raise QueryError(name, "given more than once")


class UnknownTarget(QueryError):
    """A history filter (``cluster`` or ``endpoint``) that names nothing: an HTTP 404 naming it."""


def check_target(cp: ControlPlane, store: HistoryStore, q: HistoryQuery) -> None:
    """Raise :class:`UnknownTarget` when ``q.cluster`` (or ``q.endpoint``, in ``q.cluster`` when given)
    is neither in the current config nor anywhere in the history (blocking: call it off the event loop).

    The history keeps clusters and endpoints since removed from the config, and a configured one may
    have no rows yet: either is a 200, empty or not; only a name known to neither is a typo to report.
    """
    if q.cluster is not None and q.cluster not in {cluster_name(s.name, v.name) for s in cp.cfg.services
                                                   for v in s.versions}:
        if not store.rows(0.0, math.inf, q.cluster, None, 1):
            raise UnknownTarget("cluster", f"no cluster {q.cluster!r} in the config or in the history")
    if q.endpoint is not None:
        configured = cp.spec(q.cluster, q.endpoint) is not None if q.cluster else q.endpoint in cp.addresses
        if not configured and not store.rows(0.0, math.inf, q.cluster, q.endpoint, 1):
            where = f" in cluster {q.cluster!r}" if q.cluster else ""
            raise UnknownTarget("endpoint", f"no endpoint {q.endpoint!r}{where} in the config or in the history")


def history_document(cp: ControlPlane, store: HistoryStore, q: HistoryQuery) -> dict:
    """The ``/api/v1/history`` document (:func:`~xds_server.history.query.run_query`) after
    :func:`check_target` (blocking: call it off the event loop)."""
    check_target(cp, store, q)
    return run_query(store, q)


def weights_document(cp: ControlPlane) -> dict:
    """The ``/api/v1/weights`` document (shape in the module docstring)."""
    clusters: dict[str, list[dict]] = {}
    origin = getattr(cp.source, "origin", {})
    weights, draining = cp.weights, cp.draining
    for w, inputs in zip(weights, as_dicts([w.inputs for w in weights]), strict=True):  # inputs: one pass
        spec = cp.spec(w.cluster, w.address)
        clusters.setdefault(w.cluster, []).append({
            "address": w.address,
            "weight": w.weight,
            "health": w.health,
            "score": None if w.score is None else round(w.score, 4),
            "scores": {k: (None if v is None else round(v, 4)) for k, v in w.scores.items()},
            "inputs": inputs,
            "reasons": list(w.reasons),
            "filters": dict(w.filters),
            "factors": {k: round(v, 4) for k, v in w.factors.items()},
            "target": w.target,
            "removed": w.removed,
            "sources": origin.get(spec.instance, {}) if spec else {},
            "draining": w.address in draining,
        })
    snap = cp.cache.snapshot
    return {
        "snapshot_version": snap.version if snap else None,
        "metrics_source": {"name": cp.source_name, "ok": cp.metrics_ok, "last_round_at": cp.last_round_at,
                           **cp.source.describe()},
        "clusters": [{"name": n, "endpoints": eps, "warning": unserved_warning(n, cp.unserved.get(n))}
                     for n, eps in clusters.items()],
        "warnings": warnings(cp),
    }


def unserved_warning(cluster: str, why: str | None) -> str | None:
    """The warning about ``cluster`` when it has no healthy endpoint (``why``: and what Envoy does then,
    :attr:`ControlPlane.unserved <xds_server.control.ControlPlane.unserved>`), else None."""
    if why is None:
        return None
    return f"cluster {cluster} has no healthy endpoint: {why}"


def warnings(cp: ControlPlane) -> list[dict]:
    """What an operator must know now, in ``/readyz`` and ``/api/v1/weights``: ``[{"cluster", "code",
    "message"}]``, code ``no_healthy_endpoint`` for each cluster left without one (a whole-cluster
    drain, say)."""
    return [{"cluster": c, "code": "no_healthy_endpoint", "message": unserved_warning(c, why)}
            for c, why in sorted(cp.unserved.items())]


def _error(status: int, code: str, message: str, param: str | None = None,
           headers: dict[str, str] | None = None) -> web.Response:
    """An error answer: the OpenAI error object (:mod:`xds_server.errors`), ``param`` the query
    parameter (or path part) at fault."""
    return web.json_response(error_document(status, code, message, param), status=status, headers=headers)


log = logging.getLogger(__name__)
ADMIN_DENIED = Counter("inferlb_admin_denied_total", "Admin write requests refused, by reason", ["reason"])


def is_loopback(host: str) -> bool:
    """True for a loopback address or ``localhost`` (a wildcard such as 0.0.0.0 is not loopback)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class RequestLog(logging.LoggerAdapter):
    """The logger of the admin app's aiohttp request handlers (``aiohttp.server``, passed in the app's
    ``handler_args``): a request aiohttp refuses before any handler runs (an over-long request line or
    header, a malformed request; it answers 400) is one short debug line, without the traceback that
    aiohttp logs at ERROR with the request's bytes in it, so whoever reaches the port cannot fill the
    log. Every other error is logged as aiohttp logs it."""

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        """``Logger.exception``, but a refused request (:class:`HttpProcessingError`) is a debug line."""
        if isinstance(exc_info, HttpProcessingError):
            self.debug(f"{msg}: %s %.120r", *args, type(exc_info).__name__, exc_info.message, **kwargs)
        else:
            super().exception(msg, *args, exc_info=exc_info, **kwargs)


class DecisionLog(Protocol):
    """A sample of recent picker decisions: one of every ``every``, the newest ``size`` kept."""

    every: int
    size: int

    def recent(self, limit: int) -> Sequence[Any]:
        """The newest ``limit`` decisions, newest first; each has ``as_dict() -> dict``."""
        ...


#: ``() -> ({cluster: requests in flight}, {cluster: requests waiting in the picker})``.
LiveLoad = Callable[[], tuple[Mapping[str, float], Mapping[str, float]]]


class CostModelView(Protocol):
    """The picker's request cost model as the admin API shows it."""

    def describe(self) -> dict:
        """JSON-ready: ``{"forget", "min_samples", "classes": {gpu_class: {...}}}``."""
        ...


class WriteAuth:
    """Who may call write operations.

    With a ``token``, every write request needs ``Authorization: Bearer <token>`` (compared in
    constant time). Without one, writes are allowed only when the admin API binds a loopback
    ``host``; otherwise they are refused (403) until a token is configured.
    """

    def __init__(self, token: str | None, host: str) -> None:
        self._token = token.encode() if token else None
        self._loopback = is_loopback(host)

    def check(self, request: web.Request) -> web.Response | None:
        """None when allowed, else the 401/403 answer (the token is never logged or echoed)."""
        if self._token is None:
            if self._loopback:
                return None
            ADMIN_DENIED.labels("no-token-configured").inc()
            return _error(403, "writes_disabled", "write operations are disabled: the admin API is not bound to "
                                                  "loopback and no admin.token (or INFERLB_ADMIN_TOKEN) is set")
        got = request.headers.get("Authorization", "")
        scheme, _, value = got.partition(" ")
        # aiohttp decodes header bytes as UTF-8 with surrogate escapes: a token that is not UTF-8 keeps its
        # bytes (never equal to the configured token, which is text) instead of raising a 500
        if scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode("utf-8", "surrogateescape"),
                                                              self._token):
            return None
        ADMIN_DENIED.labels("bad-token" if got else "no-token").inc()
        log.warning("admin write %s %s refused: %s bearer token from %s", request.method, request.path,
                    "wrong" if got else "no", request.remote)
        return _error(401, "unauthorized", "a valid bearer token is required (Authorization: Bearer ...)",
                      headers={"WWW-Authenticate": "Bearer"})


def make_admin_app(cp: ControlPlane, ads: AdsServicer, history: HistoryStore | None = None,
                   sampler: DecisionLog | None = None, *, auth: WriteAuth | None = None,
                   reload: Callable[[], Awaitable[tuple[bool, str]]] | None = None,
                   is_ready: Callable[[], bool] | None = None,
                   cost_model: CostModelView | None = None, load_view: LoadTable | None = None,
                   live_load: LiveLoad | None = None) -> web.Application:
    """The admin application for one control plane, its ADS servicer, history store and decision sampler.

    Without ``history`` the history API answers 503; without ``sampler`` the decisions list is empty.
    ``auth``: who may write (default: loopback only, no token); ``reload``: the config reload
    (``() -> (applied, message)``; None = no reload endpoint); ``is_ready``: readiness (default:
    the first snapshot is published); ``cost_model``: the picker's request cost model (the app
    passes the in-process picker's; None: an empty model is shown); ``load_view``: the pickers' shared
    load view (None: no picker reports, an empty list is shown); ``live_load``: ``() ->
    ({cluster: requests in flight}, {cluster: requests waiting in the picker})`` for the autoscaling
    signal (None: no live load is known, both 0).
    """
    auth = auth or WriteAuth(None, "127.0.0.1")
    ready_now = is_ready or cp.ready.is_set
    local = CollectorRegistry(auto_describe=False)
    local.register(EndpointCollector(lambda: cp.weights))
    load_now = live_load or (lambda: ({}, {}))
    local.register(AutoscalingCollector(lambda: cluster_loads(cp.cfg, cp.weights, *load_now()),
                                        lambda: cp.cfg.autoscaling))
    local.register(NodeCollector(ads.describe_nodes, lambda: {
        short_type(t): v for t, v in (cp.cache.snapshot.versions.items() if cp.cache.snapshot else ())}))
    document = openapi_document()
    spec = json.dumps(document)
    declared = declared_parameters(document)

    @web.middleware
    async def strict_query(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                           ) -> web.StreamResponse:
        """400 for a query parameter the route does not declare, or one given twice (:func:`check_query`)."""
        resource = request.match_info.route.resource
        if resource is not None and request.query:  # None: no route matched (aiohttp's 404/405)
            method = "GET" if request.method == "HEAD" else request.method
            try:
                check_query(request, declared.get((method, resource.canonical), ()))
            except QueryError as err:
                return _error(400, "bad_parameter", str(err), err.param)
        return await handler(request)


    @web.middleware
    async def unrouted(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                       ) -> web.StreamResponse:
        """A path no route serves (404 ``not_found``) or a method its route does not take (405
        ``method_not_allowed``, with ``Allow``) as the error object every other answer uses (aiohttp's own is
        plain text)."""
        missed = request.match_info.http_exception
        if isinstance(missed, web.HTTPMethodNotAllowed):
            allowed = ", ".join(sorted(missed.allowed_methods))
            return _error(405, "method_not_allowed", f"{request.method} is not allowed on {request.path}; "
                          f"allowed: {allowed}", headers={"Allow": allowed})
        if missed is not None:
            return _error(missed.status, "not_found", f"no admin API route at {request.path} (GET /openapi.json "
                          "lists them)")
        return await handler(request)

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        ready = ready_now()
        return web.json_response({"ready": ready, "warnings": warnings(cp)}, status=200 if ready else 503)

    async def drain(request: web.Request) -> web.Response:
        denied = auth.check(request)
        if denied is not None:
            return denied
        written = request.match_info["address"]
        try:  # the config keeps one spelling per socket address: 10.0.0.1:08000 is 10.0.0.1:8000
            address = normalize_endpoint_address(written)
        except ValueError as err:
            return _error(400, "bad_parameter", f"address: {err}", "address")
        draining = request.method == "POST"
        if not await cp.set_draining(address, draining):
            return _error(404, "unknown_endpoint", f"no configured endpoint has address {address!r}", "address")
        snap = cp.cache.snapshot
        return web.json_response({"address": address, "draining": draining,
                                  "snapshot_version": snap.version if snap else None})

    async def do_reload(request: web.Request) -> web.Response:
        denied = auth.check(request)
        if denied is not None:
            return denied
        applied, message = await reload()
        return web.json_response({"applied": applied, "message": message}, status=200 if applied else 422)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(REGISTRY) + generate_latest(local),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def weights(_: web.Request) -> web.Response:
        return web.json_response(weights_document(cp))

    async def nodes(_: web.Request) -> web.Response:
        rejected = [{"type": r.type_url.rsplit(".", 1)[-1], "name": r.name, "version": r.version,
                     "problems": list(r.problems), "kept": r.kept} for r in ads.cache.rejections]
        return web.json_response({"nodes": ads.describe_nodes(), "rejected_resources": rejected})

    async def history_series(request: web.Request) -> web.Response:
        try:
            query = parse_query(request.query)
        except QueryError as err:
            return _error(400, "bad_parameter", str(err), err.param)
        if history is None:
            return _error(503, "history_unavailable", "history: this process keeps no history")
        try:
            doc = await asyncio.to_thread(history_document, cp, history, query)
        except UnknownTarget as err:
            return _error(404, "unknown_target", str(err), err.param)
        except HistoryError as err:
            return _error(503, "history_unavailable", str(err))
        return web.json_response(doc)

    async def decisions(request: web.Request) -> web.Response:
        limit = None
        if "limit" in request.query:
            raw = request.query["limit"]
            if not re.fullmatch(r"[0-9]{1,7}", raw) or not 1 <= int(raw) <= MAX_DECISIONS_LIMIT:
                return _error(400, "bad_parameter",
                              f"limit: expected an integer 1..{MAX_DECISIONS_LIMIT}, got {raw[:64]!r}", "limit")
            limit = int(raw)
        if sampler is None:
            return web.json_response({"every": 1, "size": 1, "decisions": []})
        return web.json_response({"every": sampler.every, "size": sampler.size,
                                  "decisions": [d.as_dict() for d in sampler.recent(limit)]})

    async def costs(_: web.Request) -> web.Response:
        if cost_model is None:
            return web.json_response({"forget": 1.0, "min_samples": 0, "classes": {}})
        return web.json_response(cost_model.describe())

    async def pickers(_: web.Request) -> web.Response:
        table = load_view if load_view is not None else LoadTable()
        return web.json_response(table.shares(time.monotonic()))

    async def openapi(_: web.Request) -> web.Response:
        return web.Response(text=spec, content_type="application/json")

    async def page(_: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / "index.html")

    app = web.Application(middlewares=[unrouted, strict_query], handler_args={"logger": RequestLog(server_logger)})
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/api/v1/weights", weights)
    app.router.add_get("/api/v1/nodes", nodes)
    app.router.add_get("/api/v1/history", history_series)
    app.router.add_get("/api/v1/decisions", decisions)
    app.router.add_get("/api/v1/cost-model", costs)
    app.router.add_get("/api/v1/pickers", pickers)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/", page)
    app.router.add_static("/static/", STATIC)
    app.router.add_post("/api/v1/endpoints/{address}/drain", drain)
    app.router.add_delete("/api/v1/endpoints/{address}/drain", drain)
    if reload is not None:
        app.router.add_post("/api/v1/reload", do_reload)
    return app
