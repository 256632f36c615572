"""Operations on the admin API: write access (loopback / bearer token), drain, reload, readiness; JSON
logs; nothing secret in the logs."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.support.factories import config, metrics_source, service, version
from xds_server.admin.app import WriteAuth, is_loopback, make_admin_app
from xds_server.ads.server import AdsServicer, SnapshotCache
from xds_server.control import ControlPlane
from xds_server.metrics.stats import EndpointStats

TOKEN = "s3cret-token-0123456789"
CFG = config([service("chat", [version("v1", [{"address": "10.1.0.1:8000"}, {"address": "10.1.0.2:8000"}])])])


async def control_plane() -> ControlPlane:
    def fetch(instances):
        return {i: EndpointStats(sample_age_s=1.0) for i in instances}

    cp = ControlPlane(CFG, metrics_source(fetch), SnapshotCache(), [], lambda: "127.0.0.1:18080")
    await cp.run_round()
    return cp


async def client(cp: ControlPlane, auth: WriteAuth, reload=None) -> TestClient:
    app = make_admin_app(cp, AdsServicer(cp.cache), auth=auth, reload=reload)
    c = TestClient(TestServer(app))
    await c.start_server()
    return c


@pytest.mark.parametrize("host,loop", [("127.0.0.1", True), ("::1", True), ("localhost", True),
                                       ("0.0.0.0", False), ("10.0.0.5", False), ("admin.example", False)])
def test_loopback_detection(host, loop):
    assert is_loopback(host) is loop


async def test_loopback_without_token_may_drain_and_undrain():
    cp = await control_plane()
    c = await client(cp, WriteAuth(None, "127.0.0.1"))
    try:
        r = await c.post("/api/v1/endpoints/10.1.0.1:8000/drain")
        assert r.status == 200 and (await r.json())["draining"] is True
        w = {x.address: x for x in cp.weights}
        assert w["10.1.0.1:8000"].health == "DRAINING" and w["10.1.0.2:8000"].health == "HEALTHY"
        assert cp.cache.snapshot.version == (await r.json())["snapshot_version"]   # pushed at once
        doc = await (await c.get("/api/v1/weights")).json()
        assert {e["address"]: e["draining"] for e in doc["clusters"][0]["endpoints"]} == {
            "10.1.0.1:8000": True, "10.1.0.2:8000": False}
        r = await c.delete("/api/v1/endpoints/10.1.0.1:8000/drain")
        assert r.status == 200 and {x.health for x in cp.weights} == {"HEALTHY"}
        r = await c.post("/api/v1/endpoints/10.9.9.9:1/drain")
        assert r.status == 404 and "10.9.9.9:1" in (await r.json())["error"]["message"]
        r = await c.post("/api/v1/endpoints/10.1.0.2:08000/drain")  # another spelling of one endpoint
        assert r.status == 200 and (await r.json())["address"] == "10.1.0.2:8000"
        assert {x.address: x.health for x in cp.weights}["10.1.0.2:8000"] == "DRAINING"
        r = await c.post("/api/v1/endpoints/gpu-1:8000/drain")
        assert r.status == 400 and (await r.json())["error"]["param"] == "address"
    finally:
        await c.close()


async def test_draining_a_whole_cluster_is_warned_in_the_log_readyz_and_the_weights_and_counted(caplog):
    """Issue 39 item 5: every endpoint drained left the cluster answering 503 with no word anywhere."""
    from xds_server.control import UNSERVED, UNSERVED_TOTAL

    cp = await control_plane()
    c = await client(cp, WriteAuth(None, "127.0.0.1"))
    before = UNSERVED_TOTAL.labels("chat-v1")._value.get()
    try:
        assert (await (await c.get("/readyz")).json()) == {"ready": True, "warnings": []}
        with caplog.at_level(logging.INFO, logger="xds_server.control"):
            await c.post("/api/v1/endpoints/10.1.0.1:8000/drain")
            assert cp.unserved == {}
            await c.post("/api/v1/endpoints/10.1.0.2:8000/drain")
            await cp.run_round()   # still drained: warned and counted once
            ready = await c.get("/readyz")
            doc = await ready.json()
            assert ready.status == 200 and doc["ready"] is True
            [warning] = doc["warnings"]
            assert warning["cluster"] == "chat-v1" and warning["code"] == "no_healthy_endpoint"
            assert "every endpoint is draining" in warning["message"] and "503" in warning["message"]
            assert warning["message"].endswith("every endpoint is draining; Envoy answers its requests 503 no healthy "
                                               "upstream")
            weights = await (await c.get("/api/v1/weights")).json()
            assert weights["warnings"] == doc["warnings"] and weights["clusters"][0]["warning"] == warning["message"]
            assert UNSERVED.labels("chat-v1")._value.get() == 1
            assert UNSERVED_TOTAL.labels("chat-v1")._value.get() == before + 1
            await c.delete("/api/v1/endpoints/10.1.0.2:8000/drain")
        warned = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "cluster chat-v1 has no healthy endpoint: every endpoint is draining" in \
            warned[0].getMessage()
        assert any("chat-v1 has a healthy endpoint again" in r.getMessage() for r in caplog.records)
        assert (await (await c.get("/readyz")).json())["warnings"] == []
        assert UNSERVED.labels("chat-v1")._value.get() == 0
    finally:
        await c.close()


async def test_drain_survives_the_next_metrics_round():
    cp = await control_plane()
    assert await cp.set_draining("10.1.0.2:8000")
    await cp.run_round()
    assert {x.address: x.health for x in cp.weights}["10.1.0.2:8000"] == "DRAINING"


async def test_non_loopback_without_token_refuses_writes_but_serves_reads():
    cp = await control_plane()
    c = await client(cp, WriteAuth(None, "0.0.0.0"), reload=lambda: None)
    try:
        r = await c.post("/api/v1/endpoints/10.1.0.1:8000/drain")
        assert r.status == 403 and "admin.token" in (await r.json())["error"]["message"]
        assert (await c.post("/api/v1/reload")).status == 403
        assert (await c.get("/api/v1/weights")).status == 200
        assert {x.health for x in cp.weights} == {"HEALTHY"}
    finally:
        await c.close()


async def test_token_is_required_and_checked_and_never_logged(caplog):
    cp = await control_plane()
    reloads = []

    async def reload():
        reloads.append(1)
        return True, "config reloaded"

    c = await client(cp, WriteAuth(TOKEN, "0.0.0.0"), reload=reload)
    try:
        with caplog.at_level(logging.DEBUG):
            assert (await c.post("/api/v1/reload")).status == 401
            wrong = await c.post("/api/v1/reload", headers={"Authorization": "Bearer not-" + TOKEN})
            assert wrong.status == 401 and wrong.headers["WWW-Authenticate"] == "Bearer"
            assert reloads == []
            ok = await c.post("/api/v1/reload", headers={"Authorization": f"Bearer {TOKEN}"})
            assert ok.status == 200 and (await ok.json())["applied"] is True and reloads == [1]
            r = await c.post("/api/v1/endpoints/10.1.0.1:8000/drain", headers={"Authorization": f"bearer {TOKEN}"})
            assert r.status == 200
        assert caplog.records, "refusals are logged"
        assert not [r for r in caplog.records if TOKEN in r.getMessage()]
    finally:
        await c.close()


async def test_refused_reload_is_a_422_with_the_reason():
    cp = await control_plane()

    async def reload():
        return False, "config reload refused: services[0].versions[0].endpoints[0].gpu_class: unknown"

    c = await client(cp, WriteAuth(None, "127.0.0.1"), reload=reload)
    try:
        r = await c.post("/api/v1/reload")
        assert r.status == 422 and "gpu_class" in (await r.json())["message"]
    finally:
        await c.close()


async def test_nothing_is_published_before_the_first_metrics_round_within_the_wait():
    from xds_server.metrics.source import MetricsUnavailable

    def down(instances):
        raise MetricsUnavailable("connection refused")

    cfg = config([service("chat", [version("v1", 2)])], prometheus={"first_round_wait_s": 30})
    cp = ControlPlane(cfg, metrics_source(down), SnapshotCache(), [], lambda: "127.0.0.1:18080")
    assert await cp.run_round() is False
    assert cp.cache.snapshot is None and not cp.ready.is_set()
    cfg0 = config([service("chat", [version("v1", 2)])], prometheus={"first_round_wait_s": 0})
    cp0 = ControlPlane(cfg0, metrics_source(down), SnapshotCache(), [], lambda: "127.0.0.1:18080")
    await cp0.run_round()   # waited long enough: neutral weights go out, flagged
    assert cp0.ready.is_set() and cp0.metrics_ok is False and all(w.health == "HEALTHY" for w in cp0.weights)


def test_json_logs_are_one_object_per_line():
    code = ("import logging; from inferlb.cli import _setup_logging; _setup_logging('info', 'json');"
            "log = logging.getLogger('xds_server.test'); log.info('weight %s -> %d', 'a', 3)\n"
            "try:\n    1/0\nexcept ZeroDivisionError:\n    log.exception('round failed')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    lines = [json.loads(line) for line in out.stderr.splitlines()]
    assert lines[0]["message"] == "weight a -> 3" and lines[0]["level"] == "INFO"
    assert lines[0]["logger"] == "xds_server.test" and "time" in lines[0]
    assert lines[1]["level"] == "ERROR" and "ZeroDivisionError" in lines[1]["exc_info"]
    assert len(lines) == 2   # the traceback stays inside its JSON object


async def test_session_keys_never_reach_the_logs(caplog):
    """The picker logs decisions' kinds and counts, never header values (session keys, tokens)."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from ext_proc.handler import PickerHandler, StreamState
    from ext_proc.view import ViewHolder
    from inferlb.picker_config import routing_table

    cp = await control_plane()
    holder = ViewHolder()
    holder.update(cp.cache.snapshot.assignments(), routing_table(CFG))
    picker = PickerHandler(holder)
    key = "user-4711-private-session"
    with caplog.at_level(logging.DEBUG):
        for extra in ({}, {"model-version": "v9"}, {"model-version": "\xff" * 300}):
            headers = pb.HttpHeaders()
            for name, value in {":authority": "x", "x-session-id": key, **extra}.items():
                headers.headers.headers.add(key=name, raw_value=value.encode("utf-8", "surrogateescape"))
            picker.process(StreamState(), pb.ProcessingRequest(request_headers=headers).SerializeToString())
    assert not [r for r in caplog.records if key in r.getMessage()]


def test_a_token_that_is_not_utf8_is_refused_not_a_500():
    """aiohttp reads header bytes that are not UTF-8 as surrogate escapes; the check compares bytes."""
    from types import SimpleNamespace

    request = SimpleNamespace(headers={"Authorization": "Bearer \udcff\udcfe"}, method="POST",
                              path="/api/v1/reload", remote="10.0.0.9")
    answer = WriteAuth(TOKEN, "0.0.0.0").check(request)
    assert answer is not None and answer.status == 401


async def test_what_envoy_does_with_an_unserved_cluster_follows_its_panic_threshold():
    """Every endpoint draining (withdrawn from EDS) or removed: 503. None healthy but some unhealthy:
    Envoy's panic mode, unless the service's threshold is 0."""
    cp = await control_plane()
    mixed = "no endpoint is healthy (1 draining, 1 unhealthy)"
    assert "Envoy's panic mode (panic_threshold_percent 1) still sends" in cp._consequence("chat-v1", mixed)
    for why in ("every endpoint is draining", "every endpoint was removed (drained, or gone)"):
        assert cp._consequence("chat-v1", why) == f"{why}; Envoy answers its requests 503 no healthy upstream"
    cp.cfg = config([service("chat", [version("v1", [{"address": "10.1.0.1:8000"}])], panic_threshold_percent=0)])
    assert cp._consequence("chat-v1", mixed) == f"{mixed}; Envoy answers its requests 503 no healthy upstream"
