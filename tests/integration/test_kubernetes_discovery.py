"""Kubernetes discovery against a fake API server at the HTTP level (aiohttp serving list and watch JSON).

No cluster runs here: the fake speaks the API's wire format for EndpointSlices (discovery.k8s.io/v1)
and Pods, including watch streams that end (the client resumes from the last resourceVersion) and a
``410 Gone`` (the client lists again).
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from collections.abc import Iterator

import pytest
import yaml
from aiohttp import web

from inferlb.serve import InferLB
from tests.integration.conftest import LoopThread, wait_until
from tests.support.snapshots import assignments_of
from xds_server.config import parse_config
from xds_server.discovery.kubernetes import KubernetesWatcher, compose_config, endpoints_from

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


class FakeApiServer:
    """Lists and watches from scripted state. ``watch_scripts``: one list of events (or "hang") per
    watch request, in order; ``watch_rvs`` records the resourceVersion each watch asked for."""

    def __init__(self) -> None:
        self.loop = LoopThread()
        self.slices: list[dict] = []
        self.pods: list[dict] = []
        self.list_rv = "100"
        self.lists = 0
        self.watch_rvs: list[str | None] = []
        self.watch_scripts: queue.Queue = queue.Queue()
        self.list_gate = threading.Event()   # cleared: lists wait for it (a slow API server)
        self.list_gate.set()
        self.url = self.loop.run(self._start())

    async def _start(self) -> str:
        app = web.Application()
        app.router.add_get(f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices", self._slices)
        app.router.add_get(f"/api/v1/namespaces/{NS}/pods", self._pods)
        self._runner = web.AppRunner(app, shutdown_timeout=0.2)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def _pods(self, request: web.Request) -> web.Response:
        return web.json_response({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"},
                                  "items": self.pods})

    async def _slices(self, request: web.Request) -> web.StreamResponse:
        assert "kubernetes.io/service-name" in request.query.get("labelSelector", "")
        if request.query.get("watch") not in ("true", "1", "True"):
            await asyncio.to_thread(self.list_gate.wait, 10)
            self.lists += 1
            return web.json_response({"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                                      "metadata": {"resourceVersion": self.list_rv}, "items": self.slices})
        self.watch_rvs.append(request.query.get("resourceVersion"))
        script = await asyncio.to_thread(self.watch_scripts.get)
        resp = web.StreamResponse()
        resp.content_type = "application/json"
        await resp.prepare(request)
        if script == "hang":
            await asyncio.sleep(3600)
        for event in script:
            await resp.write((json.dumps(event) + "\n").encode())
            await asyncio.sleep(0.05)
        return resp   # the watch ends, as when timeoutSeconds runs out

    def close(self) -> None:
        for _ in range(5):
            self.watch_scripts.put("hang")
        self.loop.run(self._runner.cleanup())
        self.loop.close()


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    a = FakeApiServer()
    yield a
    a.close()


BASE = """
discovery:
  kubernetes:
    namespace: inference
    api_server: {url}
    services:
      - {{name: chat, service: chat-backends, port: http, default_version: v1}}
services: []
"""


def test_endpoints_from_slices_and_pod_labels():
    spec = parse_config(BASE.format(url="http://x")).discovery.kubernetes
    slices = [slice_("a", "1", [endpoint("10.0.0.2", "p2"), endpoint("10.0.0.1", "p1"),
                                endpoint("10.0.0.3", "p3", ready=False), endpoint("10.0.0.4", "p4"),
                                endpoint("10.0.0.5", "p5")]),
              slice_("other", "1", [endpoint("10.0.9.9", "p1")], service="other-svc")]
    labels = {"p1": pod("p1", "v1", "h100")["metadata"]["labels"], "p2": pod("p2", "v1")["metadata"]["labels"],
              "p3": pod("p3", "v2")["metadata"]["labels"], "p4": pod("p4", None)["metadata"]["labels"],
              "p5": pod("p5", "v2", "a10")["metadata"]["labels"]}
    got = endpoints_from(slices, labels, spec)
    assert got == {"chat": {
        "v1": [{"address": "10.0.0.1:8000", "gpu_class": "h100", "max_concurrency": 8},
               {"address": "10.0.0.2:8000", "gpu_class": "a100", "max_concurrency": 8}],
        "v2": [{"address": "10.0.0.5:8000", "gpu_class": "a10", "max_concurrency": 8}]}}
    cfg = compose_config(parse_config(BASE.format(url="http://x")), got)
    assert [(v.name, [e.address for e in v.endpoints]) for v in cfg.services[0].versions] == [
        ("v1", ["10.0.0.1:8000", "10.0.0.2:8000"]), ("v2", ["10.0.0.5:8000"])]
    assert cfg.services[0].default == "v1"
    # Same inputs in another order: the same result (two replicas agree).
    assert endpoints_from(list(reversed(slices)), dict(reversed(labels.items())), spec) == got


def test_watch_resumes_from_the_last_resource_version_and_relists_after_410(api: FakeApiServer):
    spec = parse_config(BASE.format(url=api.url)).discovery.kubernetes
    api.pods = [pod("p1", "v1"), pod("p2", "v2", "a10")]
    api.slices = [slice_("chat-1", "100", [endpoint("10.0.0.1", "p1"), endpoint("10.0.0.2", "p2", ready=False)])]
    api.watch_scripts.put([{"type": "MODIFIED", "object": slice_("chat-1", "101", [
        endpoint("10.0.0.1", "p1"), endpoint("10.0.0.2", "p2")])},
                           {"type": "BOOKMARK", "object": {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
                                                           "metadata": {"resourceVersion": "105"}}}])
    api.watch_scripts.put([{"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "code": 410,
                                                        "reason": "Expired", "message": "too old resource version"}}])
    api.watch_scripts.put("hang")
    seen: list[dict] = []
    changed = threading.Event()

    def on_change(d):
        seen.append(d)
        changed.set()

    watcher = KubernetesWatcher(spec, on_change, watch_timeout_s=5)
    watcher.start()
    try:
        wait_until(lambda: len(seen) >= 1, 10, 0.05, "the first list")
        assert seen[0] == {"chat": {"v1": [{"address": "10.0.0.1:8000", "gpu_class": "a100", "max_concurrency": 8}]}}
        wait_until(lambda: len(seen) >= 2, 10, 0.05, "the MODIFIED event")
        assert set(seen[1]["chat"]) == {"v1", "v2"}
        api.slices = [slice_("chat-1", "200", [endpoint("10.0.0.2", "p2")])]
        api.list_rv = "200"
        wait_until(lambda: api.lists >= 2, 10, 0.05, "a new list after 410 Gone")
        wait_until(lambda: len(api.watch_rvs) >= 3, 10, 0.05, "the watch after the relist")
        assert api.watch_rvs == ["100", "105", "200"]   # resumed from the bookmark, then from the new list
        assert seen[-1] == {"chat": {"v2": [{"address": "10.0.0.2:8000", "gpu_class": "a10", "max_concurrency": 8}]}}
    finally:
        watcher.stop()


def test_inferlb_pushes_nothing_before_discovery_then_the_discovered_clusters(api: FakeApiServer, tmp_path):
    api.pods = [pod("p1", "v1"), pod("p2", "v2", "a10")]
    api.slices = [slice_("chat-1", "100", [endpoint("127.0.0.1", "p1")]),
                  slice_("chat-2", "100", [endpoint("127.0.0.2", "p2")])]
    api.list_gate.clear()   # the API server is slow to answer the first list
    api.watch_scripts.put("hang")
    cfg_path = tmp_path / "inferlb.yaml"
    doc = yaml.safe_load(BASE.format(url=api.url))
    doc.update({"listen": {"xds": "127.0.0.1:0", "ext_proc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
                "prometheus": {"url": "http://127.0.0.1:1", "interval_s": 0.2, "timeout_s": 0.2,
                               "first_round_wait_s": 0}})
    cfg_path.write_text(yaml.safe_dump(doc))
    loop = LoopThread()
    app = InferLB(parse_config(cfg_path.read_text()), cfg_path)
    try:
        loop.run(app.start())
        time.sleep(1.0)
        assert app.cache.snapshot is None and not app.control.ready.is_set()
        api.list_gate.set()
        wait_until(app.control.ready.is_set, 10, 0.05, "the first snapshot after discovery")
        assignments = assignments_of(app.cache.snapshot)
        assert sorted(assignments) == ["chat-v1", "chat-v2"]
        hosts = {c: [e.endpoint.address.socket_address.address for loc in a.endpoints for e in loc.lb_endpoints]
                 for c, a in assignments.items()}
        assert hosts == {"chat-v1": ["127.0.0.1"], "chat-v2": ["127.0.0.2"]}
    finally:
        loop.run(app.stop(0.1))
        loop.close()

