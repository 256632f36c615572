"""One response a stream decided to send (:class:`Push`), and its wire encoding shared across streams.

A push to many Envoys repeats the same resources in every stream. The :class:`WireCache` serializes
the response body once per distinct content and appends a nonce field: protobuf's wire format
merges concatenated messages, and the body carries no nonce, so ``body + encode(nonce)`` parses as
the full response. It also hands out the nonces (:meth:`WireCache.nonce`): streams that send the
same content get the same nonce, so the whole response, nonce included, is one ``bytes`` object
sent by every stream. A nonce only has to be unique within its stream; each stream's nonces
increase. For 100 streams this turns 100 serializations of a ~300 KB EDS response into one, and
the 100 copies made of it here (body plus nonce, each a fresh ~300 KB allocation, ~70 page faults)
into none; gRPC still copies each message it sends (see BENCHMARKS.md, xDS push).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from envoy.service.discovery.v3 import discovery_pb2

from xds_server.snapshot import Resource
from xds_server.wire import delimited

_NONCE_TAG = 0x2A  # DiscoveryResponse.nonce = DeltaDiscoveryResponse.nonce = 5, length-delimited


def content_key(protocol: str, type_url: str, version: str, resources: tuple[Resource, ...],
                removed: tuple[str, ...]) -> tuple:
    """A response's content, everything but the nonce: equal keys encode to equal bodies. The
    resources count by identity (``id``): valid while they live, so a cache keyed by it must hold them."""
    return (protocol, type_url, version, tuple(map(id, resources)), removed)


@dataclass(frozen=True, slots=True)
class Push:
    """A response before encoding: ``protocol`` "sotw" or "delta"; ``version`` the SotW
    ``version_info`` / delta ``system_version_info``; ``removed``: delta ``removed_resources``;
    ``key``: :func:`content_key` of the rest but the nonce (computed once by the stream, which
    needs it for the nonce too: O(resources) per stream and push)."""

    protocol: str
    type_url: str
    version: str
    resources: tuple[Resource, ...]
    removed: tuple[str, ...]
    nonce: str
    key: tuple

    def message(self, with_nonce: bool = True):
        """The protobuf response, a DiscoveryResponse or DeltaDiscoveryResponse (``with_nonce=False``:
        the shared body)."""
        nonce = self.nonce if with_nonce else ""
        if self.protocol == "delta":
            return discovery_pb2.DeltaDiscoveryResponse(
                system_version_info=self.version, type_url=self.type_url, nonce=nonce,
                resources=[discovery_pb2.Resource(name=r.name, version=r.version, resource=r.packed)
                           for r in self.resources],
                removed_resources=self.removed,
            )
        return discovery_pb2.DiscoveryResponse(version_info=self.version, type_url=self.type_url, nonce=nonce,
                                               resources=[r.packed for r in self.resources])

    def nonce_field(self) -> bytes:
        """The serialized nonce field alone (field 5, length-delimited, in both response types)."""
        return delimited(_NONCE_TAG, self.nonce.encode())


class _Entry:
    """One content of a :class:`WireCache`: the pushed resources (its key names them by identity),
    the nonce streams get for it now, and once encoded its wire bytes with the nonce ``wire_nonce``,
    whose first ``body_len`` bytes are the body (no nonce)."""

    __slots__ = ("resources", "nonce", "wire", "wire_nonce", "body_len")

    def __init__(self, resources: tuple[Resource, ...], nonce: int) -> None:
        self.resources = resources
        self.nonce = nonce
        self.wire: bytes | None = None
        self.wire_nonce = ""
        self.body_len = 0


class WireCache:
    """Responses by content (LRU of ``size`` entries): their nonces (:meth:`nonce`) and their wire
    bytes (:meth:`encode`), one ``bytes`` object for every stream that sends the same content with
    the same nonce. An entry holds one encoding, as large as the response.
    """

    def __init__(self, size: int = 32) -> None:
        self._size = size
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._last_nonce = 0

    def nonce(self, key: tuple, resources: tuple[Resource, ...], after: int) -> int:
        """The nonce (> 0) of a response of content ``key`` (:func:`content_key` of ``resources`` and
        the rest) from a stream whose last nonce was ``after``: the content's current nonce when it
        is larger than ``after`` (the stream then sends the bytes other streams sent), else a new one,
        larger than every nonce given before and than ``after``, which the content carries from now on."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            if entry.nonce > after:
                return entry.nonce
        self._last_nonce = max(self._last_nonce, after) + 1
        if entry is None:
            self._put(key, _Entry(resources, self._last_nonce))
        else:
            entry.nonce = self._last_nonce
        return self._last_nonce

    def encode(self, push: Push) -> bytes:
        """The wire bytes of ``push`` (identical to ``push.message().SerializeToString()`` when parsed):
        the shared ``bytes`` when its nonce is the one its content's were made with, else the
        content's body (serialized once) plus its nonce field."""
        key = push.key
        entry = self._entries.get(key)
        if entry is None:
            entry = _Entry(push.resources, 0)  # 0: no nonce of ours (the pushing stream counts its own)
            self._put(key, entry)
        else:
            self._entries.move_to_end(key)
        if entry.wire_nonce == push.nonce:
            return entry.wire
        if entry.wire is None:
            body = push.message(with_nonce=False).SerializeToString()
            entry.body_len = len(body)
        else:
            body = memoryview(entry.wire)[:entry.body_len]
        wire = b"".join((body, push.nonce_field()))
        if entry.wire is None or push.nonce == str(entry.nonce):
            entry.wire, entry.wire_nonce = wire, push.nonce
        return wire

    def _put(self, key: tuple, entry: _Entry) -> None:
        self._entries[key] = entry
        if len(self._entries) > self._size:
            self._entries.popitem(last=False)
