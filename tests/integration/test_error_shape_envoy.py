"""One error shape for clients (issue 39 item 6): every error the picker, the control plane's routes or
Envoy itself answers is OpenAI's error object, so the ``openai`` client (3.x) raises the class its
status calls for with the message and a stable ``code``: the picker's 400 (unknown version) and 503
(no endpoint has the memory), Envoy's 431 (a 64 KiB header: Envoy's limit is 60 KiB) and Envoy's 503
``no healthy upstream`` (every endpoint of the version drained; /readyz warns of it meanwhile).
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import requests

from ext_proc.transport.base import GRPC_INTERNAL, StreamError
from tests.integration.conftest import Stack, start_stack, stop_stack, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def s(tmp_path_factory) -> Iterator[Stack]:
    # v2 runs the seed's per-request `job` engine (gpu_memory: per_request), where a request's declared
    # GPU memory is admitted against free memory; v1's llm engine holds a preallocated KV-cache pool.
    stack = start_stack(tmp_path_factory.mktemp("errors"), [("v1", "a100"), ("v2", "a100")],
                        backend_args={1: ["--engine", "job"]},
                        config={"picker": {"request_memory_header": "x-sim-memory-mib"},
                                # a host list, so that a request for another host has no route
                                "services": [{"hosts": ["127.0.0.1"]}]})
    yield stack
    stop_stack(stack)


def client(s: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{s.listener}/v1", api_key="unused", max_retries=0, timeout=10)


def ask(s: Stack, error: type[openai.APIStatusError], **headers: str) -> openai.APIStatusError:
    with pytest.raises(error) as raised:
        client(s).chat.completions.create(model="v1", max_tokens=4, extra_headers=headers,
                                          messages=[{"role": "user", "content": "hi"}])
    e = raised.value
    assert e.response.headers["content-type"].startswith("application/json")
    assert set(e.body) == {"message", "type", "param", "code"}, e.body
    return e


def test_the_pickers_errors(s: Stack):
    e = ask(s, openai.BadRequestError, **{"model-version": "v9"})
    assert (e.status_code, e.code, e.type, e.param) == (400, "unknown_version", "invalid_request_error",
                                                        "model-version")
    assert e.body["message"] == "unknown model version 'v9' in header 'model-version'; known versions: v1, v2"
    e = ask(s, openai.InternalServerError, **{"x-sim-memory-mib": "900000", "model-version": "v2"})
    assert (e.status_code, e.code, e.type) == (503, "too_large", "server_error")
    assert "no endpoint with 900000 MiB of GPU memory" in e.body["message"]


def test_a_host_no_service_serves_gets_404_naming_it_from_the_picker_or_from_envoy(s: Stack):
    # The picker answers a host no service lists (unknown_service). When the picker fails open
    # (failure_mode_allow), Envoy's route table answers: its 404 has no text of its own, and the
    # mapper's message names the host.
    def post() -> requests.Response:
        return requests.post(f"{s.listener}/v1/chat/completions", headers={"host": "nowhere.example"}, timeout=10,
                             json={"model": "v1", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})

    r = post()
    assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["param"]) == (404, "unknown_service",
                                                                                      ":authority")
    handler = s.app.picker

    def failing(stream, data):
        raise StreamError(GRPC_INTERNAL, "picker broken (test)")

    handler.process = failing
    try:
        r = post()
    finally:
        vars(handler).pop("process", None)
    assert r.status_code == 404 and r.headers["content-type"].startswith("application/json")
    assert r.json() == {"error": {"code": "no_route", "type": "invalid_request_error", "param": None,
                                  "message": "no route for host 'nowhere.example': it matches none of the "
                                             "services' hosts"}}


def test_envoys_431_for_a_header_too_large(s: Stack):
    e = ask(s, openai.APIStatusError, **{"x-filler": "a" * (64 << 10)})
    assert (e.status_code, e.code, e.type, e.param) == (431, "request_headers_too_large", "invalid_request_error",
                                                        None)
    assert e.body["message"]   # Envoy's own text


def test_envoys_503_when_every_endpoint_of_the_version_is_drained(s: Stack):
    [v2] = [b for b in s.backends if b.version == "v2"]
    assert requests.post(f"{s.admin}/api/v1/endpoints/{v2.address}/drain", timeout=5).status_code == 200
    try:
        ready = requests.get(f"{s.admin}/readyz", timeout=5).json()
        assert [w["cluster"] for w in ready["warnings"]] == ["chat-v2"]
        wait_until(lambda: requests.post(f"{s.listener}/v1/chat/completions", timeout=5, json={},
                                         headers={"model-version": "v2"}).status_code == 503, 10, 0.1,
                   "Envoy to have no healthy v2 endpoint")
        e = ask(s, openai.InternalServerError, **{"model-version": "v2"})
        assert (e.status_code, e.code, e.type, e.param) == (503, "no_healthy_upstream", "server_error", None)
        assert e.body["message"] == "no healthy upstream"
    finally:
        requests.delete(f"{s.admin}/api/v1/endpoints/{v2.address}/drain", timeout=5)
    assert requests.get(f"{s.admin}/readyz", timeout=5).json()["warnings"] == []


def test_a_drained_versions_new_requests_get_503_at_once_while_its_requests_in_flight_finish(s: Stack):
    """Every endpoint of v2 drained while a long streamed answer runs there: new v2 requests get Envoy's
    503 within a second (the assignment withdraws the endpoints; listed as DRAINING, Envoy's panic mode
    at the default panic_threshold_percent 1 kept sending them new requests until the endpoint was
    idle), and the answer in flight runs to its end."""
    [v2] = [b for b in s.backends if b.version == "v2"]
    wait_until(lambda: requests.post(f"{s.listener}/v1/chat/completions", timeout=5,
                                     json={"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]},
                                     headers={"model-version": "v2"}).status_code == 200, 15, 0.1,
               "v2 to serve (undrained by the test before)")
    stream = client(s).chat.completions.create(model="v2", max_tokens=400, stream=True,
                                               extra_headers={"model-version": "v2"},
                                               messages=[{"role": "user", "content": "tell a long story"}])
    chunks = iter(stream)
    first = next(chunks)
    assert first.choices is not None
    assert requests.post(f"{s.admin}/api/v1/endpoints/{v2.address}/drain", timeout=5).status_code == 200
    try:
        wait_until(lambda: requests.post(f"{s.listener}/v1/chat/completions", timeout=5, json={},
                                         headers={"model-version": "v2"}).status_code == 503, 2.0, 0.05,
                   "Envoy to refuse new v2 requests")
        rest = list(chunks)
        assert rest and rest[-1].choices[0].finish_reason == "length", rest[-1:]
        ready = requests.get(f"{s.admin}/readyz", timeout=5).json()
        [warning] = ready["warnings"]
        assert warning["message"].endswith("every endpoint is draining; Envoy answers its requests 503 no healthy "
                                           "upstream")
    finally:
        requests.delete(f"{s.admin}/api/v1/endpoints/{v2.address}/drain", timeout=5)
