"""Admin HTTP API (aiohttp): health, readiness, Prometheus metrics, current weights, connected nodes.

- ``GET /healthz`` 200 while the process runs.
- ``GET /readyz`` 200 once the first snapshot is published, else 503.
- ``GET /metrics`` Prometheus exposition of the process's registry.
- ``GET /api/v1/weights`` ``{"clusters": [{"name", "endpoints": [{"address", "weight", "health",
  "score", "scores", "inputs", "reasons"}]}], "metrics_source": {...}, "snapshot_version"}``.
- ``GET /api/v1/nodes`` connected Envoys with per-type ACKed version, last NACK, pending nonce.

Write operations (need the bearer token, see :class:`WriteAuth`):
- ``POST /api/v1/endpoints/{address}/drain`` DRAINING at once: no new requests (Envoy's load
  balancer and the picker skip it), in-flight ones finish (case C11); ``DELETE`` undoes it.
- ``POST /api/v1/reload`` reads the config file again (refused with the reason when invalid).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, generate_latest

from ..ads.server import AdsServicer
from ..control import ControlPlane


def weights_document(cp: ControlPlane) -> dict:
    """The ``/api/v1/weights`` document (shape in the module docstring)."""
    clusters: dict[str, list[dict]] = {}
    for w in cp.weights:
        clusters.setdefault(w.cluster, []).append({
            "address": w.address,
            "weight": w.weight,
            "health": w.health,
            "score": None if w.score is None else round(w.score, 4),
            "scores": {k: (None if v is None else round(v, 4)) for k, v in w.scores.items()},
            "inputs": w.inputs.as_dict(),
            "reasons": list(w.reasons),
            "draining": w.address in cp.draining,
        })
    snap = cp.cache.snapshot
    return {
        "snapshot_version": snap.version if snap else None,
        "metrics_source": {"name": cp.source_name, "ok": cp.metrics_ok, "last_round_at": cp.last_round_at},
        "clusters": [{"name": n, "endpoints": eps} for n, eps in clusters.items()],
    }


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
            return web.json_response({"error": "write operations are disabled: the admin API is not bound to "
                                               "loopback and no admin.token (or INFERLB_ADMIN_TOKEN) is set"},
                                     status=403)
        got = request.headers.get("Authorization", "")
        scheme, _, value = got.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), self._token):
            return None
        ADMIN_DENIED.labels("bad-token" if got else "no-token").inc()
        log.warning("admin write %s %s refused: %s bearer token from %s", request.method, request.path,
                    "wrong" if got else "no", request.remote)
        return web.json_response({"error": "a valid bearer token is required (Authorization: Bearer ...)"},
                                 status=401, headers={"WWW-Authenticate": "Bearer"})


def make_admin_app(cp: ControlPlane, ads: AdsServicer, *, auth: WriteAuth | None = None,
                   reload: Callable[[], Awaitable[tuple[bool, str]]] | None = None,
                   is_ready: Callable[[], bool] | None = None) -> web.Application:
    """The admin application for one control plane and its ADS servicer.

    ``auth``: who may write (default: loopback only, no token); ``reload``: the config reload
    (``() -> (applied, message)``; None = no reload endpoint); ``is_ready``: readiness (default:
    the first snapshot is published).
    """
    auth = auth or WriteAuth(None, "127.0.0.1")
    ready_now = is_ready or cp.ready.is_set

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        ready = ready_now()
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    async def drain(request: web.Request) -> web.Response:
        denied = auth.check(request)
        if denied is not None:
            return denied
        address = request.match_info["address"]
        draining = request.method == "POST"
        if not await cp.set_draining(address, draining):
            return web.json_response({"error": f"no configured endpoint has address {address!r}"}, status=404)
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
        return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def weights(_: web.Request) -> web.Response:
        return web.json_response(weights_document(cp))

    async def nodes(_: web.Request) -> web.Response:
        return web.json_response({"nodes": ads.describe_nodes()})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/api/v1/weights", weights)
    app.router.add_get("/api/v1/nodes", nodes)
    app.router.add_post("/api/v1/endpoints/{address}/drain", drain)
    app.router.add_delete("/api/v1/endpoints/{address}/drain", drain)
    if reload is not None:
        app.router.add_post("/api/v1/reload", do_reload)
    return app
