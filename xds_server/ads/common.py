"""What the State-of-the-World and delta stream states share (pure): ACK/NACK bookkeeping,
wildcard types, CDS re-warm and make-before-break.

Sources: Envoy's xDS protocol doc ("ACK and NACK semantics", "How the client specifies what
resources to return", "Eventual consistency considerations") and docs/envoy-facts.md.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from xds_server.ads.push import Push, WireCache, content_key
from xds_server.snapshot import CLUSTER_TYPE, LISTENER_TYPE, ROUTE_TYPE, TYPE_ORDER, Resource, Snapshot

#: Types whose empty first subscription (and explicit ``*``) means "every resource of the type".
WILDCARD_TYPES = frozenset({CLUSTER_TYPE, LISTENER_TYPE})
#: The reason Envoy gives ends a long debug dump; keep its tail (characters).
NACK_DETAIL_CHARS = 400
#: Types whose resources reference clusters: a cluster is removed only once these are ACKed.
ROUTING_TYPES = (LISTENER_TYPE, ROUTE_TYPE)


@dataclass
class AckState:
    """ACK/NACK record of one type on one stream.

    ``acked``: the version the client last ACKed (SotW ``version_info``, delta
    ``system_version_info`` of the ACKed response); ``nack``: tail of the last NACK's
    ``error_detail.message``; ``nack_at``: when (Unix s); ``acks``/``nacks``: counts;
    ``requested``: the client has asked for this type on this stream.
    """

    acked: str | None = None
    nack: str | None = None
    nack_at: float | None = None
    acks: int = 0
    nacks: int = 0
    requested: bool = False

    def record_ack(self, version: str | None) -> None:
        """The client applied ``version``."""
        self.acks += 1
        self.acked = version

    def record_nack(self, message: str) -> None:
        """The client rejected a response; it keeps its last good config (``acked`` does not move)."""
        self.nacks += 1
        self.nack = message[-NACK_DETAIL_CHARS:]
        self.nack_at = time.time()


def rewarm_clusters(client_versions: Mapping[str, str], clusters: Mapping[str, Resource]) -> set[str]:
    """Clusters the client has at another version than ``clusters``: Envoy re-warms each of them and
    waits for its assignment, which it does not re-request (case C01), so it must be re-sent."""
    return {n for n, r in clusters.items() if n in client_versions and client_versions[n] != r.version}


def routing_settled(acks: Mapping[str, AckState], snap: Snapshot) -> bool:
    """True when every routing type (LDS, RDS) this client asked for is ACKed at ``snap``'s version.

    Until then a cluster that left the snapshot is still served (make-before-break: routes that
    used it are replaced before it goes).
    """
    for type_url in ROUTING_TYPES:
        st = acks.get(type_url)
        if st is not None and st.requested and st.acked != snap.versions.get(type_url):
            return False
    return True


def held_clusters(client_has: Mapping[str, Resource], snap_clusters: Mapping[str, Resource],
                  settled: bool) -> dict[str, Resource]:
    """Clusters the client has that ``snap`` dropped, kept while the routing is not ``settled``."""
    if settled:
        return {}
    return {n: r for n, r in client_has.items() if n not in snap_clusters}


class StreamBase:
    """What SotW and delta streams share: per-type state, the nonces, and the push plan (types in
    CDS -> EDS -> LDS -> RDS order, each asked of :meth:`_respond`).

    ``nonces``: the :class:`~xds_server.ads.push.WireCache` the server encodes with, which gives
    streams that send the same content the same nonce (so they send the same bytes); None: the
    stream counts its own (1, 2, ...). Either way a stream's nonces increase.
    """

    protocol = ""

    def __init__(self, nonces: WireCache | None = None) -> None:
        self.types: dict = {}
        self._nonce = 0
        self._nonces = nonces

    def _push(self, type_url: str, version: str, resources: tuple[Resource, ...],
              removed: tuple[str, ...] = ()) -> Push:
        """A push of this content with the stream's next nonce."""
        key = content_key(self.protocol, type_url, version, resources, removed)
        if self._nonces is None:
            self._nonce += 1
        else:
            self._nonce = self._nonces.nonce(key, resources, self._nonce)
        return Push(self.protocol, type_url, version, resources, removed, str(self._nonce), key)

    def plan(self, snap: Snapshot | None) -> list:
        """The pushes to send now for ``snap``, in CDS -> EDS -> LDS -> RDS order, recorded as sent
        (:class:`~xds_server.ads.push.Push`; the server encodes each once for all streams)."""
        if snap is None:
            return []
        out = []
        for type_url in TYPE_ORDER:
            st = self.types.get(type_url)
            if st is None or not st.requested:
                continue
            resp = self._respond(type_url, st, snap)
            if resp is not None:
                out.append(resp)
        return out

    def _respond(self, type_url: str, st, snap: Snapshot):
        """The push for one type now, or None (each protocol's rule)."""
        raise NotImplementedError
