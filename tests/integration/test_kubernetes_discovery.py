"""Kubernetes discovery against a fake API server at the HTTP level (aiohttp serving list and watch JSON).

No cluster runs here: the fake speaks the API's wire format for EndpointSlices (discovery.k8s.io/v1),
InferencePools (inference.networking.k8s.io/v1) and Pods, including watch streams that end (the
client resumes from the last resourceVersion) and a ``410 Gone`` (the client lists again).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import yaml

from inferlb.serve import InferLB
from tests.integration.conftest import LoopThread, wait_until
from tests.support.kube import FakeApiServer, endpoint, inference_pool, pod, running_pod, slice_
from tests.support.snapshots import assignments_of
from xds_server.config import parse_config
from xds_server.discovery.inferencepool import endpoints_from_pools
from xds_server.discovery.kubernetes import KubernetesWatcher, compose_config, endpoints_from


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



POOLS = """
discovery:
  kubernetes:
    namespace: inference
    api_server: {url}
    inference_pools:
      - {{name: chat, pool: vllm-chat, models: [sim-7b]}}
services: []
"""

CHAT = {"app": "vllm-chat"}


def test_endpoints_from_an_inference_pool_and_its_ready_pods():
    spec = parse_config(POOLS.format(url="http://x")).discovery.kubernetes
    pools = [inference_pool("vllm-chat", CHAT, [8000, 8001]),
             inference_pool("other", {"app": "other"}, [9000]),                 # not configured: ignored
             inference_pool("vllm-chat-broken", {}, [8000])]
    pods = [running_pod("a", "10.0.0.2", {**CHAT, "inferlb.io/gpu-class": "h100"}),
            running_pod("b", "10.0.0.1", {**CHAT, "inferlb.io/model-version": "v2"}),
            running_pod("c", "10.0.0.3", CHAT, ready=False),                      # not ready
            running_pod("d", "10.0.0.4", CHAT, deleting=True),                    # terminating
            running_pod("e", "10.0.0.5", {"app": "other"}),                       # another pool's
            running_pod("f", "", CHAT)]                                           # no IP yet
    got = endpoints_from_pools(pools, pods, spec)
    assert got == {"chat": {
        "v1": [{"address": "10.0.0.2:8000", "gpu_class": "h100", "max_concurrency": 8},
               {"address": "10.0.0.2:8001", "gpu_class": "h100", "max_concurrency": 8}],
        "v2": [{"address": "10.0.0.1:8000", "gpu_class": "a100", "max_concurrency": 8},
               {"address": "10.0.0.1:8001", "gpu_class": "a100", "max_concurrency": 8}]}}
    assert endpoints_from_pools(list(reversed(pools)), list(reversed(pods)), spec) == got   # replicas agree
    cfg = compose_config(parse_config(POOLS.format(url="http://x")), got)
    chat = cfg.services[0]
    assert chat.name == "chat" and chat.models == ("sim-7b",) and chat.default == "v1"
    assert [(v.name, [e.address for e in v.endpoints]) for v in chat.versions] == [
        ("v1", ["10.0.0.2:8000", "10.0.0.2:8001"]), ("v2", ["10.0.0.1:8000", "10.0.0.1:8001"])]
    # The pool with no selector would select every pod: it is left out, never taken as "all".
    broken = parse_config(POOLS.format(url="http://x").replace("pool: vllm-chat,", "pool: vllm-chat-broken,"))
    assert endpoints_from_pools(pools, pods, broken.discovery.kubernetes) == {"chat": {}}


def test_inference_pools_config_is_checked():
    with pytest.raises(Exception, match="services or inference_pools"):
        parse_config("discovery: {kubernetes: {namespace: x}}\nservices: []\n")
    with pytest.raises(Exception, match="listed twice"):
        parse_config("discovery: {kubernetes: {inference_pools: [{name: a, pool: p}, {name: b, pool: p}]}}\n"
                     "services: []\n")
    with pytest.raises(Exception, match="used twice"):
        parse_config("discovery: {kubernetes: {inference_pools: [{name: a, pool: p}],"
                     " services: [{name: a, service: s}]}}\nservices: []\n")


def test_pool_and_pod_watches_follow_readiness_ports_and_a_410(api: FakeApiServer):
    spec = parse_config(POOLS.format(url=api.url)).discovery.kubernetes
    api.pools = [inference_pool("vllm-chat", CHAT, [8000])]
    api.pods = [running_pod("a", "10.0.0.1", CHAT), running_pod("b", "10.0.0.2", CHAT, ready=False)]
    became_ready = running_pod("b", "10.0.0.2", CHAT)
    became_ready["metadata"]["resourceVersion"] = "101"
    api.pod_watch_scripts.put([{"type": "MODIFIED", "object": became_ready}])
    api.pod_watch_scripts.put([{"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "code": 410,
                                                            "reason": "Expired", "message": "too old"}}])
    api.pod_watch_scripts.put("hang")
    api.pool_watch_scripts.put([{"type": "MODIFIED", "object": inference_pool("vllm-chat", CHAT, [9000], "102")}])
    api.pool_watch_scripts.put("hang")
    seen: list[dict] = []
    watcher = KubernetesWatcher(spec, seen.append, watch_timeout_s=5)

    def addresses(d: dict) -> list[str]:
        return [e["address"] for eps in d["chat"].values() for e in eps]

    watcher.start()
    try:
        wait_until(lambda: seen, 10, 0.05, "the first lists")
        assert addresses(seen[0]) == ["10.0.0.1:8000"]   # ready pods only, after both kinds were listed
        wait_until(lambda: any(addresses(d) == ["10.0.0.1:9000", "10.0.0.2:9000"] for d in seen), 10, 0.05,
                   "the pod turning ready and the pool's new target port")
        api.pods = [running_pod("b", "10.0.0.2", CHAT)]   # pod a went away while the watch was broken
        api.list_rv = "300"
        wait_until(lambda: api.pod_lists >= 2, 10, 0.05, "a new pod list after 410 Gone")
        wait_until(lambda: addresses(seen[-1]) == ["10.0.0.2:9000"], 10, 0.05, "the relisted pods")
        wait_until(lambda: len(api.pod_watch_rvs) >= 3, 10, 0.05, "the pod watch after the relist")
        assert api.pod_watch_rvs == ["100", "101", "300"]
        assert api.pool_watch_rvs[:2] == ["100", "102"]
    finally:
        watcher.stop()


def test_inferlb_serves_an_inference_pools_members_as_a_cluster(api: FakeApiServer, tmp_path):
    api.pools = [inference_pool("vllm-chat", CHAT, [8000])]
    api.pods = [running_pod("a", "127.0.0.2", CHAT), running_pod("b", "127.0.0.3", CHAT)]
    api.pod_watch_scripts.put("hang")
    api.pool_watch_scripts.put("hang")
    cfg_path = tmp_path / "inferlb.yaml"
    doc = yaml.safe_load(POOLS.format(url=api.url))
    doc.update({"listen": {"xds": "127.0.0.1:0", "ext_proc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
                "prometheus": {"url": "http://127.0.0.1:1", "interval_s": 0.2, "timeout_s": 0.2,
                               "first_round_wait_s": 0}})
    cfg_path.write_text(yaml.safe_dump(doc))
    loop = LoopThread()
    app = InferLB(parse_config(cfg_path.read_text()), cfg_path)
    try:
        loop.run(app.start())
        wait_until(app.control.ready.is_set, 10, 0.05, "the first snapshot after discovery")
        assignments = assignments_of(app.cache.snapshot)
        hosts = {c: sorted(e.endpoint.address.socket_address.address for loc in a.endpoints for e in loc.lb_endpoints)
                 for c, a in assignments.items()}
        assert hosts == {"chat-v1": ["127.0.0.2", "127.0.0.3"]}
    finally:
        loop.run(app.stop(0.1))
        loop.close()
