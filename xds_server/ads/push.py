"""One response a stream decided to send (:class:`Push`), and its wire encoding shared across streams.

A push to many Envoys repeats the same resources in every stream; only the nonce differs. The
:class:`WireCache` serializes the response body once per distinct content and appends each stream's
nonce field: protobuf's wire format merges concatenated messages, and the body carries no nonce, so
``body + encode(nonce)`` parses as the full response. For 100 streams this turns 100 copies and
serializations of a ~300 KB EDS response into one (see BENCHMARKS.md, xDS push).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from envoy.service.discovery.v3 import discovery_pb2

from xds_server.snapshot import Resource
from xds_server.wire import delimited

_NONCE_TAG = 0x2A  # DiscoveryResponse.nonce = DeltaDiscoveryResponse.nonce = 5, length-delimited


@dataclass(frozen=True, slots=True)
class Push:
    """A response before encoding: ``protocol`` "sotw" or "delta"; ``version`` the SotW
    ``version_info`` / delta ``system_version_info``; ``removed``: delta ``removed_resources``."""

    protocol: str
    type_url: str
    version: str
    resources: tuple[Resource, ...]
    removed: tuple[str, ...]
    nonce: str

    def content_key(self) -> tuple:
        """Everything but the nonce: equal keys encode to equal bodies. The resources count by
        identity (``id``): valid while they live, so a cache keyed by it must hold them."""
        return (self.protocol, self.type_url, self.version, tuple(map(id, self.resources)), self.removed)

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


class WireCache:
    """Serialized response bodies by content (LRU of ``size`` entries); :meth:`encode` adds the nonce.

    An entry holds the pushed resources with its body: its key names them by identity.
    """

    def __init__(self, size: int = 32) -> None:
        self._size = size
        self._bodies: OrderedDict[tuple, tuple[tuple[Resource, ...], bytes]] = OrderedDict()

    def encode(self, push: Push) -> bytes:
        """The wire bytes of ``push`` (identical to ``push.message().SerializeToString()`` when parsed)."""
        key = push.content_key()
        hit = self._bodies.get(key)
        if hit is None:
            body = push.message(with_nonce=False).SerializeToString()
            self._bodies[key] = (push.resources, body)
            if len(self._bodies) > self._size:
                self._bodies.popitem(last=False)
        else:
            body = hit[1]
            self._bodies.move_to_end(key)
        return body + push.nonce_field()
