"""A plain OpenAI client through real Envoy and the picker with the default config: no inferlb
headers at all, only the OpenAI body. Body reading is on by default, so the body's ``model`` picks
the version (an unknown one: 404 naming the served names) and the prompt's first messages give the
prefix key; ``GET /v1/models`` lists what is served.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import requests

from tests.integration.conftest import Stack, start_stack, stop_stack, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def oa_stack(tmp_path_factory) -> Iterator[Stack]:
    """v1: three llm backends, v2: one per-request server (``--engine job``: a 1 MB prompt, 250 000
    tokens, is past Llama-3.1-8B's 131 072-token context, which an llm engine refuses as vLLM does);
    the service names its served models ``sim-7b`` and ``org/sim 7b`` (a Hugging Face style name, with a
    space too: the client sends it percent-encoded); the picker's config at its defaults but for
    prefix_messages 1 (the key is the system prompt alone) and a small KV cost per token (a 1 MB
    prompt fits a simulated GPU), the job backend's alike."""
    s = start_stack(tmp_path_factory.mktemp("openai-clients"),
                    [("v1", "a100"), ("v1", "a100"), ("v1", "a100"), ("v2", "a100")],
                    backend_args={3: ["--engine", "job", "--kv-mib-per-token", "0.001"]},
                    config={"services": [{"models": ["sim-7b", "org/sim 7b"]}],
                            "picker": {"prefix_messages": 1, "kv_mib_per_token": 0.001}})
    s.app.sampler.every = 1   # keep every decision for the test to read
    yield s
    stop_stack(s)


def client(s: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{s.listener}/v1", api_key="none", max_retries=0, timeout=30)


SYSTEM = {"role": "system", "content": "You are the support assistant of a shop that sells bicycles. " * 20}


def test_models_lists_every_served_name(oa_stack: Stack):
    models = client(oa_stack).models.list()
    assert sorted((m.id, m.owned_by) for m in models) == [("org/sim 7b", "chat"), ("sim-7b", "chat"), ("v1", "chat"),
                                                         ("v2", "chat")]


def test_head_reads_the_models_like_get_and_any_other_method_is_a_405_from_envoy(oa_stack: Stack):
    """A backend knows only its own model name: no method under /v1/models reaches one."""
    base = f"{oa_stack.listener}/v1/models"
    got = requests.get(base, timeout=10)
    head = requests.head(base, timeout=10)
    assert (head.status_code, head.content, head.headers["content-type"]) == (200, b"", "application/json")
    assert head.headers["content-length"] == got.headers["content-length"]   # GET's answer, without its body
    for method, url in (("POST", base), ("DELETE", f"{base}/v1"), ("PUT", f"{base}/anything")):
        r = requests.request(method, url, json={}, timeout=10)
        assert (r.status_code, r.headers["allow"], r.json()["error"]["code"]) == (405, "GET, HEAD",
                                                                                  "method_not_allowed"), method
        assert "x-served-by" not in r.headers


def test_each_listed_model_is_retrieved_and_another_is_a_404(oa_stack: Stack):
    """OpenAI's retrieve, answered by Envoy for every name the list shows (a backend knows only its own)."""
    c = client(oa_stack)
    for name in ("sim-7b", "org/sim 7b", "v1", "v2"):
        model = c.models.retrieve(name)
        assert (model.id, model.owned_by) == (name, "chat")
    with pytest.raises(openai.NotFoundError) as caught:
        c.models.retrieve("v9")
    assert caught.value.code == "model_not_found" and caught.value.message.endswith("v1, v2")
    assert "org/sim 7b" in caught.value.message


def test_a_shared_system_prompt_without_inferlb_headers_is_routed_by_its_prefix_key(oa_stack: Stack):
    s = oa_stack
    before = len(s.app.sampler.recent())
    served = []
    for i in range(6):
        raw = client(s).chat.completions.with_raw_response.create(
            model="sim-7b", max_tokens=4, messages=[SYSTEM, {"role": "user", "content": f"Question {i}?"}])
        assert raw.parse().usage.completion_tokens == 4
        assert raw.headers["x-backend-version"] == "v1"
        served.append(raw.headers["x-served-by"])
    decisions = s.app.sampler.recent(len(s.app.sampler.recent()) - before)
    assert [d.key for d in decisions] == ["prefix"] * 6 and {d.cluster for d in decisions} == {"chat-v1"}
    assert len(set(served)) == 1 and {d.endpoint for d in decisions} == set(served)
    # The body's model may name a version, as the header does.
    raw = client(s).chat.completions.with_raw_response.create(
        model="v2", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert raw.headers["x-backend-version"] == "v2"
    wait_until(lambda: not any(s.app.picker.control.inflight.clusters.values()), 10, what="every completion counted")


def test_an_unknown_model_is_a_404_naming_the_served_models(oa_stack: Stack):
    with pytest.raises(openai.NotFoundError) as info:
        client(oa_stack).chat.completions.create(model="Qwen/Qwen3-0.6B", max_tokens=2,
                                                 messages=[{"role": "user", "content": "hi"}])
    err = info.value
    assert err.status_code == 404 and err.code == "model_not_found" and err.param == "model"
    assert err.type == "invalid_request_error"
    assert "'Qwen/Qwen3-0.6B'" in err.message and err.message.endswith("served models: org/sim 7b, sim-7b, v1, v2")


def test_a_body_near_the_default_limit_is_still_read(oa_stack: Stack):
    """1 MB of prompt (under the default 1 MiB body_max_bytes, Envoy's buffer limit): read, routed
    by its model and its prefix, served whole."""
    s = oa_stack
    before = len(s.app.sampler.recent())
    big = "x" * 1_000_000
    raw = client(s).completions.with_raw_response.create(model="v2", max_tokens=2, prompt=big)
    assert raw.parse().usage.prompt_tokens >= 1_000_000 // 4 and raw.headers["x-backend-version"] == "v2"
    [decision] = s.app.sampler.recent(len(s.app.sampler.recent()) - before)
    assert decision.key == "prefix" and decision.cluster == "chat-v2"
