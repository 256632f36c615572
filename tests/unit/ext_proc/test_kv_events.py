"""vLLM's KV event batches read into the precise prefix index (ext_proc/kv_events.py): the decoder, and
a subscriber thread fed by a simulated backend that publishes its events as vLLM does."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys

import aiohttp
import msgpack
import pytest
from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from prometheus_client import REGISTRY

from ext_proc.kv_events import (
    CLEARED,
    REMOVED,
    STORED,
    KvEventFeed,
    KvEventSubscriber,
    KvEventsUnavailable,
    apply,
    decode_batch,
    follows,
    publisher_address,
    sequence_number,
    start_feed,
)
from ext_proc.prefix_events import EventIndex
from ext_proc.recent import KEEP_S
from ext_proc.settings import PickerSettings
from ext_proc.view import RoutingTable, ServiceRoute, ViewHolder
from inferlb.devstack.stack import free_port
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
    assert decode_batch(payload) == [(STORED, (5, -6), None, tuple(range(32)), 16), (REMOVED, (5,)), (CLEARED,)]


def test_other_media_unknown_events_older_layouts_and_byte_hashes():
    h = bytes(range(32))  # vLLM's sha256 block hashes are 32 bytes
    payload = msgpack.packb([1.0, [
        ["BlockStored", [1, 2], None, [0] * 32, 16, None, "CPU"],  # the CPU offload tier: left out
        ["BlockRemoved", [1], "CPU"],
        ["SomethingNew", 1, 2],  # a type this reader does not know: left out
        ["BlockStored", [h], 9, [0] * 16, 16],  # an older vLLM: no lora_id, no medium
        ["BlockRemoved", [h]],
    ], 0])  # a trailing data_parallel_rank
    assert decode_batch(payload) == [(STORED, (int.from_bytes(h, "big"),), 9, (0,) * 16, 16),
                                     (REMOVED, (int.from_bytes(h, "big"),))]


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


@pytest.mark.parametrize(("template", "endpoint", "address"), [
    ("tcp://{host}:5557", "10.0.0.1:8000", "tcp://10.0.0.1:5557"),
    ("tcp://{host}:{port+1000}", "10.0.0.1:8000", "tcp://10.0.0.1:9000"),
    ("tcp://{host}:{port-1}", "[fd00::1]:8000", "tcp://[fd00::1]:7999"),
    ("ipc:///run/kv-{port}.sock", "h:8001", "ipc:///run/kv-8001.sock"),
])
def test_a_publishers_address_from_the_template(template, endpoint, address):
    assert publisher_address(template, endpoint) == address


@pytest.mark.parametrize(("template", "endpoint"), [("tcp://{host+1}:5557", "h:1"), ("tcp://{host}:5557", "h"),
                                                    ("tcp://{host}:{port+60000}", "h:8000"),
                                                    ("tcp://{host}:{port-8000}", "h:8000")])
def test_a_template_that_cannot_be_filled_is_a_value_error(template, endpoint):
    with pytest.raises(ValueError):
        publisher_address(template, endpoint)


def _view(holder: ViewHolder, *hosts: str, tokenizer: str | None = None) -> None:
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name="chat-v1")
    locality = cla.endpoints.add()
    for host in hosts:
        lb = locality.lb_endpoints.add(health_status=health_check_pb2.HEALTHY)
        lb.endpoint.address.socket_address.address = host
        lb.endpoint.address.socket_address.port_value = 8000
    routing = RoutingTable(services=(ServiceRoute("chat", ("*",), "v1", {"v1": "chat-v1"}, affinity="soft"),),
                           prefix_cache_tokens=1600, engine_block_size=16, engine_tokenizer=tokenizer)
    holder.update({"chat-v1": cla}, routing)


def test_the_feed_follows_the_view_and_applies_only_current_endpoints_changes():
    """An endpoint that left the view's pinnable endpoints stays followed for KEEP_S (a health flap
    must not lose its events), then is dropped and its late batches are stale."""
    holder = ViewHolder()
    _view(holder, "10.0.0.1", "10.0.0.2")
    index = EventIndex(pending_s=0.0)
    now = [0.0]
    feed = KvEventFeed(index, holder, "tcp://{host}:{port+1}", clock=lambda: now[0])
    applied, stale = batches("applied"), batches("stale")
    assert feed.follow() and feed.publishers == {"10.0.0.1:8000": "tcp://10.0.0.1:8001",
                                                 "10.0.0.2:8000": "tcp://10.0.0.2:8001"}
    assert not feed.follow()  # nothing changed
    feed._deliver("10.0.0.2:8000", [(STORED, tuple(range(1, 151)), None)])
    assert index.held("10.0.0.2:8000") == 100  # bounded by prefix_cache_tokens / engine_block_size
    assert REGISTRY.get_sample_value("inferlb_ext_proc_kv_event_publishers") == 2
    _view(holder, "10.0.0.1")  # 10.0.0.2 left: unhealthy for a round, say
    now[0] = KEEP_S
    assert not feed.follow(), "still followed within KEEP_S"
    feed._deliver("10.0.0.2:8000", [(STORED, tuple(range(200, 210)), None)])  # applied: not lost
    now[0] = KEEP_S + 0.1
    assert feed.follow() and list(feed.publishers) == ["10.0.0.1:8000"]
    feed._deliver("10.0.0.2:8000", [(CLEARED,)])  # a batch that was on its way: not applied
    assert index.held("10.0.0.2:8000") == 100
    assert (batches("applied") - applied, batches("stale") - stale) == (2, 1)
    assert REGISTRY.get_sample_value("inferlb_ext_proc_kv_event_publishers") == 1


def batches(outcome: str) -> float:
    return REGISTRY.get_sample_value("inferlb_ext_proc_kv_event_batches_total", {"outcome": outcome}) or 0.0


async def test_a_feed_runs_only_for_kv_events():
    holder = ViewHolder()
    _view(holder, "10.0.0.1")
    settings = PickerSettings(130.0, 1800.0, 1000, False, 256, 0.1, 1, False, 3, 5.0, 0.999, 20, True, 0.1, 1.0,
                              "routing", "tcp://{host}:5557", "", 5.0)
    assert start_feed(EventIndex(), holder, settings) is None
    task = start_feed(EventIndex(), holder, dataclasses.replace(settings, prefix_source="kv_events"))
    assert task is not None
    await asyncio.sleep(0.05)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_without_pyzmq_the_feed_is_refused_at_start_naming_the_setting(monkeypatch):
    holder = ViewHolder()
    _view(holder, "10.0.0.1")
    settings = PickerSettings(130.0, 1800.0, 1000, False, 256, 0.1, 1, False, 3, 5.0, 0.999, 20, True, 0.1, 1.0,
                              "kv_events", "tcp://{host}:5557", "", 5.0)
    monkeypatch.setitem(sys.modules, "zmq", None)  # an import of it fails
    with pytest.raises(KvEventsUnavailable, match=r"picker.prefix_source: kv_events needs pyzmq"):
        start_feed(EventIndex(), holder, settings)


async def test_a_tokenizer_that_cannot_be_loaded_is_refused_at_start_naming_the_setting(tmp_path):
    holder = ViewHolder()
    _view(holder, "10.0.0.1", tokenizer=str(tmp_path))  # no tokenizer.json there
    settings = PickerSettings(130.0, 1800.0, 1000, False, 256, 0.1, 1, False, 3, 5.0, 0.999, 20, True, 0.1, 1.0,
                              "kv_events", "tcp://{host}:5557", "", 5.0)
    with pytest.raises(KvEventsUnavailable, match=r"picker.kv_events.tokenizer: .*tokenizer.json"):
        start_feed(EventIndex(), holder, settings)


def test_sequence_numbers_tell_lost_batches_and_a_restarted_publisher():
    assert sequence_number([b"", (5).to_bytes(8, "big", signed=True), b"x"]) == 5
    assert sequence_number([b"x"]) is None
    assert [follows(None, 3), follows(3, 4), follows(3, 9), follows(3, 3), follows(3, 0)] == [
        (False, 0), (False, 0), (False, 5), (True, 0), (True, 0)]


async def _bind_again(publisher, endpoint: str):
    """A publisher bound at ``endpoint`` as soon as the port is free again: ZMQ closes a socket in its
    I/O thread, so the closed one's port may still be taken for a moment (as for a restarted engine)."""
    import zmq

    for _ in range(100):
        try:
            return publisher(endpoint)
        except zmq.ZMQError as err:
            if err.errno != zmq.EADDRINUSE:
                raise
            await asyncio.sleep(0.02)
    return publisher(endpoint)


async def test_a_restarted_publisher_makes_the_index_forget_its_endpoints_blocks():
    """A restarted engine's cache is empty and vLLM sends no AllBlocksCleared at start: its sequence
    numbers starting again are what tells."""
    from sim.kv_publish import KvEventPublisher

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    index = EventIndex(pending_s=0.0)
    subscriber = KvEventSubscriber(lambda e, c: apply(index, e, c, 10_000), asyncio.get_running_loop())
    restarts = batches("restarted")
    subscriber.start()
    subscriber.watch({A: endpoint})
    try:
        first = KvEventPublisher(endpoint)
        for _ in range(200):  # until the SUB socket joined
            first.publish([BlockStored(1.0, (1, 2, 3), None, tuple(range(48)), 16)], 1.0)
            await asyncio.sleep(0.02)
            if index.held(A):
                break
        for _ in range(50):
            first.publish([BlockStored(1.0, (1, 2, 3), None, tuple(range(48)), 16)], 1.0)
        await asyncio.sleep(0.2)
        assert index.keys(A) == (1, 2, 3)
        first.close()
        second = await _bind_again(KvEventPublisher, endpoint)  # numbers from 0 again
        try:
            for _ in range(200):
                second.publish([BlockStored(2.0, (7,), None, tuple(range(16)), 16)], 2.0)
                await asyncio.sleep(0.02)
                if 7 in index.keys(A):
                    break
            assert index.keys(A) == (7,)  # the first publisher's blocks forgotten
            assert batches("restarted") == restarts + 1
        finally:
            second.close()
    finally:
        subscriber.stop()
