"""The ``llm`` engine's KV-cache events on the wire, as vLLM publishes them (ZMQ PUB, msgpack).

vLLM (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'``,
``vllm/distributed/kv_events.py``) sends each batch of its prefix cache's changes as one ZMQ
multipart message on a PUB socket (default ``tcp://*:5557``): the topic (default empty), the batch's
sequence number (8 bytes, big-endian) and the payload, a msgpack array ``[ts, events]`` (``ts`` the
wall time, s; msgspec's ``array_like`` structs with the optional ``data_parallel_rank`` left out).
Each event is an array whose first element names its type (msgspec's ``tag=True``):

- ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``
- ``["BlockRemoved", block_hashes, medium]``
- ``["AllBlocksCleared"]``

``medium`` is ``"GPU"`` (the device cache; vLLM names CPU-offloaded blocks ``"CPU"``) and ``lora_id``
None (the simulator serves no adapters). The block hashes are the engine's own keys
(:func:`sim.engines.kv.chain_hashes`: signed 64-bit ints, as vLLM's builtin-hash keys are ints), so
a consumer that keys a prompt as the engine does (llm-d's KV-cache indexer, Dynamo's KV router,
inferlb's precise prefix index with ``keys: sim``) finds them; or, with ``opaque``
(``--kv-events-opaque``), 32 bytes per hash that no consumer can compute from a prompt (the sha256
of a seed random per start and the key), as vLLM's sha256 hashes under a random seed are: a
consumer must then key the blocks by the token ids the events carry (``keys: vllm``).
vLLM also answers replay requests for missed sequence
numbers on a ROUTER socket; the simulator does not (a subscriber that misses a batch waits for the
blocks to be stored again).

:func:`encode_batch` is pure (msgpack); :class:`KvEventPublisher` is the thin socket around it (the
optional ``pyzmq`` and ``msgpack`` packages: ``pip install 'inferlb[kv-events]'``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from typing import Any

from sim.engines.api import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

__all__ = ["DEVICE_MEDIUM", "KvEventPublisher", "encode_batch", "event_fields", "opaque_hash"]

#: The ``medium`` vLLM gives blocks in GPU memory.
DEVICE_MEDIUM = "GPU"


def _as_is(key: int) -> int:
    return key


def opaque_hash(seed: bytes) -> Callable[[int], bytes]:
    """Key -> 32 bytes: the sha256 of ``seed`` and the key (8 bytes, big-endian, signed); the same
    key gives the same bytes under one seed (so a removal names what a store named)."""
    def digest(key: int) -> bytes:
        return hashlib.sha256(seed + key.to_bytes(8, "big", signed=True)).digest()

    return digest


def event_fields(event: KvEvent, name: Callable[[int], Any] = _as_is) -> list[Any]:
    """One event as vLLM's msgpack array (see the module docstring); ``name``: a block's published
    hash from its key (default: the key)."""
    if isinstance(event, BlockStored):
        parent = None if event.parent_block_hash is None else name(event.parent_block_hash)
        return ["BlockStored", list(map(name, event.block_hashes)), parent, list(event.token_ids),
                event.block_size, None, DEVICE_MEDIUM]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(map(name, event.block_hashes)), DEVICE_MEDIUM]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(events: Sequence[KvEvent], ts: float, name: Callable[[int], Any] = _as_is) -> bytes:
    """The msgpack payload of one ``KVEventBatch`` of ``events`` (oldest first) sent at ``ts`` (wall s);
    ``name`` as for :func:`event_fields`.

    Raises:
        ImportError: the ``msgpack`` package is not installed.
    """
    import msgpack

    return msgpack.packb([ts, [event_fields(e, name) for e in events]])


class KvEventPublisher:
    """A ZMQ PUB socket bound at ``endpoint`` (``tcp://HOST:PORT``) that sends KV event batches as vLLM does;
    ``opaque``: each hash published as :func:`opaque_hash` of a seed drawn at start (see the module docstring).

    Sends never block: a subscriber too slow for the socket's high-water mark loses batches, as with
    vLLM's publisher. Not thread-safe (one owner: the node's event loop).

    Raises:
        ImportError: ``pyzmq`` or ``msgpack`` is not installed.
        zmq.ZMQError: the endpoint cannot be bound.
    """

    def __init__(self, endpoint: str, topic: str = "", opaque: bool = False) -> None:
        import msgpack  # noqa: F401  (fail at start, not at the first batch)
        import zmq

        self._zmq = zmq
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)
        self._topic = topic.encode()
        self._seq = 0
        self._name: Callable[[int], Any] = opaque_hash(os.urandom(16)) if opaque else _as_is
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        """The bound endpoint (the port the OS chose for ``tcp://HOST:*``)."""

    def publish(self, events: Sequence[KvEvent], ts: float) -> None:
        """Send ``events`` as one batch (nothing for none), the next sequence number."""
        if not events:
            return
        payload = encode_batch(events, ts, self._name)
        try:
            self._socket.send_multipart((self._topic, self._seq.to_bytes(8, "big", signed=True), payload),
                                        flags=self._zmq.NOBLOCK)
        except self._zmq.Again:  # at the high-water mark: the batch is dropped, as a PUB socket does
            pass
        self._seq += 1

    def close(self) -> None:
        """Close the socket."""
        self._socket.close()
