"""Admin HTTP API (aiohttp): health, readiness, Prometheus metrics, current weights, connected nodes.

- ``GET /healthz`` 200 while the process runs.
- ``GET /readyz`` 200 once the first snapshot is published, else 503.
- ``GET /metrics`` Prometheus exposition of the process's registry.
- ``GET /api/v1/weights`` ``{"clusters": [{"name", "endpoints": [{"address", "weight", "health",
  "score", "scores", "inputs", "reasons"}]}], "metrics_source": {...}, "snapshot_version"}``.
- ``GET /api/v1/nodes`` ``{"nodes": [{"node_id", "node_cluster", "peer", "protocol" ("sotw" | "delta"),
  "connected_since", "sent_bytes", "types": {"Cluster": {"acked_version", "sent_version",
  "pending_nonces", "last_nack", "last_nack_at", "acks", "nacks", "wildcard", "subscribed",
  ("resources_known" in delta)}, ...}}], "rejected_resources": [{"type", "name", "version",
  "problems", "kept"}]}`` (one entry per ADS stream; rejected = failed validation, not sent).
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

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
        })
    snap = cp.cache.snapshot
    return {
        "snapshot_version": snap.version if snap else None,
        "metrics_source": {"name": cp.source_name, "ok": cp.metrics_ok, "last_round_at": cp.last_round_at},
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
        rejected = [{"type": r.type_url.rsplit(".", 1)[-1], "name": r.name, "version": r.version,
                     "problems": list(r.problems), "kept": r.kept} for r in ads.cache.rejections]
        return web.json_response({"nodes": ads.describe_nodes(), "rejected_resources": rejected})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/api/v1/weights", weights)
    app.router.add_get("/api/v1/nodes", nodes)
    return app
