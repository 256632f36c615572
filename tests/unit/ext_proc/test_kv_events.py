"""vLLM's KV event batches read into the precise prefix index (ext_proc/kv_events.py): the decoder, and
a subscriber thread fed by a simulated backend that publishes its events as vLLM does."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import msgpack
import pytest

from ext_proc.kv_events import CLEARED, REMOVED, STORED, KvEventSubscriber, apply, decode_batch
from ext_proc.prefix_events import EventIndex
from sim.config import BackendConfig
from sim.engines.api import AllBlocksCleared, BlockRemoved, BlockStored
from sim.engines.kv import chain_hashes
from sim.kv_publish import encode_batch
from sim.protocol import parse_request
from sim.server import NODE_KEY, start_backend

A = "10.0.0.1:8000"


def test_the_simulators_batches_decode_to_the_device_cache_changes():
    payload = encode_batch([BlockStored(1.0, (5, -6), None, tuple(range(32)), 16), BlockRemoved(2.0, (5,)),
                            AllBlocksCleared(3.0)], 3.5)
    assert decode_batch(payload) == [(STORED, (5, -6), None), (REMOVED, (5,)), (CLEARED,)]


def test_other_media_unknown_events_older_layouts_and_byte_hashes():
    h = bytes(range(32))  # vLLM's sha256 block hashes are 32 bytes
    payload = msgpack.packb([1.0, [
        ["BlockStored", [1, 2], None, [0] * 32, 16, None, "CPU"],  # the CPU offload tier: left out
        ["BlockRemoved", [1], "CPU"],
        ["SomethingNew", 1, 2],  # a type this reader does not know: left out
        ["BlockStored", [h], 9, [0] * 16, 16],  # an older vLLM: no lora_id, no medium
        ["BlockRemoved", [h]],
    ], 0])  # a trailing data_parallel_rank
    assert decode_batch(payload) == [(STORED, (int.from_bytes(h, "big"),), 9), (REMOVED, (int.from_bytes(h, "big"),))]


@pytest.mark.parametrize("payload", [b"\xc1", msgpack.packb({"ts": 1}), msgpack.packb([1.0]),
                                     msgpack.packb([1.0, ["BlockStored"]]),
                                     msgpack.packb([1.0, [["BlockRemoved", [1.5], "GPU"]]])])
def test_a_malformed_batch_is_a_value_error(payload):
    with pytest.raises(ValueError):
        decode_batch(payload)


def test_apply_feeds_the_index_in_order():
    index = EventIndex(pending_s=0.0)
    apply(index, A, [(STORED, (1, 2, 3), None), (REMOVED, (3,)), (STORED, (4,), 2)], 100)
    assert index.matched((1, 2, 3), [A]) == {A: 2} and index.held(A) == 3
    apply(index, A, [(CLEARED,)], 100)
    assert index.held(A) == 0


async def test_a_subscriber_mirrors_a_simulated_backends_cache_on_the_event_loop():
    cfg = BackendConfig(host="127.0.0.1", port=0, seed=1, time_scale=0.1, kv_events_endpoint="tcp://127.0.0.1:*")
    runner, port = await start_backend(cfg)
    index = EventIndex(pending_s=0.0)
    loop = asyncio.get_running_loop()
    owner = []

    def deliver(endpoint, changes):
        owner.append(asyncio.get_running_loop() is loop)  # applied on the loop, never on the thread
        apply(index, endpoint, changes, 10_000)

    subscriber = KvEventSubscriber(deliver, loop)
    try:
        node = runner.app[NODE_KEY]
        subscriber.start()
        subscriber.watch({A: node.kv_publisher.endpoint})
        await asyncio.sleep(0.4)  # the SUB socket joins before anything is sent
        body = {"prompt": "a prompt that other requests will share " * 12, "max_tokens": 2}
        keys = chain_hashes(parse_request("completion", json.dumps(body).encode(), {}).tokens, 16)
        async with aiohttp.ClientSession() as http, \
                http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
            assert resp.status == 200
        for _ in range(100):
            if index.matched(keys, [A]):
                break
            await asyncio.sleep(0.02)
        assert len(keys) > 5 and index.matched(keys, [A]) == {A: len(keys)}
        assert owner and all(owner) and subscriber.dropped == 0
    finally:
        subscriber.stop()
        await runner.cleanup()
