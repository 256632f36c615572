"""A fake Kubernetes API server at the HTTP level (aiohttp serving list and watch JSON) and the objects
it serves: EndpointSlices (discovery.k8s.io/v1), InferencePools (inference.networking.k8s.io/v1) and
Pods, with watch streams scripted event by event (a stream that ends, a ``410 Gone``, one that hangs).
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading

from aiohttp import web

from tests.integration.conftest import LoopThread

NS = "inference"


def pod(name: str, version: str | None, gpu: str | None = None) -> dict:
    labels = {"app": "chat"}
    if version:
        labels["inferlb.io/model-version"] = version
    if gpu:
        labels["inferlb.io/gpu-class"] = gpu
    return {"metadata": {"name": name, "namespace": NS, "labels": labels}}


def endpoint(ip: str, pod_name: str, ready: bool = True) -> dict:
    return {"addresses": [ip], "conditions": {"ready": ready}, "targetRef": {"kind": "Pod", "name": pod_name}}


def slice_(name: str, rv: str, endpoints: list[dict], service: str = "chat-backends") -> dict:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": name, "namespace": NS, "resourceVersion": rv,
                         "labels": {"kubernetes.io/service-name": service}},
            "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}], "endpoints": endpoints}


def running_pod(name: str, ip: str, labels: dict[str, str], ready: bool = True, deleting: bool = False) -> dict:
    """A pod as the API server lists it, with an IP and a Ready condition."""
    meta: dict = {"name": name, "namespace": NS, "labels": labels, "resourceVersion": "1"}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def inference_pool(name: str, match: dict[str, str], ports: list[int], rv: str = "1") -> dict:
    """An InferencePool (inference.networking.k8s.io/v1) as in the API's examples."""
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": name, "namespace": NS, "resourceVersion": rv},
            "spec": {"selector": {"matchLabels": match}, "targetPorts": [{"number": p} for p in ports],
                     "endpointPickerRef": {"name": "inferlb", "port": {"number": 18080}, "failureMode": "FailOpen"}}}


class FakeApiServer:
    """Lists and watches from scripted state. ``watch_scripts``: one list of events (or "hang") per
    EndpointSlice watch request, in order (``pool_watch_scripts``, ``pod_watch_scripts``: the same for
    InferencePools and Pods); ``watch_rvs`` records the resourceVersion each slice watch asked for
    (``pool_watch_rvs``, ``pod_watch_rvs``: each pool and pod watch)."""

    def __init__(self) -> None:
        self.loop = LoopThread()
        self.slices: list[dict] = []
        self.pods: list[dict] = []
        self.pools: list[dict] = []
        self.list_rv = "100"
        self.lists = 0
        self.pod_lists = 0
        self.watch_rvs: list[str | None] = []
        self.pool_watch_rvs: list[str | None] = []
        self.pod_watch_rvs: list[str | None] = []
        self.watch_scripts: queue.Queue = queue.Queue()
        self.pool_watch_scripts: queue.Queue = queue.Queue()
        self.pod_watch_scripts: queue.Queue = queue.Queue()
        self.list_gate = threading.Event()   # cleared: lists wait for it (a slow API server)
        self.list_gate.set()
        self.url = self.loop.run(self._start())

    async def _start(self) -> str:
        app = web.Application()
        app.router.add_get(f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices", self._slices)
        app.router.add_get(f"/api/v1/namespaces/{NS}/pods", self._pods)
        app.router.add_get(f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools", self._pools)
        self._runner = web.AppRunner(app, shutdown_timeout=0.2)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") in ("true", "1", "True"):
            self.pod_watch_rvs.append(request.query.get("resourceVersion"))
            return await self._stream(request, self.pod_watch_scripts)
        self.pod_lists += 1
        return web.json_response({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": self.list_rv},
                                  "items": self.pods})

    async def _pools(self, request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") in ("true", "1", "True"):
            self.pool_watch_rvs.append(request.query.get("resourceVersion"))
            return await self._stream(request, self.pool_watch_scripts)
        return web.json_response({"kind": "InferencePoolList", "apiVersion": "inference.networking.k8s.io/v1",
                                  "metadata": {"resourceVersion": self.list_rv}, "items": self.pools})

    async def _stream(self, request: web.Request, scripts: queue.Queue) -> web.StreamResponse:
        script = await asyncio.to_thread(scripts.get)
        resp = web.StreamResponse()
        resp.content_type = "application/json"
        await resp.prepare(request)
        if script == "hang":
            await asyncio.sleep(3600)
        for event in script:
            await resp.write((json.dumps(event) + "\n").encode())
            await asyncio.sleep(0.05)
        return resp   # the watch ends, as when timeoutSeconds runs out

    async def _slices(self, request: web.Request) -> web.StreamResponse:
        assert "kubernetes.io/service-name" in request.query.get("labelSelector", "")
        if request.query.get("watch") not in ("true", "1", "True"):
            await asyncio.to_thread(self.list_gate.wait, 10)
            self.lists += 1
            return web.json_response({"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                                      "metadata": {"resourceVersion": self.list_rv}, "items": self.slices})
        self.watch_rvs.append(request.query.get("resourceVersion"))
        return await self._stream(request, self.watch_scripts)

    def close(self) -> None:
        for _ in range(5):
            for scripts in (self.watch_scripts, self.pool_watch_scripts, self.pod_watch_scripts):
                scripts.put("hang")
        self.loop.run(self._runner.cleanup())
        self.loop.close()
