"""A ClusterLoadAssignment's endpoints read flat, in bulk, for the picker's endpoint view (:mod:`ext_proc.view`).

:func:`assignment_endpoints` gives, per ``LocalityLbEndpoints`` in order, a :data:`Locality`: its
priority, its metadata and, per ``LbEndpoint`` in order, the endpoint's name, health, weight and
metadata. It walks the assignment's bytes (serialising it first when given the message) with the compiled decoder
``ext_proc._wire.assignment_endpoints`` (``ext_proc/_wire.c``) when it is built and accepts them,
else it reads the message with protobuf (:func:`assignment_endpoints_py`); the two give the same
(``tests/unit/ext_proc/test_eds_wire.py``). Reading 60 000 endpoints of one locality: 136 ms with
protobuf's attribute reads (a Python object per nested message), 25 ms serialised and compiled
(medians of 7, ``time.process_time``, on the shared 2-core machine; each C call holds the GIL for
at most ~10 ms of it).
"""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from google.protobuf.message import DecodeError

__all__ = ["DECODER", "Assignment", "Locality", "assignment_endpoints", "assignment_endpoints_py", "cluster_name"]

Assignment = endpoint_pb2.ClusterLoadAssignment | bytes
"""A ClusterLoadAssignment, as the message or as its serialised bytes (what the control plane's
snapshot holds, and what an EDS response carries: read as bytes, nothing is parsed or serialised
on the way)."""

Locality = tuple[int, base_pb2.Metadata | None, list[str | None], list[int], list[int], list[base_pb2.Metadata | None]]
"""``(priority, metadata, names, health, weights, metadata of each)`` of one ``LocalityLbEndpoints``:
``metadata`` None when unset; per ``LbEndpoint``: its name ``"HOST:PORT"`` (an IPv6 host in
brackets; None when it has no host or no ``port_value``), its ``health_status`` (enum number), its
``load_balancing_weight.value`` (0 when unset) and its metadata (None when unset)."""


def _varint(data: bytes, i: int) -> tuple[int, int]:
    """The base-128 varint at ``data[i:]`` and the index after it (protobuf's encoding guide)."""
    value = shift = 0
    for _ in range(10):
        if i >= len(data):
            break
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7
    raise DecodeError("truncated or overlong varint")


def cluster_name(data: bytes) -> str:
    """The ``cluster_name`` (field 1) of a serialised ClusterLoadAssignment, read without parsing the
    rest: its top-level fields are skipped by their wire type (a few: one per locality), so an EDS
    response's resource can stay bytes (:data:`Assignment`). The last occurrence wins, as protobuf
    merges a repeated singular field; "" when absent.

    >>> cluster_name(endpoint_pb2.ClusterLoadAssignment(cluster_name="chat-v1").SerializeToString())
    'chat-v1'

    Raises:
        google.protobuf.message.DecodeError: ``data`` is not a well-formed message at its top level,
            or the name is not UTF-8.
    """
    name, i, n = b"", 0, len(data)
    while i < n:
        key, i = _varint(data, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            _, i = _varint(data, i)
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        elif wire == 2:
            size, i = _varint(data, i)
            if field == 1:
                name = data[i:i + size]
            i += size
        else:
            raise DecodeError(f"wire type {wire} at the top level of a ClusterLoadAssignment")
        if field == 0:
            raise DecodeError("field number 0")
    if i > n:
        raise DecodeError("truncated ClusterLoadAssignment")
    try:
        return name.decode()
    except UnicodeDecodeError as err:
        raise DecodeError(f"cluster_name is not UTF-8: {err}") from None


def _name(lb: endpoint_pb2.LbEndpoint) -> str | None:
    sock = lb.endpoint.address.socket_address
    host, port = sock.address, sock.port_value
    if not host or (not port and sock.WhichOneof("port_specifier") != "port_value"):
        return None
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def assignment_endpoints_py(assignment: endpoint_pb2.ClusterLoadAssignment) -> list[Locality]:
    """:func:`assignment_endpoints` read with protobuf."""
    out = []
    for loc in assignment.endpoints:
        lbs = loc.lb_endpoints
        out.append((loc.priority, loc.metadata if loc.HasField("metadata") else None, [_name(lb) for lb in lbs],
                    [lb.health_status for lb in lbs], [lb.load_balancing_weight.value for lb in lbs],
                    [lb.metadata if lb.HasField("metadata") else None for lb in lbs]))
    return out


def _compiled(data: bytes) -> list[Locality] | None:
    raw = _wire.assignment_endpoints(data)
    if raw is None:
        return None
    parsed: dict[bytes, base_pb2.Metadata] = {}  # endpoints that differ from their locality share a few

    def metadata(data: bytes | None) -> base_pb2.Metadata | None:
        if data is None:
            return None
        meta = parsed.get(data)
        if meta is None:
            meta = parsed[data] = base_pb2.Metadata.FromString(data)
        return meta

    out = []
    for priority, meta, names, health, weights, metas in raw:
        own = metas if metas.count(None) == len(metas) else [metadata(m) for m in metas]
        out.append((priority, metadata(meta), names, health, weights, own))
    return out


def assignment_endpoints(assignment: Assignment) -> list[Locality]:
    """The :data:`Locality` of each of ``assignment``'s localities, in order (compiled when built).

    Raises:
        google.protobuf.message.DecodeError: ``assignment`` is bytes that are not a ClusterLoadAssignment.
    """
    data = assignment if isinstance(assignment, bytes) else None
    if _wire is not None:
        out = _compiled(assignment.SerializeToString() if data is None else data)
        if out is not None:
            return out
    return assignment_endpoints_py(assignment if data is None else endpoint_pb2.ClusterLoadAssignment.FromString(data))


try:
    from ext_proc import _wire
except ImportError as err:  # not built (no C compiler where the package was installed)
    _wire = None
    DECODER = f"pure Python (ext_proc._wire not built: {err})"
else:
    DECODER = "compiled (ext_proc._wire)"
