"""State-of-the-World ADS protocol state for one stream (no I/O).

Rules (Envoy's xDS protocol doc, and docs/envoy-facts.md for what Envoy 1.40 really does):
- One nonce per response; a request whose ``response_nonce`` is not the latest nonce sent for its
  type is stale and ignored.
- ACK: latest nonce, no ``error_detail``: ``version_info`` is now applied.
- NACK: latest nonce with ``error_detail``: Envoy keeps its last good config; the rejected resource
  versions are not sent again (they stay recorded as sent), the next change to them is (case C03).
- CDS and LDS are wildcard types (an empty first subscription or ``*``): every response carries
  every resource. EDS and RDS are named: a subscription is a whole-set replacement (names compared
  as sets; Envoy reorders), responses carry the resources that changed or were newly subscribed.
- After a CDS change to a cluster Envoy re-warms it and waits for EDS, but its EDS re-request looks
  exactly like an ACK: so every changed cluster's assignment is re-sent right after the CDS
  response (case C01). A name that leaves the subscription is forgotten, so when it comes back
  (a cluster removed and added again) its assignment is sent again (case C15).
- Make-before-break: a cluster that left the snapshot stays in CDS responses until the client has
  ACKed the snapshot's listeners and routes (which no longer use it).

Planning a named type looks only at what can differ: once a type is in step with a snapshot
(``synced``), the next plan checks the names :meth:`~xds_server.snapshot.Snapshot.changed_since`
that one (computed once for all streams), not every resource.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from envoy.service.discovery.v3 import discovery_pb2

from xds_server.ads.common import WILDCARD_TYPES, AckState, StreamBase, held_clusters, rewarm_clusters, routing_settled
from xds_server.ads.push import Push, WireCache
from xds_server.snapshot import CLUSTER_TYPE, ENDPOINT_TYPE, Resource, Snapshot


@dataclass
class TypeState(AckState):
    """Per-type SotW protocol state of one stream.

    ``sent``: resource name -> version last sent; ``sent_resources``: the resources of the last
    wildcard response (what the client holds); ``nonce``: latest nonce sent (None before any);
    ``rewarm``: names to re-send whatever their version (EDS after a CDS change); ``synced``: the
    resources (a snapshot's :meth:`~xds_server.snapshot.Snapshot.of`) whose subscribed names ``sent``
    holds at their versions, None when unknown (the subscription changed or nothing was planned yet).
    """

    subscribed: frozenset[str] = frozenset()
    wildcard: bool = False
    sent: dict[str, str] = field(default_factory=dict)
    sent_resources: dict[str, Resource] = field(default_factory=dict)
    sent_type_version: str | None = None
    nonce: str | None = None
    rewarm: set[str] = field(default_factory=set)
    synced: Mapping[str, Resource] | None = None

    def pending_nonces(self) -> list[str]:
        """The nonce sent and not yet answered (SotW has at most one per type that counts)."""
        return [self.nonce] if self.nonce and self.acked != self.sent_type_version else []


class SotwStream(StreamBase):
    """Protocol state of one SotW ADS stream; feed it requests, ask it what to send."""

    protocol = "sotw"

    def __init__(self, nonces: WireCache | None = None) -> None:
        super().__init__(nonces)
        self.types: dict[str, TypeState] = {}

    def on_request(self, req: discovery_pb2.DiscoveryRequest) -> str:
        """Apply one DiscoveryRequest. Returns what it was: "initial", "ack", "nack" or "stale"."""
        st = self.types.setdefault(req.type_url, TypeState())
        if req.response_nonce and req.response_nonce != st.nonce:
            return "stale"
        names = frozenset(req.resource_names)
        kind = "initial"
        if req.response_nonce:
            if req.HasField("error_detail"):
                st.record_nack(req.error_detail.message)
                kind = "nack"
            else:
                st.record_ack(req.version_info)
                kind = "ack"
        st.requested = True
        st.wildcard = req.type_url in WILDCARD_TYPES and (not names or "*" in names)
        if names != st.subscribed:
            for gone in st.subscribed - names:
                st.sent.pop(gone, None)
            st.subscribed = names
            st.synced = None
        return kind

    def _respond(self, type_url: str, st, snap: Snapshot):
        return self._wildcard(type_url, st, snap) if st.wildcard else self._named(type_url, st, snap)

    def _wildcard(self, type_url: str, st: TypeState, snap: Snapshot) -> Push | None:
        resources = snap.of(type_url)
        version = snap.versions.get(type_url, "")
        if type_url == CLUSTER_TYPE:
            held = held_clusters(st.sent_resources, resources, routing_settled(self.types, snap))
            if held:
                resources = {**resources, **held}
                version = f"{version}+held.{len(held)}"
        if st.sent_type_version == version:
            return None
        if type_url == CLUSTER_TYPE:
            eds = self.types.get(ENDPOINT_TYPE)
            if eds is not None:
                eds.rewarm |= rewarm_clusters(st.sent, resources)
        st.sent = {n: r.version for n, r in resources.items()}
        st.sent_resources = dict(resources)
        st.sent_type_version = version
        return self._response(type_url, version, tuple(resources.values()), st)

    def _named(self, type_url: str, st: TypeState, snap: Snapshot) -> Push | None:
        resources = snap.of(type_url)
        if st.synced is resources and not st.rewarm:
            return None
        if st.synced is None or st.rewarm:
            send = self._scan(resources, resources, st)
        else:
            changes = snap.changed_since(type_url, st.synced)
            if st.subscribed.issuperset(changes.updated) and st.subscribed.isdisjoint(changes.added):
                # sent holds every subscribed name at its synced version: each updated one goes
                send = list(changes.updated.values())
                st.sent.update(changes.versions)
            else:
                send = self._scan(changes.names, resources, st)
        st.rewarm.clear()
        st.synced = resources
        if not send:
            return None
        version = snap.versions.get(type_url, "")
        st.sent_type_version = version
        return self._response(type_url, version, tuple(send), st)

    @staticmethod
    def _scan(names: Iterable[str], resources: Mapping[str, Resource], st: TypeState) -> list[Resource]:
        """The resources of ``names`` (in that order) the client subscribes to and has not got at their
        version (or must get again: ``rewarm``), recorded as sent."""
        sent, subscribed, rewarm = st.sent, st.subscribed, st.rewarm
        send = []
        for name in names:
            if name in subscribed:
                res = resources.get(name)
                if res is not None and (sent.get(name) != res.version or name in rewarm):
                    send.append(res)
                    sent[name] = res.version
        return send

    def _response(self, type_url: str, version: str, resources: tuple[Resource, ...], st: TypeState) -> Push:
        push = self._push(type_url, version, resources)
        st.nonce = push.nonce
        return push
