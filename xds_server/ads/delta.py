"""Delta (incremental) ADS protocol state for one stream (no I/O).

Rules (Envoy's xDS protocol doc, "Incremental xDS", and docs/envoy-facts.md):
- Subscriptions change by ``resource_names_subscribe`` / ``resource_names_unsubscribe``. For CDS and
  LDS an empty first request (legacy) or ``*`` subscribes to every resource (wildcard);
  unsubscribing ``*`` ends the wildcard.
- The server tracks, per resource, the version the client has (``known``): filled from
  ``initial_resource_versions`` (sent on reconnect, honoured: an unchanged resource is not re-sent)
  and from what was sent. A newly subscribed name without an initial version is sent even if
  unchanged; an unsubscribed name is forgotten (so a re-added cluster gets its assignment: C15).
- Responses carry only resources whose version differs from ``known``; for CDS and LDS also
  ``removed_resources``: names the client has (sent, or reported in ``initial_resource_versions``)
  that the snapshot no longer holds. EDS and RDS names are never "removed": the client
  unsubscribes them itself when it drops the cluster or listener that used them.
- Every response has its own nonce; several may be in flight. An ACK or NACK names one by
  ``response_nonce``. A NACK leaves the rejected versions recorded as known, so they are not re-sent;
  the next change is (C03). A nonce we never sent (or already answered) changes no ACK state.
- After a CDS change Envoy re-warms the cluster and, in delta, sends no EDS request at all: the
  known versions of changed clusters' assignments are forgotten so they go out right after (C01).
- Make-before-break as in SotW: a dropped cluster is removed only once the client ACKed the
  snapshot's listeners and routes.

Planning looks only at what can differ: once a type is in step with a snapshot (``synced``), the
next plan checks the names :meth:`~xds_server.snapshot.Snapshot.changed_since` that one (computed
once for all streams), not every resource.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from envoy.service.discovery.v3 import discovery_pb2

from xds_server.ads.common import WILDCARD_TYPES, AckState, StreamBase, rewarm_clusters, routing_settled
from xds_server.ads.push import Push, WireCache
from xds_server.snapshot import CLUSTER_TYPE, ENDPOINT_TYPE, Resource, Snapshot

WILDCARD = "*"


@dataclass
class DeltaTypeState(AckState):
    """Per-type delta protocol state of one stream.

    ``known``: name -> version the client has (as far as the server knows); ``subscribed``: names
    subscribed explicitly; ``rewarm``: names to send whatever version the client reports (EDS of
    a cluster that CDS changed before the EDS request arrived); ``nonces``: nonce ->
    ``system_version_info`` of responses not yet answered; ``sent_type_version``:
    ``system_version_info`` of the last response; ``synced``: the resources (a snapshot's
    :meth:`~xds_server.snapshot.Snapshot.of`) that ``known`` is in step with (every wanted name at
    its version, no removal held back), None when unknown.
    """

    wildcard: bool = False
    subscribed: set[str] = field(default_factory=set)
    known: dict[str, str] = field(default_factory=dict)
    rewarm: set[str] = field(default_factory=set)
    nonces: dict[str, str] = field(default_factory=dict)
    sent_type_version: str | None = None
    synced: Mapping[str, Resource] | None = None

    def pending_nonces(self) -> list[str]:
        """Nonces sent and not yet ACKed or NACKed, oldest first."""
        return list(self.nonces)

    def wants(self, name: str) -> bool:
        """True when the client is subscribed to ``name`` (explicitly or by wildcard)."""
        return self.wildcard or name in self.subscribed


class DeltaStream(StreamBase):
    """Protocol state of one delta ADS stream; feed it requests, ask it what to send."""

    protocol = "delta"

    def __init__(self, nonces: WireCache | None = None) -> None:
        super().__init__(nonces)
        self.types: dict[str, DeltaTypeState] = {}

    def on_request(self, req: discovery_pb2.DeltaDiscoveryRequest) -> str:
        """Apply one DeltaDiscoveryRequest. Returns "initial" (first of its type), "subscribe",
        "ack", "nack" or "stale" (answers a nonce that is not pending; subscription changes in it
        still apply)."""
        st = self.types.setdefault(req.type_url, DeltaTypeState())
        first = not st.requested
        st.requested = True
        subscribe, unsubscribe = list(req.resource_names_subscribe), list(req.resource_names_unsubscribe)
        if first or subscribe or unsubscribe:
            st.synced = None
        if first:
            st.known.update({n: v for n, v in req.initial_resource_versions.items() if n not in st.rewarm})
            if req.type_url in WILDCARD_TYPES and not subscribe:
                st.wildcard = True
        for name in subscribe:
            if name == WILDCARD:
                st.wildcard = True
                continue
            if not st.wants(name) and (name not in req.initial_resource_versions or name in st.rewarm):
                st.known.pop(name, None)
            st.subscribed.add(name)
        for name in unsubscribe:
            if name == WILDCARD:
                st.wildcard = False
                continue
            st.subscribed.discard(name)
            if not st.wildcard:
                st.known.pop(name, None)
        if not req.response_nonce:
            return "initial" if first else "subscribe"
        version = st.nonces.pop(req.response_nonce, None)
        if version is None:
            return "stale"
        if req.HasField("error_detail"):
            st.record_nack(req.error_detail.message)
            return "nack"
        st.record_ack(version)
        return "ack"

    def _respond(self, type_url: str, st, snap: Snapshot):
        return self._diff(type_url, st, snap)

    def _diff(self, type_url: str, st: DeltaTypeState, snap: Snapshot) -> Push | None:
        resources = snap.of(type_url)
        if st.synced is resources:
            return None
        changed, versions, removed = self._changes(type_url, st, snap, resources)
        st.synced = resources
        if type_url == CLUSTER_TYPE:
            if removed and not routing_settled(self.types, snap):
                removed = []  # make-before-break: the routes that used them go first
                st.synced = None
            eds = self.types.setdefault(ENDPOINT_TYPE, DeltaTypeState())
            for name in rewarm_clusters(st.known, changed):
                eds.known.pop(name, None)
                eds.rewarm.add(name)
                eds.synced = None
        if st.rewarm:
            st.rewarm -= changed.keys()
        if not changed and not removed:
            return None
        st.known.update(versions)
        for name in removed:
            del st.known[name]
        version = snap.versions.get(type_url, "")
        push = self._push(type_url, version, tuple(changed.values()), tuple(removed))
        st.nonces[push.nonce] = version
        st.sent_type_version = version
        return push

    @staticmethod
    def _changes(type_url: str, st: DeltaTypeState, snap: Snapshot, resources: Mapping[str, Resource]
                 ) -> tuple[Mapping[str, Resource], Mapping[str, str], list[str]]:
        """What the client lacks of ``resources`` (the snapshot's of ``type_url``), ``{name: Resource}``
        in the snapshot's order, their ``{name: version}``, and the names it has that are gone (CDS,
        LDS only: for EDS and RDS the client unsubscribes itself when the cluster or listener goes)."""
        wildcard_type = type_url in WILDCARD_TYPES
        if st.synced is None:
            changed = {n: r for n, r in resources.items() if st.wants(n) and st.known.get(n) != r.version}
            removed = [n for n in st.known if n not in resources and st.wants(n)] if wildcard_type else []
            return changed, _versions(changed), removed
        changes = snap.changed_since(type_url, st.synced)
        wildcard, subscribed, known = st.wildcard, st.subscribed, st.known
        if (not (wildcard_type and changes.removed)
                and (wildcard or subscribed.issuperset(changes.updated))
                and (not changes.added if wildcard else subscribed.isdisjoint(changes.added))):
            return changes.updated, changes.versions, []  # known holds every wanted name at its synced version
        changed, removed = {}, []
        for name in changes.names:
            if not wildcard and name not in subscribed:
                continue
            res = resources.get(name)
            if res is None:
                if wildcard_type and name in known:
                    removed.append(name)
            elif known.get(name) != res.version:
                changed[name] = res
        return changed, _versions(changed), removed


def _versions(resources: Mapping[str, Resource]) -> dict[str, str]:
    """``{name: version}`` of ``resources``."""
    return {name: res.version for name, res in resources.items()}
