"""What an ADS stream would put on the wire, decoded: the production encoding path, for tests."""

from __future__ import annotations

from envoy.service.discovery.v3 import discovery_pb2

from xds_server.ads.push import WireCache
from xds_server.snapshot import Snapshot


def pending(stream, snap: Snapshot | None) -> list:
    """The responses ``stream`` sends now for ``snap`` (recorded as sent), each encoded by a
    :class:`WireCache` as the server does and parsed back into a (Delta)DiscoveryResponse."""
    wire = WireCache()
    out = []
    for push in stream.plan(snap):
        kind = discovery_pb2.DeltaDiscoveryResponse if push.protocol == "delta" else discovery_pb2.DiscoveryResponse
        out.append(kind.FromString(wire.encode(push)))
    return out
