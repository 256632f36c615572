"""Admin HTTP API (aiohttp): health, readiness, Prometheus metrics, current weights, connected nodes.

- ``GET /healthz`` 200 while the process runs.
- ``GET /readyz`` 200 once the first snapshot is published, else 503.
- ``GET /metrics`` Prometheus exposition of the process's registry.
- ``GET /api/v1/weights`` ``{"clusters": [{"name", "endpoints": [{"address", "weight", "health",
  "score", "scores", "inputs", "reasons", "filters", "factors", "target", "removed", "sources"}]}],
  "metrics_source": {"name", "ok", "last_round_at", "configured", "fallback", "fallback_active",
  "sources"}, "snapshot_version"}``.
- ``GET /api/v1/nodes`` connected Envoys with per-type ACKed version, last NACK, pending nonce.
- ``POST /api/v1/drain`` ``{"endpoint": "HOST:PORT", "drain": true|false}``: start (or cancel)
  draining an endpoint (C11); 404 for an unknown endpoint, 400 for a bad body.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from ..ads.server import AdsServicer
from ..control import ControlPlane


def weights_document(cp: ControlPlane) -> dict:
    """The ``/api/v1/weights`` document (shape in the module docstring)."""
    clusters: dict[str, list[dict]] = {}
    origin = getattr(cp.source, "origin", {})
    for w in cp.weights:
        spec = cp.spec(w.cluster, w.address)
        clusters.setdefault(w.cluster, []).append({
            "address": w.address,
            "weight": w.weight,
            "health": w.health,
            "score": None if w.score is None else round(w.score, 4),
            "scores": {k: (None if v is None else round(v, 4)) for k, v in w.scores.items()},
            "inputs": w.inputs.as_dict(),
            "reasons": list(w.reasons),
            "filters": dict(w.filters),
            "factors": {k: round(v, 4) for k, v in w.factors.items()},
            "target": w.target,
            "removed": w.removed,
            "sources": origin.get(spec.instance, {}) if spec else {},
        })
    snap = cp.cache.snapshot
    return {
        "snapshot_version": snap.version if snap else None,
        "metrics_source": {"name": cp.source_name, "ok": cp.metrics_ok, "last_round_at": cp.last_round_at,
                           **cp.source.describe()},
        "clusters": [{"name": n, "endpoints": eps} for n, eps in clusters.items()],
    }


def make_admin_app(cp: ControlPlane, ads: AdsServicer) -> web.Application:
    """The admin application for one control plane and its ADS servicer."""

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        ready = cp.ready.is_set()
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def weights(_: web.Request) -> web.Response:
        return web.json_response(weights_document(cp))

    async def nodes(_: web.Request) -> web.Response:
        return web.json_response({"nodes": ads.describe_nodes()})

    async def drain(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("endpoint"), str) \
                or not isinstance(body.get("drain", True), bool):
            return web.json_response({"error": 'expected {"endpoint": "HOST:PORT", "drain": true|false}'},
                                     status=400)
        if not cp.set_draining(body["endpoint"], body.get("drain", True)):
            return web.json_response({"error": f"unknown endpoint {body['endpoint']!r}"}, status=404)
        return web.json_response({"endpoint": body["endpoint"], "drain": body.get("drain", True)})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/api/v1/weights", weights)
    app.router.add_get("/api/v1/nodes", nodes)
    app.router.add_post("/api/v1/drain", drain)
    return app
