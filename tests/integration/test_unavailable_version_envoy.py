"""A version with no endpoints now, answered by real Envoy without the picker (``envoy.picker: false``).

chat's default is v1, listed in ``unavailable_versions`` (what etcd discovery sets when every v1 node
has left); v2 has a backend. With no ext_proc filter in Envoy's listener, Envoy's own route must give
requests naming v1, or no version, the 503 whose body names v1 (the same error object the picker sends), and
never v2's model; requests naming v2 are served by v2 (docs/operations.md, etcd "Leave"); requests naming a
version the route does not know get a 400, never the default version's model.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests

from tests.integration.conftest import Stack, start_stack, stop_stack

pytestmark = pytest.mark.integration

GONE = {"error": {"message": "model version 'v1' of service 'chat' has no endpoints now", "type": "server_error",
                  "param": None, "code": "version_unavailable"}}


@pytest.fixture(scope="module")
def stack_without_picker(tmp_path_factory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("unavailable"), [("v2", "a100")],
                    config={"envoy": {"picker": False}, "services": [{"unavailable_versions": ["v1"]}]})
    yield s
    stop_stack(s)


def ask(s: Stack, **headers: str) -> requests.Response:
    return requests.post(f"{s.listener}/v1/chat/completions", timeout=10, headers=headers,
                         json={"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})


def test_envoys_route_answers_the_unavailable_default_with_the_503_that_names_it(stack_without_picker: Stack):
    s = stack_without_picker
    listeners = requests.get(f"{s.envoy_admin}/config_dump?resource=dynamic_listeners", timeout=5).text
    assert "ext_proc" not in listeners   # Envoy answers alone: no picker in the filter chain
    named = {"error": {**GONE["error"], "param": "model-version"}}   # the request named the version
    for r, body in [(ask(s), GONE) for _ in range(5)] + [(ask(s, **{"model-version": "v1"}), named) for _ in range(5)]:
        assert (r.status_code, r.headers.get("content-type"), r.json()) == (503, "application/json", body)
        assert "x-served-by" not in r.headers and "x-backend-version" not in r.headers   # never v2's model
    served = {ask(s, **{"model-version": "v2"}).headers.get("x-served-by") for _ in range(5)}
    assert served == {s.backends[0].address}


def test_envoys_route_answers_a_version_it_does_not_know_with_a_400_not_the_default(stack_without_picker: Stack):
    for _ in range(3):
        r = ask(stack_without_picker, **{"model-version": "v9"})
        assert (r.status_code, r.headers.get("content-type"), "x-served-by" in r.headers) == (
            400, "application/json", False)
        assert r.json() == {"error": {"message": "unknown model version in header 'model-version'; known versions: v2",
                                      "type": "invalid_request_error", "param": "model-version",
                                      "code": "unknown_version"}}
