"""EDS: one ClusterLoadAssignment per inference cluster from the engine's weights (pure).

The assignment is written straight in protobuf's wire format from pieces that only change with
the endpoints and the config (:class:`AssignmentLayout`): each endpoint's address and metadata are
encoded once, and a round encodes only the weights and health. At 60 000 endpoints in one cluster,
building the message by attribute assignment and serialising it took 0.17 s; encoding the bytes
took 32–40 ms (2026-12-03) and parsing them into the message 12–24 ms (2026-12-02)
(``time.process_time``, new random weights each time). The bytes are the
ones protobuf's deterministic serialisation of that message gives
(``tests/unit/xds_server/test_endpoint_encoding.py`` compares them with the plain construction).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from itertools import chain
from operator import add

from envoy.config.core.v3 import base_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2

from xds_server.config import split_hostport
from xds_server.engine.types import DRAINING, HEALTHY, UNHEALTHY, EndpointWeight
from xds_server.wire import BYTE, delimited, varint

#: EDS priority of each tier (0 is the highest: Envoy's first choice).
TIER_PRIORITY = {"edge": 0, "cloud": 1}

# LbEndpoint.health_status (field 2, varint), encoded: every engine state is a non-zero enum value,
# so the field is always written.
_HEALTH = {
    HEALTHY: b"\x10" + bytes([health_check_pb2.HEALTHY]),
    UNHEALTHY: b"\x10" + bytes([health_check_pb2.UNHEALTHY]),
    DRAINING: b"\x10" + bytes([health_check_pb2.DRAINING]),
}

# What an endpoint without a value of its own writes when its locality has one: the picker reads
# max_concurrency <= 0 as "not limited" and gpu_class "" as "unknown", as if the field were absent.
_NONE = {"max_concurrency": 0, "gpu_class": ""}

# Wire tags (field number << 3 | wire type 2, length-delimited) of the fields written here.
_CLA_CLUSTER_NAME = 0x0A  # ClusterLoadAssignment.cluster_name = 1
_CLA_ENDPOINTS = 0x12  # ClusterLoadAssignment.endpoints = 2
_LOCALITY_LB_ENDPOINTS = 0x12  # LocalityLbEndpoints.lb_endpoints = 2
_LOCALITY_PRIORITY = 0x28  # LocalityLbEndpoints.priority = 5 (varint)
_LOCALITY_METADATA = 0x4A  # LocalityLbEndpoints.metadata = 9
_LB_ENDPOINT = 0x0A  # LbEndpoint.endpoint = 1 (also Endpoint.address = 1, Address.socket_address = 1)
_LB_METADATA = 0x1A  # LbEndpoint.metadata = 3
_LB_WEIGHT = 0x22  # LbEndpoint.load_balancing_weight = 4 (a UInt32Value: its value = 1 is 0x08)
_SOCKET_ADDRESS = 0x12  # SocketAddress.address = 2
_SOCKET_PORT = 0x18  # SocketAddress.port_value = 3 (varint)


def _endpoint_field(address: str) -> bytes:
    """``LbEndpoint.endpoint`` of ``"HOST:PORT"``, encoded (the port is written even when 0: it is in
    the ``port_specifier`` oneof, so it has presence)."""
    host, port = split_hostport(address)
    sock = (delimited(_SOCKET_ADDRESS, host.encode()) if host else b"") + BYTE[_SOCKET_PORT] + varint(port)
    return delimited(_LB_ENDPOINT, delimited(_LB_ENDPOINT, delimited(_LB_ENDPOINT, sock)))


def _metadata(tag: int, fields: Mapping[str, object]) -> bytes:
    """A ``Metadata`` field holding ``filter_metadata["inferlb"] = fields``, encoded by protobuf."""
    meta = base_pb2.Metadata()
    meta.filter_metadata["inferlb"].update(fields)
    return delimited(tag, meta.SerializeToString(deterministic=True))


class _Level:
    """One locality (one priority) of a layout: where its endpoints are in the input, their fixed
    encoded parts, and the locality's own fields."""

    __slots__ = ("order", "heads", "head_lens", "metas", "tail")

    def __init__(self, order: list[int] | None, heads: list[bytes], metas: list[bytes], tail: bytes) -> None:
        self.order = order  # indices into the round's weights; None: all of them, in order
        self.heads = heads
        self.head_lens = [len(h) for h in heads]
        self.metas = metas
        self.tail = tail


class AssignmentLayout:
    """Everything of one cluster's ClusterLoadAssignment but its weights and health, encoded.

    ``addresses``: the endpoints (``"HOST:PORT"``) in the order the round's weights and health will
    come in; ``max_concurrency`` (address -> requests), ``gpu_class`` (address -> class name) and
    ``tier`` (address -> ``edge`` | ``cloud``; missing = edge): as :func:`build_assignment`.
    ``previous``: an earlier layout whose encoded addresses are reused (the result is the same).

    Per locality, the most common pair of metadata values is written once, as the locality's
    metadata; only an endpoint whose values differ carries its own (the fields that differ; a value
    the endpoint lacks is written as ``max_concurrency`` 0 / ``gpu_class`` ""). The picker reads an
    endpoint's own value, else its locality's (``ext_proc.view.cluster_levels``). Edge endpoints go
    to priority 0, cloud endpoints to priority 1 (Envoy sends a priority traffic only when the
    levels above it are not healthy enough: docs/envoy-facts.md, "Priority levels"); without an
    edge endpoint the cloud endpoints are priority 0 (priorities must run 0..N without a gap).

    Immutable once built; :meth:`encode` may be called from any thread.
    """

    __slots__ = ("cluster", "addresses", "inputs", "_name", "_levels")

    def __init__(self, cluster: str, addresses: Sequence[str], max_concurrency: Mapping[str, int] | None = None,
                 gpu_class: Mapping[str, str] | None = None, tier: Mapping[str, str] | None = None,
                 previous: AssignmentLayout | None = None) -> None:
        self.cluster = cluster
        self.addresses = tuple(addresses)
        self.inputs = (max_concurrency, gpu_class, tier)
        self._name = delimited(_CLA_CLUSTER_NAME, cluster.encode()) if cluster else b""
        reuse = previous._encoded() if previous is not None else {}
        encoded = {a: reuse.get(a) or _endpoint_field(a) for a in self.addresses}
        tiers = [TIER_PRIORITY[tier.get(a, "edge")] if tier else 0 for a in self.addresses]
        used = sorted(set(tiers))
        metas: dict[tuple, bytes] = {}  # one encoding per distinct difference
        self._levels = []
        for level, priority in enumerate(used):
            order = None if len(used) == 1 else [i for i, t in enumerate(tiers) if t == priority]
            members = self.addresses if order is None else [self.addresses[i] for i in order]
            self._levels.append(self._level(level, members, encoded, max_concurrency, gpu_class, metas, order))

    def _encoded(self) -> dict[str, bytes]:
        """``{address: its encoded endpoint field}``, made when asked (a later layout reuses them): kept,
        it would be a second reference table of every endpoint (~5 MB at 60 000)."""
        out: dict[str, bytes] = {}
        for level in self._levels:
            members = self.addresses if level.order is None else map(self.addresses.__getitem__, level.order)
            out.update(zip(members, level.heads, strict=True))
        return out

    def _level(self, priority: int, members: Sequence[str], encoded: Mapping[str, bytes],
               max_concurrency: Mapping[str, int] | None,
               gpu_class: Mapping[str, str] | None, metas: dict[tuple, bytes], order: list[int] | None) -> _Level:
        own: list[dict] = []
        counts: dict[tuple, int] = {}
        for a in members:
            fields = {}
            if max_concurrency and a in max_concurrency:
                fields["max_concurrency"] = max_concurrency[a]
            if gpu_class and a in gpu_class:
                fields["gpu_class"] = gpu_class[a]
            own.append(fields)
            key = tuple(fields.items())
            counts[key] = counts.get(key, 0) + 1
        shared = dict(max(counts, key=lambda k: (counts[k], k)))  # the most common (ties: a fixed choice)
        endpoint_metas = []
        for fields in own:
            if fields == shared:
                endpoint_metas.append(b"")
                continue
            differs = {k: fields.get(k, _NONE[k]) for k in (*shared, *fields) if fields.get(k) != shared.get(k)}
            key = tuple(differs.items())
            if key not in metas:
                metas[key] = _metadata(_LB_METADATA, differs)
            endpoint_metas.append(metas[key])
        # LocalityLbEndpoints in field-number order: lb_endpoints (2), priority (5), metadata (9).
        tail = (BYTE[_LOCALITY_PRIORITY] + varint(priority) if priority else b"") + (
            _metadata(_LOCALITY_METADATA, shared) if shared else b"")
        return _Level(order, [encoded[a] for a in members], endpoint_metas, tail)

    def encode(self, weights: Sequence[int], health: Sequence[str]) -> bytes:
        """The serialized ClusterLoadAssignment with ``weights[i]`` (``load_balancing_weight``, >= 1)
        and ``health[i]`` (HEALTHY, UNHEALTHY or DRAINING) for ``addresses[i]``: the bytes of
        protobuf's deterministic serialisation of the same message. No addresses: the assignment
        without endpoints (Envoy then has the cluster with no hosts instead of waiting for EDS).

        Raises:
            ValueError: a weight < 1 (Envoy NACKs it) — the engine guarantees this never happens.
        """
        if len(weights) != len(self.addresses) or len(health) != len(self.addresses):
            raise ValueError(f"{self.cluster}: {len(weights)} weights and {len(health)} health states "
                             f"for {len(self.addresses)} endpoints")
        if weights and min(weights) < 1:
            i = next(i for i, w in enumerate(weights) if w < 1)
            raise ValueError(f"{self.cluster}/{self.addresses[i]}: load_balancing_weight must be >= 1, "
                             f"got {weights[i]}")
        out = [self._name]
        for level in self._levels:
            order = level.order
            out.append(delimited(_CLA_ENDPOINTS, self._locality(
                level, weights if order is None else [weights[i] for i in order],
                health if order is None else [health[i] for i in order])))
        return b"".join(out)

    @staticmethod
    def _locality(level: _Level, weights: Sequence[int], health: Sequence[str]) -> bytes:
        # Whole-list steps that run in C (map, zip, join) over memoized pieces: an endpoint's tail
        # (health, metadata, weight) and its length prefix are encoded once per distinct value.
        tails = list(map(_tail, health, weights, level.metas))
        prefixes = map(_length_prefix, map(add, level.head_lens, map(len, tails)))
        return b"".join(chain.from_iterable(zip(prefixes, level.heads, tails, strict=True))) + level.tail


@lru_cache(maxsize=1 << 16)
def _tail(health: str, weight: int, meta: bytes) -> bytes:
    """An LbEndpoint's fields after its address: ``health_status``, ``metadata`` (``meta``, encoded)
    and ``load_balancing_weight`` (a UInt32Value: its value is field 1, varint)."""
    return _HEALTH[health] + meta + delimited(_LB_WEIGHT, b"\x08" + varint(weight))


@lru_cache(maxsize=1 << 12)
def _length_prefix(n: int) -> bytes:
    """The tag and length of an ``lb_endpoints`` entry of ``n`` bytes."""
    return BYTE[_LOCALITY_LB_ENDPOINTS] + varint(n)


def build_assignment(cluster: str, weights: Iterable[EndpointWeight],
                     max_concurrency: Mapping[str, int] | None = None,
                     gpu_class: Mapping[str, str] | None = None,
                     tier: Mapping[str, str] | None = None) -> endpoint_pb2.ClusterLoadAssignment:
    """A ClusterLoadAssignment with one locality per priority; each endpoint's weight and health
    from the engine (the layout and metadata rules: :class:`AssignmentLayout`).

    ``max_concurrency`` (address -> requests) and ``gpu_class`` (address -> class name) are
    metadata ``filter_metadata["inferlb"]`` fields for the picker (its admission control and its
    request cost model per GPU class); ``tier``: address -> ``edge`` | ``cloud`` (missing = edge).

    Raises:
        ValueError: a weight < 1 (Envoy NACKs it) — the engine guarantees this never happens.
    """
    weights = list(weights)
    layout = AssignmentLayout(cluster, [w.address for w in weights], max_concurrency, gpu_class, tier)
    return endpoint_pb2.ClusterLoadAssignment.FromString(
        layout.encode([w.weight for w in weights], [w.health for w in weights]))
