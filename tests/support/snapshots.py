"""Snapshots made straight from messages, for tests of the ADS layer."""

from __future__ import annotations

from collections.abc import Mapping

from envoy.config.endpoint.v3 import endpoint_pb2
from google.protobuf.message import Message

from xds_server.snapshot import ENDPOINT_TYPE, Snapshot, resource, snapshot_of


def make_snapshot(messages: Mapping[str, Mapping[str, Message]]) -> Snapshot:
    """A :class:`Snapshot` from ``{type_url: {name: message}}`` (versions computed as in production)."""
    return snapshot_of({t: {n: resource(n, m) for n, m in ms.items()} for t, ms in messages.items()})


def assignments_of(snap: Snapshot) -> dict[str, endpoint_pb2.ClusterLoadAssignment]:
    """Every ClusterLoadAssignment of ``snap``, parsed, by cluster name."""
    return {name: res.message() for name, res in snap.of(ENDPOINT_TYPE).items()}
