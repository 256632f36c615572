"""inferlb as the endpoint picker of a Gateway API gateway, on real Envoy configured as those gateways
configure it (envoy/gateway-api.yaml: override_host reading ``envoy.lb`` metadata, ext_proc with
both bodies FULL_DUPLEX_STREAMED), its endpoints discovered from an InferencePool served by the fake
Kubernetes API server: three simulated backends on 127.0.0.2-4 sharing the pool's target port.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import requests
import yaml

from inferlb.devstack import stack
from inferlb.serve import InferLB
from tests.integration.conftest import LoopThread, wait_until
from tests.support.kube import FakeApiServer, inference_pool, running_pod
from xds_server.config import parse_config

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "envoy" / "gateway-api.yaml"
HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
POOL = {"app": "vllm-chat"}


class Gateway:
    def __init__(self, app: InferLB, listener: str, admin: str, members: list[str]) -> None:
        self.app, self.listener, self.admin, self.members = app, listener, admin, members

    def client(self, **headers: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.listener}/v1", api_key="none", max_retries=0, timeout=30,
                             default_headers=headers or None)


def gateway_envoy(listener_port: int, admin_port: int, picker_port: int, members: list[str]) -> dict:
    """envoy/gateway-api.yaml with this test's addresses, and a header_to_metadata filter in front of
    ext_proc that turns the test header ``x-test-subset`` into the protocol's subset hint (what a
    gateway sets itself)."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["admin"]["address"]["socket_address"]["port_value"] = admin_port
    [listener] = doc["static_resources"]["listeners"]
    listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": listener_port}
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"].insert(0, {"name": "envoy.filters.http.header_to_metadata", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
        "request_rules": [{"header": "x-test-subset", "remove": True, "on_header_present": {
            "metadata_namespace": "envoy.lb.subset_hint", "key": "x-gateway-destination-endpoint-subset",
            "type": "STRING"}}]}})
    clusters = {c["name"]: c for c in doc["static_resources"]["clusters"]}
    clusters["vllm-chat"]["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
        {"endpoint": {"address": {"socket_address": {"address": h, "port_value": int(p)}}}}
        for h, p in (m.split(":") for m in members)]
    clusters["inferlb-picker"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
        "socket_address"]["port_value"] = picker_port
    return doc


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[Gateway]:
    work = tmp_path_factory.mktemp("gateway-api")
    api = FakeApiServer()
    loop = LoopThread()
    procs: list[stack.Proc] = []
    app = None
    try:
        port = stack.free_port()
        for host in HOSTS:
            procs.append(stack.start_sim(port, work, gpu_class="a100", version="v1", host=host,
                                         extra=["--time-scale", "0.2"]))
        members = [f"{h}:{port}" for h in HOSTS]
        api.pools = [inference_pool("vllm-chat", POOL, [port])]
        api.pods = [running_pod(f"chat-{i}", h, POOL) for i, h in enumerate(HOSTS)]
        api.pod_watch_scripts.put("hang")
        api.pool_watch_scripts.put("hang")
        cfg = parse_config(yaml.safe_dump({
            "listen": {"xds": "127.0.0.1:0", "ext_proc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
            "metrics": {"sources": ["scrape"]},
            "loop": {"interval_s": 0.5, "timeout_s": 1},
            # prefix_messages 1: the prefix key is the system prompt alone, so one prompt, one endpoint
            "picker": {"protocol": "gateway-api", "body_max_bytes": 1 << 20, "prefix_messages": 1},
            "discovery": {"kubernetes": {"namespace": "inference", "api_server": api.url,
                                         "inference_pools": [{"name": "chat", "pool": "vllm-chat",
                                                              "models": ["sim-7b"]}]}},
            "services": []}))
        app = InferLB(cfg)
        loop.run(app.start())
        wait_until(app.control.ready.is_set, 15, what="the pool's endpoints")
        app.sampler.every = 1   # keep every decision for the test to read
        listener_port, admin_port = stack.free_port(), stack.free_port()
        envoy_yaml = yaml.safe_dump(gateway_envoy(listener_port, admin_port, app.ext_proc_port, members))
        procs.append(stack.start_envoy(envoy_yaml, work, admin_port))
        stack.wait_http(f"http://127.0.0.1:{admin_port}/ready", procs[-1], timeout=20)
        yield Gateway(app, f"http://127.0.0.1:{listener_port}", f"http://127.0.0.1:{admin_port}", members)
    finally:
        for p in reversed(procs):
            p.stop()
        if app is not None:
            loop.run(app.stop(0.1))
        loop.close()
        api.close()


SYSTEM = {"role": "system", "content": "You are the shared assistant of this test. Answer tersely. " * 30}


def test_the_pool_and_its_pods_are_the_pickers_endpoints(gateway: Gateway):
    doc = requests.get(f"http://127.0.0.1:{gateway.app.admin_port}/api/v1/weights", timeout=5).json()
    assert {c["name"]: sorted(e["address"] for e in c["endpoints"]) for c in doc["clusters"]} == {
        "chat-v1": sorted(gateway.members)}


def test_an_openai_client_with_a_shared_system_prompt_is_routed_by_its_prefix_through_the_metadata(
        gateway: Gateway):
    before = len(gateway.app.sampler.recent())
    served = set()
    for i in range(6):
        raw = gateway.client().chat.completions.with_raw_response.create(
            model="sim-7b", max_tokens=4, messages=[SYSTEM, {"role": "user", "content": f"question {i}"}])
        assert raw.parse().usage.completion_tokens == 4
        served.add(raw.headers["x-served-by"])
    # override_host reads only the envoy.lb metadata here: one endpoint for one prefix is the picker's.
    assert len(served) == 1 and served <= set(gateway.members)
    decisions = gateway.app.sampler.recent(len(gateway.app.sampler.recent()) - before)
    assert [d.key for d in decisions] == ["prefix"] * 6
    assert {d.endpoint for d in decisions} == served
    wait_until(lambda: not any(gateway.app.picker.control.inflight.clusters.values()), 10,
               what="completions counted from the response on the ext_proc stream")


def test_a_streamed_answer_and_a_large_body_pass_through_the_full_duplex_picker(gateway: Gateway):
    long_prompt = "word " * 40_000   # 200 KB: the body goes to the picker and back in 64 KiB chunks
    chunks, usage = [], None
    with gateway.client().chat.completions.with_streaming_response.create(
            model="sim-7b", max_tokens=12, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "user", "content": long_prompt}]) as resp:
        for chunk in resp.parse():
            chunks += [c.delta.content for c in chunk.choices if c.delta.content]
            usage = chunk.usage or usage
    assert len(chunks) == 12 and usage is not None and usage.completion_tokens == 12
    assert usage.prompt_tokens >= 200_000 // 4 - 100   # the backend got the whole prompt back from the picker


@pytest.mark.parametrize("subset", [1, 2])
def test_the_gateways_subset_hint_is_obeyed(gateway: Gateway, subset: int):
    allowed = gateway.members[subset]
    for i in range(5):
        raw = gateway.client(**{"x-test-subset": f"{allowed},10.9.9.9:1"}).chat.completions.with_raw_response.create(
            model="sim-7b", max_tokens=2, messages=[{"role": "user", "content": f"hi {i}"}])
        assert raw.headers["x-served-by"] == allowed


def test_a_subset_hint_with_nothing_eligible_gets_503_from_the_picker(gateway: Gateway):
    r = requests.post(f"{gateway.listener}/v1/chat/completions", timeout=10,
                      headers={"x-test-subset": "10.9.9.9:1"},
                      json={"model": "sim-7b", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503
    assert json.loads(r.content)["error"]["code"] == "subset_empty"
