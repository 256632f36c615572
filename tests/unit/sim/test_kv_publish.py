"""The simulator's KV-cache events on vLLM's wire: the msgpack layout, and a backend publishing them on ZMQ."""

import asyncio
import json
import time

import aiohttp
import msgpack
import pytest
import zmq

from sim.config import BackendConfig
from sim.engines.api import AllBlocksCleared, BlockRemoved, BlockStored
from sim.engines.kv import chain_hashes
from sim.kv_publish import KvEventPublisher, encode_batch, event_fields, opaque_hash
from sim.protocol import parse_request
from sim.server import NODE_KEY, start_backend


def test_each_event_is_vllms_tagged_array():
    stored = BlockStored(1.0, (11, -22), 7, tuple(range(32)), 16)
    assert event_fields(stored) == ["BlockStored", [11, -22], 7, list(range(32)), 16, None, "GPU"]
    assert event_fields(BlockRemoved(2.0, (11,))) == ["BlockRemoved", [11], "GPU"]
    assert event_fields(AllBlocksCleared(3.0)) == ["AllBlocksCleared"]
    with pytest.raises(TypeError):
        event_fields("BlockStored")  # type: ignore[arg-type]
    ts, events = msgpack.unpackb(encode_batch([stored, AllBlocksCleared(3.0)], 1234.5))
    assert ts == 1234.5 and events == [event_fields(stored), ["AllBlocksCleared"]]


async def _receive(sub: zmq.Socket, timeout_s: float = 5.0) -> list[bytes]:
    for _ in range(int(timeout_s / 0.02)):
        if sub.poll(0):
            return sub.recv_multipart()
        await asyncio.sleep(0.02)
    raise AssertionError("no KV event batch arrived")


async def test_a_backend_publishes_the_blocks_a_prompt_stored_keyed_as_the_engine_keys_them():
    cfg = BackendConfig(host="127.0.0.1", port=0, seed=1, time_scale=0.1, kv_events_endpoint="tcp://127.0.0.1:*")
    runner, port = await start_backend(cfg)
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        node = runner.app[NODE_KEY]
        assert node.kv_publisher is not None
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(node.kv_publisher.endpoint)
        await asyncio.sleep(0.3)  # a SUB socket gets only what is sent after it joined
        body = {"prompt": "the same long opening " * 20, "max_tokens": 2}
        async with aiohttp.ClientSession() as http, \
                http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
            assert resp.status == 200
        topic, seq, payload = await _receive(sub)
        assert topic == b"" and int.from_bytes(seq, "big", signed=True) == 0
        ts, events = msgpack.unpackb(payload)
        assert ts > 1e9  # wall time
        kind, hashes, parent, token_ids, block_size, lora_id, medium = events[0]
        tokens = parse_request("completion", json.dumps(body).encode(), {}).tokens
        assert (kind, parent, block_size, lora_id, medium) == ("BlockStored", None, 16, None, "GPU")
        assert hashes == chain_hashes(tokens, 16) and len(hashes) == len(tokens) // 16 > 0
        assert token_ids == list(tokens[:len(hashes) * 16])
    finally:
        sub.close()
        await runner.cleanup()
    assert node.kv_publisher is None


def test_opaque_hashes_name_a_key_alike_in_stores_and_removals_and_differ_per_seed():
    name = opaque_hash(b"seed one")
    stored = BlockStored(1.0, (5, -6), 4, tuple(range(32)), 16)
    fields = event_fields(stored, name)
    assert fields[1] == [name(5), name(-6)] and fields[2] == name(4)
    assert all(isinstance(h, bytes) and len(h) == 32 for h in fields[1])  # as vLLM's sha256 hashes
    assert event_fields(BlockRemoved(2.0, (-6,)), name)[1] == [name(-6)]
    assert opaque_hash(b"seed two")(5) != name(5) and event_fields(stored)[1] == [5, -6]
    assert msgpack.unpackb(encode_batch([stored], 3.0, name))[1][0][1] == [name(5), name(-6)]


def test_a_publisher_started_opaque_publishes_no_key():
    publisher = KvEventPublisher("tcp://127.0.0.1:*", opaque=True)
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(publisher.endpoint)
        deadline = time.monotonic() + 5
        while not sub.poll(50):  # a SUB socket gets only what is sent after it joined: publish until it has
            assert time.monotonic() < deadline
            publisher.publish([BlockStored(1.0, (5,), None, tuple(range(16)), 16)], 1.0)
        hashes = msgpack.unpackb(sub.recv_multipart()[-1])[1][0][1]
        assert len(hashes) == 1 and isinstance(hashes[0], bytes) and len(hashes[0]) == 32
    finally:
        sub.close()
        publisher.close()
