"""The precise prefix-cache index on real processes (issue 37): real Envoy, ``inferlb serve`` with
``picker.prefix_source: kv_events``, two ``llm`` simulated backends publishing their KV-cache events
as vLLM does (``--kv-events-endpoint``, ZMQ + msgpack).

Each prompt is first sent to one backend directly, bypassing Envoy and the picker: only that
backend's events can tell the picker where its prefix is cached. The same prompt's next turn,
through Envoy and without a session header, must then go to that backend and be served from its
prefix cache; and the picker's index holds every block each engine cached since the picker subscribed. With
``prefix_source: routing`` (the picker's own picks alone) the turns are placed by load and the
test fails (the backends warmed are AABBAABB, the picker's turn for prompts cached nowhere alternates).
Run with ``inferlb serve``'s own picker, with a standalone picker (``inferlb ext-proc``) that Envoy
asks instead (the in-process picker's index, which the test reads, is fed by the same publishers),
with a Hugging Face tokenizer on both sides, and as against vLLM (``vllm-keys``): the backends
render chats with the tokenizer's chat template and publish opaque hashes (``--kv-events-opaque``:
32 bytes under a seed random per start, as vLLM's sha256 hashes), so the picker
(``keys: vllm``) can only find the prompts by the token ids the events carry.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from itertools import takewhile

import pytest
import requests

from ext_proc.engine_keys import engine_keys
from ext_proc.prefix_events import EventIndex
from inferlb.devstack.stack import free_port, inferlb_argv, spawn
from sim.tokenizer import write_small_tokenizer
from tests.integration.conftest import Stack, start_stack, stop_stack, wait_until
from tests.support.chat_tokenizer import write_chat_tokenizer

pytestmark = pytest.mark.integration

#: The publishers' address from the endpoint's (the backends listen on ports the test picks).
OFFSET = 1000
WARMED = "AABBAABB"  # which backend each prompt is first sent to, directly


@pytest.fixture(scope="module", params=["serve", "ext-proc", "serve-tokenizer", "vllm-keys"])
def events_stack(request, tmp_path_factory) -> Iterator[Stack]:
    """``serve``: Envoy asks ``inferlb serve``'s own picker; ``ext-proc``: a standalone picker
    (``inferlb ext-proc --xds``), which gets the settings over ADS and runs its own feed;
    ``serve-tokenizer``: the backends count with a Hugging Face tokenizer (``--tokenizer DIR``) and
    the picker with the same (``picker.kv_events.tokenizer``); ``vllm-keys``: a tokenizer with a chat
    template, opaque hashes, ``picker.kv_events.keys: vllm``."""
    workdir = tmp_path_factory.mktemp("kvevents")
    standalone = free_port() if request.param == "ext-proc" else None
    kv_events: dict = {"endpoint": f"tcp://{{host}}:{{port+{OFFSET}}}"}
    sim_args: list[str] = []
    if request.param == "serve-tokenizer":
        kv_events["tokenizer"] = str(write_small_tokenizer(workdir / "tokenizer"))
        sim_args = ["--tokenizer", kv_events["tokenizer"]]
    if request.param == "vllm-keys":
        kv_events.update(keys="vllm", tokenizer=str(write_chat_tokenizer(workdir / "chatml")))
        sim_args = ["--tokenizer", kv_events["tokenizer"], "--kv-events-opaque"]
    # no slow start: a backend that loads transformers joins after the first round, and at a tenth of
    # its weight the picker would rightly send a prompt cached there to the other (not under test here)
    config: dict = {"picker": {"prefix_source": "kv_events", "kv_events": kv_events},
                    "engine": {"factors": {"slow_start": {"window_s": 0}}}}
    if standalone is not None:
        config["envoy"] = {"ext_proc_address": f"127.0.0.1:{standalone}"}
    s = start_stack(workdir, [("v1", "a100")] * 2, deferred={0, 1}, config=config, port_offsets=(OFFSET,))
    try:
        for b in s.backends:
            b.args += [*sim_args, "--kv-events-endpoint", f"tcp://127.0.0.1:{b.port + OFFSET}"]
            s.start_backend(b)
        if standalone is not None:
            wait_until(lambda: all(e["weight"] > 0 for e in s.weights()["chat-v1"].values()), 30,
                       what="both backends weighted")
            proc = spawn("picker-kv", inferlb_argv("ext-proc", "--xds", f"127.0.0.1:{s.app.xds_port}",
                                                   "--listen", f"127.0.0.1:{standalone}"), s.workdir)
            s.procs.append(proc)
            wait_until(lambda: proc.alive() and _accepts(standalone), 15, what="the standalone picker")
            time.sleep(1.5)  # its feed subscribes to the endpoints of its first view
    except BaseException:
        stop_stack(s)
        raise
    yield s
    stop_stack(s)


def _accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
        return True
    return False


def prompt(i: int) -> str:
    """Prompt ``i``'s system message: its first KV block differs from every other prompt's (with a
    tokenizer of a token a byte, ChatML's ``<|im_start|>system\\n`` fills half a block). With
    ``keys: vllm`` a block cached before the picker subscribed is an unknown parent of every block
    stored after it, and these prompts are sent straight to the backends, not through the picker,
    so no pick of its explains it (docs/picker.md, "Precise mode"): prompts sharing a first block
    would be invisible."""
    return " ".join(f"{i} document line {n}: the quick brown fox jumps over the lazy dog" for n in range(40))


def body(i: int, question: str) -> dict:
    return {"max_tokens": 4, "messages": [{"role": "system", "content": prompt(i)},
                                          {"role": "user", "content": question}]}


def on_loop(s: Stack, fn):
    """``fn()`` run on the picker's event loop (the index's owner)."""
    async def call():
        return fn()
    return s.loop.run(call())


def keys_of(s: Stack, doc: dict) -> tuple[int, ...]:
    """The prompt's keys as the picker computes them (with the stack's tokenizer and rule)."""
    routing = s.app.view.current.routing
    return engine_keys(doc, 16, routing.engine_tokenizer, routing.engine_keys)


def matched(s: Stack, doc: dict) -> dict[str, int]:
    keys = keys_of(s, doc)
    index = s.app.picker.control.prefixes
    return on_loop(s, lambda: index.matched(keys, [b.address for b in s.backends]))


def test_a_prompt_cached_on_a_backend_by_its_events_goes_there_through_envoy(events_stack: Stack):
    s = events_stack
    index = s.app.picker.control.prefixes
    assert isinstance(index, EventIndex)
    wait_until(lambda: all(e["weight"] > 0 for e in s.weights()["chat-v1"].values()), 30,
               what="both backends weighted")
    attempts = iter(range(1000, 2000))
    for b in s.backends:  # the picker subscribes as each endpoint joins its view: a fresh prompt until one shows

        def subscribed(b=b) -> bool:
            probe = body(next(attempts), "a probe")
            r = requests.post(f"http://{b.address}/v1/chat/completions", json=probe, timeout=10)
            assert r.status_code == 200, r.text
            return wait_until_quietly(lambda: matched(s, probe).get(b.address, 0) > 0, 1.0)

        wait_until(subscribed, 20, interval=0, what=f"{b.address}'s events in the picker's index")
    page = requests.get(f"{s.admin}/metrics", timeout=5).text  # the in-process picker's feed
    assert "inferlb_ext_proc_kv_event_publishers 2.0" in page
    assert 'inferlb_ext_proc_kv_event_batches_total{outcome="applied"}' in page
    # A probe sent before the subscription joined was cached unseen (no replay; nothing evicts here):
    # from now on the index must follow each engine's cache block for block.
    time.sleep(0.5)
    unseen = gaps(s)
    backends = {"A": s.backends[0], "B": s.backends[1]}
    for i, which in enumerate(WARMED):
        b = backends[which]
        warm = body(i, "a first question")
        r = requests.post(f"http://{b.address}/v1/chat/completions", json=warm, timeout=10)
        assert r.status_code == 200, r.text
        want = len(keys_of(s, warm))
        wait_until(lambda warm=warm, b=b, want=want: matched(s, warm).get(b.address) == want, 10,
                   what=f"prompt {i}'s {want} blocks in the index for {b.address}")
        # Both pinnable (a loaded machine's late Prometheus scrape can mark one UNHEALTHY for a round,
        # "stale metrics": then the picker rightly sends the turn elsewhere; health is not this test's subject).
        wait_until(lambda: {x.address for x in s.backends} <= s.app.view.current.clusters["chat-v1"].members, 20,
                   what="both backends pinnable")
        turn = body(i, "and a second question, through the gateway")
        r = requests.post(f"{s.listener}/v1/chat/completions", json=turn, timeout=10)
        assert r.status_code == 200, r.text
        assert r.headers["x-served-by"] == b.address, f"prompt {i} warmed on {which}"
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        held = matched(s, warm)[b.address]
        # the blocks both turns share (the system prompt and the turns' common head) that the engine holds
        shared = min(held, sum(1 for _ in takewhile(lambda pair: pair[0] == pair[1],
                                                     zip(keys_of(s, warm), keys_of(s, turn), strict=False))))
        assert cached >= 16 * shared - 16 and cached > 0

    wait_until(lambda: gaps(s) == unseen, 10,
               what=f"each engine's cached blocks = the index's + those cached before it subscribed ({unseen})")


def gaps(s: Stack) -> dict[str, int]:
    """Per backend, the blocks its engine holds in its prefix cache that the picker's index does not."""
    cached = {b.address: requests.get(f"http://{b.address}/sim/state", timeout=5).json()["kv_cache"]["cached_blocks"]
              for b in s.backends}
    index = s.app.picker.control.prefixes
    held = on_loop(s, lambda: {e: index.held(e) for e in cached})
    return {e: cached[e] - held[e] for e in cached}


def wait_until_quietly(check, timeout: float) -> bool:
    """:func:`wait_until` that returns False at the timeout instead of failing."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


