"""The admin API over real aiohttp: history filters, since/until/step parsing, 400s, decisions, the
OpenAPI document (validated) and every JSON answer checked against its schema in that document."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime

import pytest
from aiohttp.test_utils import TestClient, TestServer
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from ext_proc.costmodel import CostModel
from ext_proc.sampler import DecisionSampler
from tests.support.factories import config, service, version
from tests.support.history_rows import admin_app, pin_history_clock, row, verdict
from tests.unit.ext_proc.test_decision_sampler import Picker, holder, http_headers
from xds_server.admin.app import openapi_document
from xds_server.engine.types import DRAINING

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.1.1:8000"
CONFIGURED = "10.7.0.1:8000"
NOW = time.time()
ROWS = [row(NOW - 7200, A, 10), row(NOW - 1200, A, 20), row(NOW - 500, B, 30), row(NOW - 300, A, 25),
        row(NOW - 200, B, 30, DRAINING), row(NOW - 100, C, 40, cluster="chat-v2")]
SPEC = openapi_document()
REGISTRY = Registry().with_resource("urn:inferlb-admin", Resource(SPEC, DRAFT202012))


@pytest.fixture(autouse=True)
def _history_clock(monkeypatch):
    pin_history_clock(monkeypatch, NOW)


def conforms(instance: dict, schema_name: str) -> None:
    Draft202012Validator({"$ref": f"urn:inferlb-admin#/components/schemas/{schema_name}"},
                         registry=REGISTRY).validate(instance)


@pytest.fixture
async def client():
    sampler = DecisionSampler(every=1)
    servicer = Picker(holder(), sampler=sampler)
    servicer.decide(http_headers(x_session_id="s-1", model_version="v1"))
    servicer.decide(http_headers())
    costs = CostModel(min_samples=3)
    for p in range(10):
        costs.observe("a100", 100.0 * p, 64.0, 50.0 + 0.1 * p * 100, 20.0)
    costs.refit()
    app, store = admin_app(ROWS, [verdict(A, 25), verdict(B, 30, DRAINING), verdict(C, 40, cluster="chat-v2")],
                           sampler, cost_model=costs,
                           cfg=config([service("llm", [version("v1", [{"address": CONFIGURED}])])]))
    async with TestClient(TestServer(app)) as c:
        c.store = store
        yield c
    store.close()


async def get(client, path: str, status: int = 200):
    r = await client.get(path)
    assert r.status == status, await r.text()
    return await r.json()


def test_openapi_document_is_valid_openapi_31():
    assert SPEC["openapi"].startswith("3.1")
    validate(SPEC)


async def test_openapi_is_served_and_lists_every_route(client):
    served = await get(client, "/openapi.json")
    assert served == SPEC
    routes = {r.resource.canonical for r in client.server.app.router.routes()
              if r.method == "GET" and not r.resource.canonical.startswith("/static")}
    assert routes == set(SPEC["paths"])


async def test_history_filters_by_cluster_and_endpoint(client):
    doc = await get(client, "/api/v1/history?since=3h")
    conforms(doc, "HistoryDocument")
    assert [(s["cluster"], s["endpoint"]) for s in doc["series"]] == [("chat-v1", A), ("chat-v1", B), ("chat-v2", C)]
    assert [p["weight"] for p in doc["series"][0]["points"]] == [10, 20, 25]
    doc = await get(client, "/api/v1/history?since=3h&cluster=chat-v1&endpoint=" + B)
    assert [(p["weight"], p["health"]) for p in doc["series"][0]["points"]] == [(30, "HEALTHY"), (30, "DRAINING")]
    assert len(doc["series"]) == 1
    assert (await get(client, f"/api/v1/history?since=3h&cluster=chat-v2&endpoint={A}", 404))["error"]["param"] \
        == "endpoint"


@pytest.mark.parametrize("query,param,message", [
    ("cluster=nope", "cluster", "cluster: no cluster 'nope' in the config or in the history"),
    ("endpoint=10.9.9.9:1", "endpoint", "endpoint: no endpoint '10.9.9.9:1' in the config or in the history"),
    (f"cluster=llm-v1&endpoint={A}", "endpoint",
     f"endpoint: no endpoint '{A}' in cluster 'llm-v1' in the config or in the history"),
    ("cluster=nope&endpoint=10.9.9.9:1", "cluster", "cluster: no cluster 'nope' in the config or in the history"),
])
async def test_a_cluster_or_endpoint_known_to_neither_config_nor_history_is_a_404(client, query, param, message):
    doc = await get(client, f"/api/v1/history?{query}", 404)
    conforms(doc, "Error")
    assert doc == {"error": {"message": message, "type": "invalid_request_error", "param": param,
                             "code": "unknown_target"}}


async def test_a_cluster_in_only_the_config_or_only_the_history_is_a_200(client):
    """The config has llm-v1 and CONFIGURED, with no rows yet; the history has chat-v1 and chat-v2,
    not in the config (removed from it, as far as the API can tell)."""
    assert (await get(client, "/api/v1/history?cluster=llm-v1"))["series"] == []
    assert (await get(client, f"/api/v1/history?cluster=llm-v1&endpoint={CONFIGURED}"))["series"] == []
    assert (await get(client, f"/api/v1/history?endpoint={CONFIGURED}"))["series"] == []
    # older than since..until: known to the history, so an empty answer, not a 404
    doc = await get(client, "/api/v1/history?cluster=chat-v2&since=3h&until=2h")
    assert doc["series"] == []
    assert len((await get(client, "/api/v1/history?cluster=chat-v2&since=3h"))["series"]) == 1


async def test_since_as_duration_carries_the_value_in_force(client):
    doc = await get(client, "/api/v1/history?since=10m&cluster=chat-v1")
    assert abs(doc["since"] - (NOW - 600)) < 5 and abs(doc["until"] - NOW) < 5   # the API's clock starts at NOW
    a = doc["series"][0]["points"]
    assert [(p["weight"], p["kind"]) for p in a] == [(20, "carried"), (25, "change")]
    assert a[0]["t"] == doc["since"]


async def test_since_and_until_as_rfc3339(client):
    def rfc(t: float) -> str:
        return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")

    doc = await get(client, f"/api/v1/history?since={rfc(NOW - 600)}&until={rfc(NOW - 250)}&endpoint={A}")
    assert doc["since"] == pytest.approx(NOW - 600, abs=1e-3) and doc["until"] == pytest.approx(NOW - 250, abs=1e-3)
    assert [p["weight"] for p in doc["series"][0]["points"]] == [20, 25]


async def test_step_resamples(client):
    doc = await get(client, f"/api/v1/history?since=20m&step=5m&endpoint={A}")
    assert doc["step"] == 300
    assert [p["weight"] for p in doc["series"][0]["points"]] == [20, 20, 20, 25, 25]


@pytest.mark.parametrize("query,param", [("since=soon", "since"), ("until=2026-01-01", "until"),
                                         ("since=5m&until=10m", "since"), ("step=0s", "step"),
                                         ("limit=-1", "limit"), ("clust=chat-v1", "clust")])
async def test_bad_parameters_are_400s_naming_the_parameter(client, query, param):
    doc = await get(client, f"/api/v1/history?{query}", 400)
    conforms(doc, "Error")
    assert doc["error"]["param"] == param and doc["error"]["message"].startswith(f"{param}: ")
    assert doc["error"]["code"] == "bad_parameter"


NINES = "9" * 310


@pytest.mark.parametrize("query,param", [
    (f"since={NINES}s", "since"), (f"until={NINES}s", "until"), (f"step={NINES}s", "step"),  # issue 15 item 6
    ("since=101y", "since"), ("step=0s", "step"), ("step=00s", "step"),
    ("since=0000-01-01T00:00:00Z", "since"), ("limit=%C2%B2", "limit"), (f"limit={'9' * 5000}", "limit"),
    ("since=%D9%A1h", "since"), ("step=", "step"), ("since=1h&since=2h", "since"), ("cluster=", "cluster"),
])
async def test_every_bad_parameter_is_a_400_never_a_500(client, query, param):
    doc = await get(client, f"/api/v1/history?{query}", 400)
    conforms(doc, "Error")
    error = doc["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: ") and len(error["message"]) < 400


@pytest.mark.parametrize("path", sorted(SPEC["paths"]))
async def test_every_route_refuses_an_unknown_or_repeated_parameter_as_history_does(client, path):
    """One rule for every route, from the OpenAPI document: only the parameters it declares, once."""
    declared = [p["name"] for p in SPEC["paths"][path]["get"].get("parameters", ())]
    doc = await get(client, f"{path}?foo=1", 400)
    conforms(doc, "Error")
    known = f"known: {', '.join(declared)}" if declared else "this endpoint takes none"
    assert doc == {"error": {"message": f"foo: unknown parameter; {known}", "type": "invalid_request_error",
                             "param": "foo", "code": "bad_parameter"}}
    for name in declared:
        value = {"since": "2h", "until": "1h", "step": "10m"}.get(name, "1")
        doc = await get(client, f"{path}?{name}={value}&{name}={value}", 400)
        assert doc["error"]["message"] == f"{name}: given more than once" and doc["error"]["param"] == name
    assert "400" in SPEC["paths"][path]["get"]["responses"]


async def test_routes_outside_the_document_take_no_parameters(client):
    for method, path in (("GET", "/static/app.js"), ("POST", f"/api/v1/endpoints/{A}/drain")):
        r = await client.request(method, f"{path}?v=2")
        assert r.status == 400 and (await r.json())["error"]["param"] == "v"
    assert (await client.head("/api/v1/weights?x=1")).status == 400
    assert (await client.get("/nowhere?x=1")).status == 404


@pytest.mark.parametrize("limit", ["%C2%B2", "9" * 5000, "0", "-1", "x"])
async def test_a_bad_decisions_limit_is_a_400(client, limit):
    doc = await get(client, f"/api/v1/decisions?limit={limit}", 400)
    conforms(doc, "Error")
    assert doc["error"]["param"] == "limit"


async def test_decisions_sample(client):
    doc = await get(client, "/api/v1/decisions")
    conforms(doc, "DecisionsDocument")
    assert doc["every"] == 1
    latest, first = doc["decisions"]
    assert (first["version"], first["cluster"], first["reason"], first["key"]) == ("v1", "llm-v1", "affinity",
                                                                                  "session")
    assert first["endpoint"].startswith("10.0.0.") and first["session"] and "s-1" not in first["session"]
    assert (latest["session"], latest["reason"], latest["key"]) == (None, "least-loaded", "none")
    assert latest["endpoint"].startswith("10.0.0.")  # requests without a session are pinned too
    assert first["work"] == 1.0 and first["memory_mib"] > 0
    assert len((await get(client, "/api/v1/decisions?limit=1"))["decisions"]) == 1
    assert (await get(client, "/api/v1/decisions?limit=x", 400))["error"]["param"] == "limit"


async def test_cost_model_is_shown_per_gpu_class(client):
    doc = await get(client, "/api/v1/cost-model")
    conforms(doc, "CostModelDocument")
    a100 = doc["classes"]["a100"]
    assert a100["ready"] and a100["samples"] == 10
    assert abs(a100["duration_ms"]["per_1k_prompt_tokens"] - 100.0) < 1.0  # 0.1 ms per prompt token


async def test_weights_nodes_readyz_conform(client):
    conforms(await get(client, "/api/v1/weights"), "WeightsDocument")
    conforms(await get(client, "/api/v1/nodes"), "NodesDocument")
    assert (await get(client, "/readyz", 503)) == {"ready": False, "warnings": []}


async def test_page_and_its_chart_library_are_served_locally(client):
    r = await client.get("/")
    html = await r.text()
    assert r.status == 200 and r.content_type == "text/html"
    assert (await client.get("/?since=30m&cluster=chat-v2")).status == 200  # the page's own parameters (app.js)
    assert "http://" not in html and "https://" not in html  # nothing from elsewhere at run time
    for path in ("/static/vendor/uplot/uPlot.iife.min.js", "/static/vendor/uplot/uPlot.min.css", "/static/app.js"):
        assert f'"{path}"' in html
        r = await client.get(path)
        assert r.status == 200 and len(await r.read()) > 1000, path
    js = await (await client.get("/static/app.js")).text()
    assert "https://" not in js and "http://" not in js


async def test_a_failing_store_is_a_503(client):
    client.store.close()
    doc = await get(client, "/api/v1/history", 503)
    conforms(doc, "Error")
    assert "closed" in doc["error"]["message"] and doc["error"]["param"] is None
    assert (doc["error"]["code"], doc["error"]["type"]) == ("history_unavailable", "server_error")


@pytest.mark.parametrize("request_bytes", [
    b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",          # an over-long request line
    b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n",  # an over-long header
    b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",           # a malformed request
], ids=["long-request-line", "long-header", "malformed"])
async def test_a_request_aiohttp_refuses_is_a_400_and_one_short_debug_line(client, caplog, request_bytes):
    """Anyone who reaches the port can send these: no traceback, nothing above debug, at most one line."""
    caplog.set_level(logging.DEBUG)
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    writer.write(request_bytes)
    await writer.drain()
    status = await reader.readline()
    writer.close()
    assert status.split()[1:2] == [b"400"], status
    await asyncio.sleep(0.05)
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert len(records) <= 1 and all(r.levelno == logging.DEBUG and not r.exc_info for r in records), [
        (r.levelname, r.getMessage()[:200], bool(r.exc_info)) for r in records]
    assert all(len(r.getMessage()) < 300 for r in records)


class _BrokenCostModel:
    def describe(self) -> dict:
        raise ZeroDivisionError("a bug")


async def test_a_handler_bug_is_still_logged_with_its_traceback(caplog):
    app, store = admin_app([], [], cost_model=_BrokenCostModel())
    async with TestClient(TestServer(app)) as c:
        assert (await c.get("/api/v1/cost-model")).status == 500
    store.close()
    errors = [r for r in caplog.records if r.name == "aiohttp.server" and r.levelno == logging.ERROR]
    assert errors and errors[0].exc_info[0] is ZeroDivisionError


async def test_a_path_or_method_no_route_takes_is_an_error_object_too(client):
    """aiohttp's own 404 and 405 are plain text; the admin API answers them as every other error."""
    doc = await get(client, "/api/v1/nope", 404)
    conforms(doc, "Error")
    assert doc["error"]["code"] == "not_found" and "/openapi.json" in doc["error"]["message"]
    r = await client.delete("/api/v1/weights")
    assert r.status == 405 and r.headers["Allow"] == "GET, HEAD"
    doc = await r.json()
    conforms(doc, "Error")
    assert doc["error"]["code"] == "method_not_allowed" and "DELETE" in doc["error"]["message"]
