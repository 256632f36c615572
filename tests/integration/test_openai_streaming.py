"""The `openai` Python client through real Envoy with the picker on: streamed chunks arrive as the
backend produces them (nothing buffers the stream), the usage chunk arrives, version and session
headers route as for any request, and the picker counts a streamed request in flight until its last
byte (Envoy's access log reports it at stream end). The simulated backends' new vLLM metrics parse in
the stack's real Prometheus.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import openai
import pytest
import requests

from tests.integration.conftest import Stack, start_stack, stop_stack, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def oa_stack(tmp_path_factory) -> Iterator[Stack]:
    """v1: two A100-class backends; v2: one. Time scale 0.04 (llm engines), the picker on (the default)."""
    s = start_stack(tmp_path_factory.mktemp("openai"), [("v1", "a100"), ("v1", "a100"), ("v2", "a100")])
    yield s
    stop_stack(s)


def client(s: Stack, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{s.listener}/v1", api_key="not-needed", max_retries=0, timeout=20,
                         default_headers=headers or None)


MESSAGES = [{"role": "system", "content": "You are a terse assistant. " * 8},
            {"role": "user", "content": "Say something."}]


def test_openai_stream_arrives_chunk_by_chunk_with_usage_and_the_asked_version(oa_stack: Stack):
    s = oa_stack
    v2 = next(b for b in s.backends if b.version == "v2")
    v2.fault(slow_factor=20)  # one decode step ~13 ms (16.5 ms x 20 x time scale 0.04): 40 tokens take ~0.5 s
    try:
        arrivals: list[float] = []
        texts: list[str] = []
        usage = None
        with client(s, **{"model-version": "v2"}).chat.completions.with_streaming_response.create(
                model="sim-7b", messages=MESSAGES, max_tokens=40, stream=True,
                stream_options={"include_usage": True}) as resp:
            assert resp.headers["x-backend-version"] == "v2"
            assert resp.headers["x-served-by"] == v2.address
            for chunk in resp.parse():
                arrivals.append(time.monotonic())
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    if choice.delta.content:
                        texts.append(choice.delta.content)
        assert len(texts) == 40 and "".join(texts).startswith("Simulated reply from")
        assert usage is not None and usage.completion_tokens == 40 and usage.prompt_tokens > 50
        assert usage.total_tokens == usage.prompt_tokens + 40
        # Unbuffered: the content arrived over the ~0.5 s of decoding, not in one piece at the end.
        assert arrivals[-1] - arrivals[0] > 0.3, arrivals[-1] - arrivals[0]
        halfway = arrivals[0] + (arrivals[-1] - arrivals[0]) / 2
        assert sum(t < halfway for t in arrivals) >= 10
    finally:
        v2.fault(reset=True)


def test_openai_non_streaming_has_usage_and_routes_by_version_and_session(oa_stack: Stack):
    s = oa_stack
    v1 = {b.address for b in s.backends if b.version == "v1"}
    raw = client(s).chat.completions.with_raw_response.create(model="sim-7b", messages=MESSAGES, max_tokens=8)
    done = raw.parse()
    assert raw.headers["x-backend-version"] == "v1" and raw.headers["x-served-by"] in v1  # default version
    assert done.object == "chat.completion" and done.usage.completion_tokens == 8
    assert done.choices[0].message.content and done.choices[0].finish_reason == "length"
    completion = client(s).completions.create(model="sim-7b", prompt="Once upon a time", max_tokens=3)
    assert completion.usage.completion_tokens == 3 and completion.choices[0].text
    # A session sticks to one node, streamed or not; the prefix cache there serves its resent history.
    sticky = client(s, **{"x-session-id": "openai-conv-1"})
    served, cached = set(), []
    for turn in range(4):
        with sticky.chat.completions.with_streaming_response.create(
                model="sim-7b", messages=MESSAGES + [{"role": "user", "content": f"turn {turn}"}], max_tokens=4,
                stream=turn % 2 == 0, **({"stream_options": {"include_usage": True}} if turn % 2 == 0 else {})) as r:
            served.add(r.headers["x-served-by"])
            if turn % 2 == 0:
                chunks = list(r.parse())
                assert chunks[-1].usage is not None
                cached.append(chunks[-1].usage.prompt_tokens_details.cached_tokens)
            else:
                cached.append(r.parse().usage.prompt_tokens_details.cached_tokens)
    assert len(served) == 1 and served <= v1
    assert cached[0] == 0 and all(c > 50 for c in cached[1:]), cached


def test_a_streamed_request_is_in_flight_until_its_last_byte(oa_stack: Stack):
    s = oa_stack
    inflight = s.app.picker.control.inflight
    s.send({"x-session-id": "warm-up"})
    wait_until(lambda: inflight.streams >= 1 and not inflight.clusters, 5, 0.02,
               "Envoy's access-log stream and the first completion")
    for b in s.backends:
        b.fault(slow_factor=20)
    try:
        first_chunk = threading.Event()
        finished: list[float] = []

        def stream() -> None:
            with client(s, **{"x-session-id": "long-stream"}).chat.completions.create(
                    model="sim-7b", messages=MESSAGES, max_tokens=60, stream=True) as chunks:
                for _ in chunks:
                    first_chunk.set()
            finished.append(time.monotonic())

        t = threading.Thread(target=stream)
        t.start()
        assert first_chunk.wait(10)
        started = time.monotonic()
        # ~0.8 s of decoding follow the first chunk; it stays counted all along (the access-log
        # flush is 5 ms, so a record sent at the response headers would have cleared it by now).
        samples = []
        while not finished and time.monotonic() - started < 0.5:
            samples.append(sum(inflight.clusters.values()))
            time.sleep(0.02)
        assert samples and all(n == 1 for n in samples), samples
        assert inflight.clusters == {"chat-v1": 1} and sum(inflight.endpoints.values()) == 1
        t.join(20)
        assert finished
        wait_until(lambda: not inflight.clusters and not inflight.endpoints, 2, 0.005,
                   "the completion at stream end")
    finally:
        for b in s.backends:
            b.fault(reset=True)


def test_new_vllm_metrics_parse_in_real_prometheus(oa_stack: Stack):
    s = oa_stack
    for _ in range(3):
        client(s).chat.completions.create(model="sim-7b", messages=MESSAGES, max_tokens=4)
    names = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
             "vllm:time_per_output_token_seconds_bucket", "vllm:inter_token_latency_seconds_count",
             "vllm:request_prompt_tokens_sum", "vllm:request_generation_tokens_bucket",
             "vllm:time_to_first_token_seconds_count", "vllm:kv_cache_usage_perc")

    def query(q: str) -> list[dict]:
        r = requests.get(f"{s.cfg.prometheus.url}/api/v1/query", params={"query": q}, timeout=5).json()
        assert r["status"] == "success", r
        return r["data"]["result"]

    every = {b.address for b in s.backends}
    for name in names:
        series = wait_until(lambda n=name: (r := query(n)) and {x["metric"]["instance"] for x in r} == every and r,
                            10, 0.2, f"{name} of every backend in Prometheus")
        for x in series:
            assert x["metric"]["model_name"] == "sim-7b" and x["metric"]["engine"] == "0", x
    hits = wait_until(lambda: query("sum(vllm:prefix_cache_hits_total) > 0"), 10, 0.2, "prefix-cache hits scraped")
    queries = query("sum(vllm:prefix_cache_queries_total)")
    assert 0 < float(hits[0]["value"][1]) <= float(queries[0]["value"][1])
