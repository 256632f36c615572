"""etcd discovery, the pure parts: registrations, endpoints, config composition, the watch stream's messages,
and the status source. The real etcd is in tests/integration/test_etcd_discovery.py."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest
import yaml
from pydantic import ValidationError

from xds_server.config import ConfigError, parse_config
from xds_server.discovery.etcd import (
    BadRegistration,
    Compacted,
    EtcdError,
    EtcdWatcher,
    LineSplitter,
    compose_config,
    endpoints_from,
    parse_registration,
    prefix_end,
)
from xds_server.metrics.build import build_sources
from xds_server.metrics.sources.status import BadSnapshot, StatusSource, snapshot_stats

PREFIX = "/inferlb/endpoints/"
BASE = {"discovery": {"etcd": {"endpoints": ["http://127.0.0.1:2379"],
                               "services": [{"name": "chat", "default_version": "v1"},
                                            {"name": "code", "service": "coder"}]}},
        "services": []}
GPUS = ("a100", "h100", "a10")


def cfg(**extra):
    return parse_config(yaml.safe_dump({**BASE, **extra}))


def reg(key_address: str, **fields):
    doc = {"service": "chat", "version": "v1", **fields}
    return parse_registration(PREFIX + key_address, json.dumps(doc).encode(), PREFIX)


def test_a_registration_with_every_field_and_its_status():
    r = reg("10.0.0.5:8000", gpu_class="a10", max_concurrency=4, gpu_memory_mib=24576, draining=True,
            status={"running": 2, "waiting": 1, "kv_cache_usage": 0.5, "gpu_memory_free_mib": 1000,
                    "gpu_utilization": 0.25, "at": 1.0})
    assert (r.address, r.service, r.version, r.gpu_class, r.max_concurrency, r.gpu_memory_mib, r.draining) == (
        "10.0.0.5:8000", "chat", "v1", "a10", 4, 24576, True)
    assert (r.status.running, r.status.queue, r.status.in_flight, r.status.kv_cache, r.status.gpu_mem_free_mib,
            r.status.gpu_util) == (2, 1, 3, 0.5, 1000, 0.25)
    # The address defaults to the key's suffix; the value's own address wins.
    assert reg("10.0.0.6:8000", address="10.0.0.7:8000").address == "10.0.0.7:8000"
    assert reg("10.0.0.6:8000").status is None and reg("10.0.0.6:8000").gpu_class is None


@pytest.mark.parametrize(("value", "field"), [
    (b"not json", "value"), (b"[1]", "value"),
    (json.dumps({"version": "v1"}).encode(), "service"),
    (json.dumps({"service": "chat", "version": "v-1"}).encode(), "version"),
    (json.dumps({"service": "chat", "version": "v1", "draining": "yes"}).encode(), "draining"),
    (json.dumps({"service": "chat", "version": "v1", "max_concurrency": 0}).encode(), "max_concurrency"),
    (json.dumps({"service": "chat", "version": "v1", "address": "host.example:80"}).encode(), "address"),
])
def test_a_bad_registration_names_its_field(value, field):
    with pytest.raises(BadRegistration) as err:
        parse_registration(PREFIX + "10.0.0.1:8000", value, PREFIX)
    assert err.value.field == field


def test_a_bad_status_is_dropped_not_the_registration():
    r = reg("10.0.0.5:8000", status={"running": -1})
    assert r.status is None and "status.running" in r.status_error
    assert reg("10.0.0.5:8000", status={"kv_cache_usage": 1.5}).status_error
    with pytest.raises(BadSnapshot):
        snapshot_stats([1])
    assert snapshot_stats({"running": 1}).in_flight is None   # no waiting: in_flight unknown


def test_prefix_end_is_etcds_range_end():
    assert prefix_end("/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"
    with pytest.raises(ValueError):
        prefix_end("")


def test_endpoints_from_registrations_stable_and_filtered():
    spec = cfg().discovery.etcd
    regs = [reg("10.0.0.2:8000", max_concurrency=2), reg("10.0.0.1:8000", version="v2", gpu_class="h100"),
            reg("10.0.0.3:8000", service="unknown"), reg("10.0.0.4:8000", gpu_class="tpu"),
            reg("10.0.0.5:8000", service="coder", draining=True),
            parse_registration(PREFIX + "zz", json.dumps({"service": "chat", "version": "v1",
                                                          "address": "10.0.0.2:8000"}).encode(), PREFIX)]
    got = endpoints_from(regs, spec, GPUS)
    assert got == {
        "chat": {"v1": [{"address": "10.0.0.2:8000", "gpu_class": "a100", "max_concurrency": 2}],
                 "v2": [{"address": "10.0.0.1:8000", "gpu_class": "h100", "max_concurrency": 8}]},
        "code": {"v1": [{"address": "10.0.0.5:8000", "gpu_class": "a100", "max_concurrency": 8, "drain": True}]}}
    assert endpoints_from(list(reversed(regs)), spec, GPUS) == got   # two replicas agree


def test_compose_config_adds_the_registered_services():
    base = cfg(services=[{"name": "static", "hosts": ["static.example"],
                          "versions": [{"name": "v1", "endpoints": [{"address": "10.1.0.1:8000"}]}]}])
    discovered = {"chat": {"v1": [{"address": "10.0.0.1:8000", "gpu_class": "a100", "max_concurrency": 8,
                                   "drain": True}]}, "code": {}}
    out = compose_config(base, discovered)
    assert [s.name for s in out.services] == ["static", "chat"]   # a service with no endpoint has no cluster
    chat = out.services[1]
    assert chat.default == "v1" and chat.versions[0].endpoints[0].drain is True
    # An address the static services have is left out; the others still join.
    out = compose_config(base, {"chat": {"v1": [{"address": "10.1.0.1:8000"}, {"address": "10.0.0.2:8000"}],
                                         "v2": [{"address": "10.1.0.1:8000"}]}})
    assert [(v.name, [e.address for e in v.endpoints]) for v in out.services[1].versions] == [
        ("v1", ["10.0.0.2:8000"])]
    with pytest.raises(ValidationError, match="defined twice"):
        compose_config(cfg(services=[{"name": "chat", "versions": [{"name": "v1", "endpoints": [
            {"address": "10.1.0.1:8000"}]}]}]), discovered)


def test_a_default_version_whose_nodes_all_left_stays_the_default_and_unavailable():
    """chat's default is v1; only v2 nodes are registered: requests for v1 or none must not go to v2."""
    out = compose_config(cfg(), {"chat": {"v2": [{"address": "10.0.0.9:8000"}]}})
    [chat] = out.services
    assert (chat.default, chat.unavailable_versions, [v.name for v in chat.versions]) == ("v1", ("v1",), ["v2"])
    back = compose_config(cfg(), {"chat": {"v1": [{"address": "10.0.0.1:8000"}], "v2": [{"address": "10.0.0.9:8000"}]}})
    assert back.services[0].unavailable_versions == ()


def test_the_config_section_and_its_checks():
    spec = cfg().discovery.etcd
    assert (spec.prefix, spec.endpoints, spec.timeout_s, spec.watch_timeout_s, spec.default_gpu_class,
            spec.default_max_concurrency) == (PREFIX, ("http://127.0.0.1:2379",), 5.0, 300.0, "a100", 8)
    assert [s.registered_as for s in spec.services] == ["chat", "coder"]
    with pytest.raises(ConfigError, match="discovery.etcd.endpoints"):
        parse_config(yaml.safe_dump({**BASE, "discovery": {"etcd": {"endpoints": ["127.0.0.1:2379"],
                                                                    "services": [{"name": "chat"}]}}}))
    with pytest.raises(ConfigError, match="listed twice"):
        parse_config(yaml.safe_dump({**BASE, "discovery": {"etcd": {
            "services": [{"name": "a", "service": "x"}, {"name": "b", "service": "x"}]}}}))
    with pytest.raises(ConfigError, match="cert and key"):
        parse_config(yaml.safe_dump({**BASE, "discovery": {"etcd": {"tls": {"cert": "/c.pem"},
                                                                    "services": [{"name": "a"}]}}}))
    with pytest.raises(ConfigError, match="password is set but username is not"):
        parse_config(yaml.safe_dump({**BASE, "discovery": {"etcd": {"password": "x", "services": [{"name": "a"}]}}}))
    assert "secret" not in repr(parse_config(yaml.safe_dump({**BASE, "discovery": {"etcd": {
        "username": "u", "password": "secret", "services": [{"name": "a"}]}}})).discovery.etcd)
    with pytest.raises(ConfigError, match="needs discovery.etcd"):
        parse_config(yaml.safe_dump({"metrics": {"sources": ["status"]}, "services": [
            {"name": "s", "versions": [{"name": "v1", "endpoints": [{"address": "10.0.0.1:1"}]}]}]}))
    sources = build_sources(cfg(metrics={"sources": ["status"]}))
    assert sources.status is not None and sources.combined.configured == ["status"]


def test_the_status_source_ages_forgets_and_merges():
    src = StatusSource()
    src.set("a:1", snapshot_stats({"running": 1, "waiting": 2}), at=100.0)
    src.set("b:1", snapshot_stats({"running": 0}), at=100.0)
    got = src.fetch(["a:1", "c:1"], now=103.0)
    assert list(got) == ["a:1"] and got["a:1"].sample_age_s == 3.0 and got["a:1"].in_flight == 3
    src.retain(["a:1"])
    assert src.fetch(["b:1"]) == {}
    src.discard("a:1")
    assert src.fetch(["a:1"]) == {} and src.describe()["accepted"] == 2


def _line(result: dict) -> bytes:
    return json.dumps({"result": result}).encode()


def _kv(key: str, value: dict | None, rev: int) -> dict:
    kv = {"key": base64.b64encode(key.encode()).decode(), "mod_revision": str(rev)}
    if value is not None:
        kv["value"] = base64.b64encode(json.dumps(value).encode()).decode()
    return kv


def test_watch_messages_update_the_table_and_the_revision():
    c = cfg(metrics={"sources": ["status"]})
    seen: list[dict] = []

    async def on_change(d):
        seen.append(d)

    w = EtcdWatcher(c.discovery.etcd, c.gpu_classes, on_change, StatusSource())
    w.revision = 10
    ep = {"service": "chat", "version": "v1", "status": {"running": 1, "waiting": 0}}

    async def go():
        await w._on_line(_line({"created": True}))
        await w._on_line(_line({"events": [{"kv": _kv(PREFIX + "10.0.0.1:80", ep, 11)}]}))
        await w._on_line(_line({"events": [{"kv": _kv(PREFIX + "10.0.0.1:80", {**ep, "status": {"running": 2}},
                                                      12)}]}))
        await w._on_line(_line({"events": [{"type": "DELETE", "kv": _kv(PREFIX + "10.0.0.1:80", None, 13)}]}))
        await w._on_line(_line({"header": {"revision": "40"}, "created": True}))   # not a progress mark
        assert w.revision == 13
        await w._on_line(_line({"header": {"revision": "20"}}))   # progress: all events up to 20 sent
        for bad, error in ((_line({"canceled": True, "compact_revision": "12"}), Compacted),
                           (_line({"canceled": True}), EtcdError),
                           (json.dumps({"error": {"message": "transport is closing"}}).encode(), EtcdError)):
            with pytest.raises(error):
                await w._on_line(bad)

    asyncio.run(go())
    # Registered, then removed: the status-only update emitted nothing.
    assert seen == [{"chat": {"v1": [{"address": "10.0.0.1:80", "gpu_class": "a100", "max_concurrency": 8}]},
                     "code": {}}, {"chat": {}, "code": {}}]
    assert w.revision == 20 and w.status.fetch(["10.0.0.1:80"]) == {}


def test_the_line_splitter_joins_chunks_and_takes_long_lines():
    split = LineSplitter(max_bytes=1 << 20)
    assert split.feed(b'{"a"') == [] and split.feed(b':1}\n\n{"b":2}\n{"c"') == [b'{"a":1}', b'{"b":2}']
    long = b"x" * 300_000
    assert split.feed(b":3}\n" + long[:1000]) == [b'{"c":3}'] and split.feed(long[1000:] + b"\n") == [long]
    with pytest.raises(ValueError):
        split.feed(b"y" * (2 << 20))


def test_kubernetes_and_etcd_discovery_compose_together():
    from xds_server.discovery import kubernetes

    base = cfg(discovery={"etcd": {"services": [{"name": "chat", "hosts": ["chat.example"]}]},
                          "kubernetes": {"services": [{"name": "k8s", "service": "vllm"}]}})
    k8s = {"k8s": {"v1": [{"address": "10.3.0.1:8000", "gpu_class": "a100", "max_concurrency": 8}]}}
    etcd = {"chat": {"v1": [{"address": "10.3.0.1:8000"}, {"address": "10.3.0.2:8000"}]}}
    out = compose_config(kubernetes.compose_config(base, k8s), etcd)   # as inferlb serve does
    assert {s.name: [e.address for v in s.versions for e in v.endpoints] for s in out.services} == {
        "k8s": ["10.3.0.1:8000"], "chat": ["10.3.0.2:8000"]}   # the address Kubernetes has stays its own
    # Kubernetes, too: a default version with no ready endpoint stays the default, unavailable.
    base = cfg(discovery={"kubernetes": {"services": [{"name": "k8s", "service": "vllm", "default_version": "v2"}]}})
    [svc] = kubernetes.compose_config(base, k8s).services
    assert (svc.default, svc.unavailable_versions) == ("v2", ("v2",))
