"""State-of-the-World ADS protocol state for one stream (no I/O).

Rules (Envoy's xDS protocol doc, and shared/ENVOY-NOTES.md for what Envoy 1.40 really does):
- One nonce per response; a request whose ``response_nonce`` is not the latest nonce sent for its
  type is stale and ignored.
- ACK: latest nonce, no ``error_detail``: ``version_info`` is now applied.
- NACK: latest nonce with ``error_detail``: Envoy keeps its last good config; the rejected resource
  versions are not sent again (they stay recorded as sent), the next change to them is (case C03).
- CDS is a wildcard type: every response carries every cluster. EDS is named: responses carry only
  the assignments that changed or were newly subscribed (names compared as sets; Envoy reorders).
- After a CDS change to a cluster Envoy re-warms it and waits for EDS, but its EDS re-request looks
  exactly like an ACK: so every changed cluster's assignment is re-sent right after the CDS
  response (case C01). A name that leaves the subscription is forgotten, so when it comes back
  (a cluster removed and added again) its assignment is sent again (case C15).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from envoy.service.discovery.v3 import discovery_pb2

from ..snapshot import CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, TYPE_ORDER, Snapshot

WILDCARD_TYPES = frozenset({CLUSTER_TYPE, LISTENER_TYPE})
NACK_DETAIL_CHARS = 400


@dataclass
class TypeState:
    """Per-type protocol state of one stream.

    ``sent``: resource name -> version last sent; ``nonce``: latest nonce sent (None before any);
    ``acked``: last ACKed ``version_info``; ``nack``: reason of the last NACK (tail of ``error_detail``).
    """

    subscribed: frozenset[str] = frozenset()
    wildcard: bool = False
    sent: dict[str, str] = field(default_factory=dict)
    sent_type_version: str | None = None
    nonce: str | None = None
    acked: str | None = None
    nack: str | None = None
    nack_at: float | None = None
    acks: int = 0
    nacks: int = 0
    requested: bool = False
    rewarm: set[str] = field(default_factory=set)


class SotwStream:
    """Protocol state of one SotW ADS stream; feed it requests, ask it what to send."""

    def __init__(self) -> None:
        self.types: dict[str, TypeState] = {}
        self._nonce = 0

    def on_request(self, req: discovery_pb2.DiscoveryRequest) -> str:
        """Apply one DiscoveryRequest. Returns what it was: "initial", "ack", "nack" or "stale"."""
        st = self.types.setdefault(req.type_url, TypeState())
        if req.response_nonce and req.response_nonce != st.nonce:
            return "stale"
        names = frozenset(req.resource_names)
        kind = "initial"
        if req.response_nonce:
            if req.HasField("error_detail"):
                st.nacks += 1
                msg = req.error_detail.message
                st.nack = msg[-NACK_DETAIL_CHARS:]
                st.nack_at = time.time()
                kind = "nack"
            else:
                st.acks += 1
                st.acked = req.version_info
                kind = "ack"
        st.requested = True
        st.wildcard = req.type_url in WILDCARD_TYPES and (not names or "*" in names)
        for gone in st.subscribed - names:
            st.sent.pop(gone, None)
        st.subscribed = names
        return kind

    def _next_nonce(self) -> str:
        self._nonce += 1
        return str(self._nonce)

    def pending(self, snap: Snapshot | None) -> list[discovery_pb2.DiscoveryResponse]:
        """Responses to send now for ``snap``, in CDS -> EDS order; records them as sent."""
        if snap is None:
            return []
        out = []
        for type_url in TYPE_ORDER:
            st = self.types.get(type_url)
            if st is None or not st.requested:
                continue
            resp = self._wildcard(type_url, st, snap) if st.wildcard else self._named(type_url, st, snap)
            if resp is not None:
                out.append(resp)
        return out

    def _wildcard(self, type_url: str, st: TypeState, snap: Snapshot) -> discovery_pb2.DiscoveryResponse | None:
        version = snap.versions.get(type_url, "")
        if st.sent_type_version == version:
            return None
        resources = snap.of(type_url)
        if type_url == CLUSTER_TYPE:
            eds = self.types.get(ENDPOINT_TYPE)
            if eds is not None:
                eds.rewarm |= {n for n, r in resources.items() if n in st.sent and st.sent[n] != r.version}
        st.sent = {n: r.version for n, r in resources.items()}
        st.sent_type_version = version
        return self._response(type_url, version, [r.packed for r in resources.values()], st)

    def _named(self, type_url: str, st: TypeState, snap: Snapshot) -> discovery_pb2.DiscoveryResponse | None:
        resources = snap.of(type_url)
        send = []
        for name in sorted(st.subscribed):
            res = resources.get(name)
            if res is None:
                continue
            if st.sent.get(name) != res.version or name in st.rewarm:
                send.append(res)
                st.sent[name] = res.version
        st.rewarm.clear()
        if not send:
            return None
        return self._response(type_url, snap.versions.get(type_url, ""), [r.packed for r in send], st)

    def _response(self, type_url, version, resources, st: TypeState) -> discovery_pb2.DiscoveryResponse:
        st.nonce = self._next_nonce()
        return discovery_pb2.DiscoveryResponse(
            version_info=version, resources=resources, type_url=type_url, nonce=st.nonce
        )
