"""The HTTP backend over real sockets: endpoints, headers, metrics, faults, disconnects."""

import asyncio
import json
import time

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sim.config import BackendConfig
from sim.engines.hardware import GPU_CLASSES, MODELS, step_coefficients
from sim.metrics import LATENCY_BUCKETS_S
from sim.server import start_backend

CHAT = {"messages": [{"role": "user", "content": "Hello, GPU"}], "max_tokens": 16}
A100 = step_coefficients(MODELS["llama-3.1-8b"], GPU_CLASSES["a100"])


def a100_s(prompt_tokens: int, output_tokens: int) -> float:
    """A lone request's time on an A100 llm engine, s: one prefill step, then one decode step a token."""
    return A100.step_s(prompt_tokens, 0) + (output_tokens - 1) * A100.step_s(0, 1)


@pytest.fixture
async def backends():
    """Factory: ``await backends(**cfg)`` -> base URL; everything is stopped afterwards."""
    runners = []

    async def start(**kwargs):
        kwargs.setdefault("time_scale", 0.1)
        cfg = BackendConfig(host="127.0.0.1", port=0, seed=1, **kwargs)
        runner, port = await start_backend(cfg)
        runners.append(runner)
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def _state(http, base):
    async with http.get(f"{base}/sim/state") as resp:
        return await resp.json()


async def _fault(http, base, **patch):
    async with http.post(f"{base}/sim/fault", json=patch) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def _poll_state(http, base, cond, timeout=2.0):
    async with asyncio.timeout(timeout):
        while not cond(state := await _state(http, base)):
            await asyncio.sleep(0.01)
    return state


async def test_chat_and_completion_responses_are_openai_shaped(backends, http):
    base = await backends(version="v7", model_name="sim-13b")
    port = base.rsplit(":", 1)[1]
    async with http.post(f"{base}/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200
        assert resp.headers["x-served-by"] == f"127.0.0.1:{port}"
        assert resp.headers["x-backend-version"] == "v7"
        body = await resp.json()
    assert body["object"] == "chat.completion" and body["model"] == "sim-13b"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] == 16
    async with http.post(f"{base}/v1/completions", json={"prompt": "abc"}) as resp:
        body = await resp.json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"]
    assert 1 <= body["usage"]["completion_tokens"] <= 128  # no max_tokens: a seeded length
    assert body["choices"][0]["finish_reason"] == "stop"


async def test_models_list_and_retrieve_with_the_openai_client(backends):
    base = await backends(model_name="sim-13b")
    before = int(time.time())
    async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="not-needed", max_retries=0, timeout=5) as client:
        models = [m async for m in client.models.list()]
        assert [(m.id, m.object, m.owned_by) for m in models] == [("sim-13b", "model", "inferlb-sim")]
        assert before - 5 <= models[0].created <= time.time()
        assert (await client.models.retrieve("sim-13b")).id == "sim-13b"
        with pytest.raises(openai.NotFoundError) as err:
            await client.models.retrieve("gpt-nope")
    assert err.value.code == "model_not_found" and "gpt-nope" in err.value.message


async def test_every_response_carries_identity_headers(backends, http):
    base = await backends(version="v2")
    calls = [
        ("GET", "/health", None, 200),
        ("GET", "/metrics", None, 200),
        ("GET", "/sim/state", None, 200),
        ("GET", "/no/such/path", None, 404),
        ("GET", "/v1/completions", None, 405),
        ("POST", "/v1/completions", b"not json", 400),
        ("POST", "/v1/chat/completions", b"", 400),
        ("POST", "/sim/fault", b'{"hang": 3}', 400),
    ]
    for method, path, data, status in calls:
        async with http.request(method, f"{base}{path}", data=data) as resp:
            assert resp.status == status, path
            assert resp.headers["x-served-by"].startswith("127.0.0.1:"), path
            assert resp.headers["x-backend-version"] == "v2", path


async def test_bad_requests_get_400_naming_the_field(backends, http):
    base = await backends()
    for payload, field in [
        (b"{oops", "body"),
        (b'{"max_tokens": -3}', "max_tokens"),
        (b'{"user": 1}', "user"),
    ]:
        async with http.post(f"{base}/v1/chat/completions", data=payload) as resp:
            assert resp.status == 400
            err = (await resp.json())["error"]
            assert err["param"] == field and field in err["message"]
    headers = {"x-sim-memory-mib": "huge"}
    async with http.post(f"{base}/v1/completions", json={"max_tokens": 16}, headers=headers) as resp:
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "x-sim-memory-mib"
    assert (await _state(http, base))["counters"]["bad_requests"] == 4


async def test_deeply_nested_bodies_get_400_not_500(backends, http):
    """Python's JSON parser gives up on deep nesting with RecursionError: a client error, answered
    400 like any other bad body (a 500 is retried by Envoy, so the backend would see it twice)."""
    base = await backends()
    deep = b"[" * 5000 + b"]" * 5000
    for path in ("/v1/chat/completions", "/v1/completions", "/sim/fault"):
        async with http.post(f"{base}{path}", data=deep) as resp:
            assert resp.status == 400, await resp.text()
            err = (await resp.json())["error"]
            assert err["type"] == "invalid_request_error" and err["param"] == "body"
            assert "nested too deeply" in err["message"]
    assert (await _state(http, base))["counters"]["bad_requests"] == 2


async def test_oom_returns_500_at_once_and_is_counted(backends, http):
    base = await backends(engine="job", gpu_class="a10", time_scale=2.0)  # the first request runs 250 ms
    big = asyncio.create_task(
        http.post(f"{base}/v1/completions", json={"max_tokens": 16}, headers={"x-sim-memory-mib": "8192"})
    )
    await _poll_state(http, base, lambda s: s["running"] == 1)
    big_headers = {"x-sim-memory-mib": "8192"}
    async with http.post(f"{base}/v1/completions", json={"max_tokens": 16}, headers=big_headers) as resp:
        assert resp.status == 500
        err = (await resp.json())["error"]
    assert not big.done()  # refused at once, while the first one still holds the memory
    assert err["type"] == "oom" and err["message"].startswith(
        "CUDA out of memory. Tried to allocate 8192 MiB"
    )
    (await big).release()
    async with http.get(f"{base}/metrics") as resp:
        assert "inferlb_sim_oom_total 1.0" in await resp.text()


async def test_returning_session_is_faster_than_new(backends, http):
    base = await backends(time_scale=4.0)  # new: 409 tokens to prefill, 210 ms; returning: 9, 133 ms

    async def timed(headers):
        started = time.monotonic()
        async with http.post(f"{base}/v1/chat/completions", json={**CHAT, "max_tokens": 2}, headers=headers) as resp:
            assert resp.status == 200
        return time.monotonic() - started

    new = await timed({"x-session-id": "conv-1"})
    returning = await timed({"x-session-id": "conv-1"})
    assert returning < new - 0.05
    assert new >= 4 * a100_s(409, 2) and returning >= 4 * a100_s(9, 2)
    counters = (await _state(http, base))["counters"]
    assert (counters["session_hits"], counters["session_misses"]) == (1, 1)


async def _scrape(http, base):
    async with http.get(f"{base}/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        return await resp.text()


async def test_metrics_exposition_has_real_names_labels_and_buckets(backends, http):
    base = await backends(gpu_class="h100")
    async with http.post(f"{base}/v1/chat/completions", json=CHAT, headers={"x-user-id": "u"}) as resp:
        assert resp.status == 200
    text = await _scrape(http, base)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:e2e_request_latency_seconds",
        "vllm:time_to_first_token_seconds",
        "vllm:request_success",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_FB_FREE",
        "inferlb_sim_session_cache_hits",
        "inferlb_sim_session_cache_misses",
        "inferlb_sim_oom",
    ):
        assert name in families, name
    assert "vllm:gpu_cache_usage_perc" not in text
    for le in LATENCY_BUCKETS_S:
        assert f'vllm:e2e_request_latency_seconds_bucket{{engine="0",le="{le}",model_name="sim-7b"}}' in text
        assert f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="{le}",model_name="sim-7b"}}' in text
    assert 'vllm:e2e_request_latency_seconds_count{engine="0",model_name="sim-7b"} 1.0' in text
    assert "vllm:e2e_request_latency_seconds_sum{" in text
    assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name="sim-7b"} 1.0' in text
    assert 'vllm:generation_tokens_total{engine="0",model_name="sim-7b"} 16.0' in text
    (used,) = families["DCGM_FI_DEV_FB_USED"].samples
    assert used.labels["modelName"] == "NVIDIA H100 80GB HBM3"
    assert used.labels["gpu"] == "0" and used.labels["UUID"].startswith("GPU-") and used.labels["Hostname"]
    assert used.value == 0.9 * 81920  # vLLM holds gpu_memory_utilization of the GPU from the start
    (util,) = families["DCGM_FI_DEV_GPU_UTIL"].samples
    assert util.value == 0.0


async def test_gauges_follow_load(backends, http):
    base = await backends(engine="job", max_concurrency=2, time_scale=2.0)
    headers = {"x-sim-memory-mib": "6758.4"}  # 10 % of the KV memory each
    tasks = [
        asyncio.create_task(http.post(f"{base}/v1/completions", json={"max_tokens": 16}, headers=headers))
        for _ in range(3)
    ]
    await _poll_state(http, base, lambda s: s["running"] == 2 and s["waiting"] == 1)
    text = await _scrape(http, base)
    assert 'vllm:num_requests_running{engine="0",model_name="sim-7b"} 2.0' in text
    assert 'vllm:num_requests_waiting{engine="0",model_name="sim-7b"} 1.0' in text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["vllm:kv_cache_usage_perc"].samples[0].value == pytest.approx(0.3)
    assert families["DCGM_FI_DEV_GPU_UTIL"].samples[0].value == 100.0
    assert families["DCGM_FI_DEV_FB_FREE"].samples[0].value == pytest.approx(81920 - 14336 - 3 * 6758.4)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_legacy_flag_switches_kv_metric_name(backends, http):
    base = await backends(legacy_metrics=True)
    text = await _scrape(http, base)
    assert 'vllm:gpu_cache_usage_perc{engine="0",model_name="sim-7b"} 0.0' in text
    assert "vllm:kv_cache_usage_perc" not in text


async def test_several_backends_in_one_process_have_separate_metrics(backends, http):
    a, b = await backends(), await backends(gpu_class="a10")
    async with http.post(f"{a}/v1/completions", json={"max_tokens": 4}) as resp:
        assert resp.status == 200
    assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name="sim-7b"} 1.0' in (
        await _scrape(http, a)
    )
    assert "vllm:request_success_total{" not in await _scrape(http, b)


async def test_hang_fault_holds_requests_until_cleared(backends, http):
    base = await backends()
    assert (await _fault(http, base, hang=True))["faults"]["hang"] is True
    task = asyncio.create_task(http.post(f"{base}/v1/chat/completions", json=CHAT))
    await _poll_state(http, base, lambda s: s["hung"] == 1)
    await asyncio.sleep(0.1)
    assert not task.done()
    async with http.get(f"{base}/health") as resp:
        assert resp.status == 200  # the process is alive; only inference hangs
    await _fault(http, base, hang=False)
    resp = await asyncio.wait_for(task, 1.0)
    assert resp.status == 200
    resp.release()


async def test_metrics_fault_modes(backends, http):
    base = await backends()
    await _fault(http, base, metrics="error")
    async with http.get(f"{base}/metrics") as resp:
        assert resp.status == 503
    await _fault(http, base, metrics="hang")
    scrape = asyncio.create_task(http.get(f"{base}/metrics"))
    await asyncio.sleep(0.15)
    assert not scrape.done()
    async with http.post(f"{base}/v1/completions", json={"max_tokens": 16}) as resp:
        assert resp.status == 200  # inference is unaffected
    await _fault(http, base, metrics="ok")
    resp = await asyncio.wait_for(scrape, 1.0)
    assert resp.status == 200 and "vllm:num_requests_running" in await resp.text()
    resp.release()


async def test_slow_factor_and_long_tail_faults(backends, http):
    base = await backends(time_scale=0.2)
    state = await _fault(http, base, slow_factor=4.0, long_tail=0.25)
    assert state["faults"] == {"hang": False, "metrics": "ok", "push": "ok", "etcd": "ok", "slow_factor": 4.0,
                               "long_tail": 0.25}
    await _fault(http, base, long_tail=0.0)
    started = time.monotonic()
    async with http.post(f"{base}/v1/completions", json={"max_tokens": 16}, headers={"x-session-id": "s"}) as resp:
        assert resp.status == 200
    # One prompt token and 16 output tokens alone on an A100, 4x slower, at time scale 0.2: the model's
    # own time (211 ms; 53 ms without the fault).
    assert time.monotonic() - started >= 4 * 0.2 * a100_s(1, 16)
    await _fault(http, base, reset=True)
    assert (await _state(http, base))["faults"]["slow_factor"] == 1.0


async def test_a_busy_host_does_not_slow_the_simulated_gpu_down(backends, http):
    """The host's event loop stalls 3 x 30 ms during a request (as when the load balancer under test
    takes the CPU): the node makes the time up, so the request still takes about the model's time."""
    base = await backends(time_scale=0.2)
    await _fault(http, base, slow_factor=4.0)
    model_s = 4 * 0.2 * a100_s(1, 16)  # 211 ms
    async with http.post(f"{base}/v1/completions", json={"max_tokens": 16}) as resp:
        assert resp.status == 200  # warm: the first request also pays the connection's set-up
    loop = asyncio.get_running_loop()
    for at in (0.04, 0.09, 0.14):
        loop.call_later(at, time.sleep, 0.03)
    started = time.monotonic()
    async with http.post(f"{base}/v1/completions", json={"max_tokens": 16}) as resp:
        assert resp.status == 200
    elapsed = time.monotonic() - started
    assert model_s <= elapsed < model_s + 0.06  # every stall added to the later tokens: >= model + 90 ms


async def test_client_disconnect_releases_memory_and_slot(backends, http):
    base = await backends(engine="job")
    await _fault(http, base, slow_factor=400.0)  # 3.6 s: far longer than the test waits
    headers = {"x-sim-memory-mib": "18432"}
    request = asyncio.create_task(http.post(f"{base}/v1/completions", json={"max_tokens": 16}, headers=headers))
    state = await _poll_state(http, base, lambda s: s["running"] == 1)
    assert state["memory"]["used_mib"] == 14336 + 18432
    request.cancel()  # closes the client connection mid-request
    await asyncio.gather(request, return_exceptions=True)
    state = await _poll_state(http, base, lambda s: s["running"] == 0)
    assert state["memory"]["used_mib"] == 14336 and state["counters"]["cancelled"] == 1
    await _fault(http, base, reset=True)
    async with http.post(f"{base}/v1/completions", json={"max_tokens": 16}, headers=headers) as resp:
        assert resp.status == 200  # the backend still serves, with the memory free again


async def test_shutdown_does_not_wait_for_hung_requests(http):
    # Held requests are released at shutdown: cleanup ends long before the shutdown timeout it would
    # otherwise wait out (30 s here, so a loaded machine's slowness cannot pass for either outcome).
    runner, port = await start_backend(BackendConfig(port=0, time_scale=0.1), shutdown_timeout=30.0)
    base = f"http://127.0.0.1:{port}"
    await _fault(http, base, hang=True, metrics="hang")
    pending = [
        asyncio.create_task(http.post(f"{base}/v1/completions", json={"max_tokens": 16})),
        asyncio.create_task(http.get(f"{base}/metrics")),
    ]
    await _poll_state(http, base, lambda s: s["hung"] == 1, timeout=10.0)  # the completion is held
    started = time.monotonic()
    await runner.cleanup()
    assert time.monotonic() - started < 10.0
    await asyncio.gather(*pending, return_exceptions=True)


async def _sse(resp):
    """(arrival time s, parsed data) of every SSE event of a streamed response."""
    events, buf = [], b""
    async for raw in resp.content:
        buf += raw
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            assert event.startswith(b"data: "), event
            data = event[6:].decode()
            events.append((time.monotonic(), data if data == "[DONE]" else json.loads(data)))
    return events


async def test_streaming_chat_sends_chunks_as_produced_then_usage_and_done(backends, http):
    base = await backends(time_scale=1.0)
    body = {**CHAT, "max_tokens": 24, "stream": True, "stream_options": {"include_usage": True}}
    started = time.monotonic()
    async with http.post(f"{base}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["x-backend-version"] == "v1" and resp.headers["x-served-by"]
        events = await _sse(resp)
    assert events[-1][1] == "[DONE]"
    usage = events[-2][1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 24
    assert usage["usage"]["prompt_tokens"] == usage["usage"]["total_tokens"] - 24
    chunks = [e for _, e in events[:-2]]
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = [c for c in chunks if c["choices"][0]["delta"].get("content")]
    assert len(content) == 24 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    # tokens arrive over the decode time (23 steps of ~3 ms), not all at the end
    first, last = events[0][0] - started, events[-3][0] - started
    assert last - first > 0.04


async def test_streaming_completion_without_usage_and_non_streaming_usage(backends, http):
    base = await backends()
    async with http.post(f"{base}/v1/completions", json={"prompt": "x" * 64, "max_tokens": 5, "stream": True}) as r:
        events = await _sse(r)
    assert events[-1][1] == "[DONE]" and all("usage" not in e for _, e in events[:-1])
    assert [e["object"] for _, e in events[:-1]] == ["text_completion"] * 6
    assert "".join(e["choices"][0]["text"] for _, e in events[:-1]).split() == \
        ["Simulated", "reply", "from", "Simulated", "reply"]
    async with http.post(f"{base}/v1/completions", json={"prompt": "x" * 64, "max_tokens": 5}) as r:
        usage = (await r.json())["usage"]
    assert usage == {"prompt_tokens": 16, "completion_tokens": 5, "total_tokens": 21,
                     "prompt_tokens_details": {"cached_tokens": 0}}  # 16 tokens: the last one is recomputed


async def test_streaming_oom_is_still_an_http_500(backends, http):
    base = await backends(engine="job", gpu_class="a10")
    headers = {"x-sim-memory-mib": "20000"}
    async with http.post(f"{base}/v1/chat/completions", json={**CHAT, "stream": True}, headers=headers) as r:
        assert r.status == 500 and (await r.json())["error"]["type"] == "oom"


async def test_new_vllm_metrics_are_exposed_with_their_labels(backends, http):
    base = await backends()
    prompt = {"prompt": "shared system prompt " * 20, "max_tokens": 8}
    for _ in range(2):
        async with http.post(f"{base}/v1/completions", json=prompt) as resp:
            assert resp.status == 200
    families = {f.name: f for f in text_string_to_metric_families(await _scrape(http, base))}
    labels = {"model_name": "sim-7b", "engine": "0"}

    def value(family, sample):
        return next(s.value for s in families[family].samples if s.name == sample and s.labels == labels)

    queried, hit = value("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total"), \
        value("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
    assert queried == 2 * 105 and hit == 96  # 105 tokens: 6 full blocks cached, the second time
    assert value("vllm:num_preemptions", "vllm:num_preemptions_total") == 0
    assert value("vllm:request_prompt_tokens", "vllm:request_prompt_tokens_count") == 2
    assert value("vllm:request_prompt_tokens", "vllm:request_prompt_tokens_sum") == 210
    assert value("vllm:request_generation_tokens", "vllm:request_generation_tokens_sum") == 16
    assert value("vllm:time_per_output_token_seconds", "vllm:time_per_output_token_seconds_count") == 2
    assert value("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == 14


async def test_lone_surrogates_in_the_prompt_are_tokens_not_errors(backends, http):
    base = await backends()
    raw = b'{"max_tokens": 2, "messages": [{"role": "user", "content": "hi \\ud800 there"}]}'
    async with http.post(f"{base}/v1/chat/completions", data=raw, headers={"content-type": "application/json"}) as r:
        assert r.status == 200, await r.text()


async def _spans(http, base, since=None):
    url = f"{base}/sim/spans" + ("" if since is None else f"?since={since}")
    async with http.get(url) as resp:
        return resp.status, await resp.json()


async def test_spans_give_each_request_its_time_on_the_node_but_not_an_oom(backends, http):
    base = await backends(engine="job", gpu_class="a10", time_scale=1.0)  # a request runs ~225 ms
    t0 = time.time()
    first = asyncio.create_task(
        http.post(f"{base}/v1/completions", json={"max_tokens": 16}, headers={"x-sim-memory-mib": "8192"}))
    await _poll_state(http, base, lambda s: s["running"] == 1)
    second = asyncio.create_task(http.post(f"{base}/v1/completions", json={"max_tokens": 16}))
    await _poll_state(http, base, lambda s: s["running"] == 2)
    async with http.post(f"{base}/v1/completions", json={"max_tokens": 16},
                         headers={"x-sim-memory-mib": "8192"}) as resp:
        assert resp.status == 500  # refused at once: no time on the node
    for task in (first, second):
        (await task).release()
    t1 = time.time()
    status, body = await _spans(http, base)
    assert status == 200
    spans = body["spans"]
    assert len(spans) == 2
    (a0, l0), (a1, l1) = sorted(spans)
    assert t0 <= a0 < a1 < l0 <= l1 <= t1  # the two overlapped, as they ran side by side
    assert (await _spans(http, base, since=l1 + 1))[1] == {"spans": []}
    assert (await _spans(http, base, since=l0 + 1e-6))[1]["spans"] == [[a1, l1]]


async def test_spans_refuse_a_bad_since(backends, http):
    base = await backends()
    for bad in ("abc", "nan", "inf"):
        status, body = await _spans(http, base, since=bad)
        assert status == 400 and body["error"]["param"] == "since"
