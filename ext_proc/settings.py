"""The picker's settings as they travel over xDS: routing table + process settings <-> a JSON object.

The control plane writes them into the metadata of the ``inferlb_ext_proc`` cluster
(``filter_metadata["inferlb.picker"]``), so a picker that subscribes over ADS (``inferlb ext-proc
--xds``) needs no config of its own: Envoy and every picker read one source of truth.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from ext_proc.view import RoutingTable, ServiceRoute

__all__ = ["METADATA_KEY", "PickerSettings", "from_wire", "to_wire"]

METADATA_KEY = "inferlb.picker"


@dataclass(frozen=True)
class PickerSettings:
    """Per-process picker settings (units: seconds, counts). No defaults here: the app builds them from
    the config (``inferlb.picker_config.picker_settings``), whose defaults are the only ones.

    Attributes:
        inflight_expiry_s: a pick without completion after this long counts as finished.
        session_ttl_s, max_sessions: the session table's idle TTL and size bound.
        admission: admission control on or off; ``max_queue``, ``queue_timeout_s`` and
            ``retry_after_s`` as in :class:`ext_proc.admission.Admission`.
    """

    inflight_expiry_s: float
    session_ttl_s: float
    max_sessions: int
    admission: bool
    max_queue: int
    queue_timeout_s: float
    retry_after_s: int


def to_wire(routing: RoutingTable, settings: PickerSettings) -> dict[str, Any]:
    """A JSON-able object carrying ``routing`` and ``settings`` (numbers, strings, lists, objects)."""
    services = [
        {
            "name": s.name,
            "hosts": list(s.hosts),
            "default_version": s.default_version,
            "clusters": dict(s.clusters),
            "mixes": {m: [[upto, cluster] for upto, cluster in buckets] for m, buckets in s.mixes.items()},
        }
        for s in routing.services
    ]
    return {
        "routing": {
            "version_header": routing.version_header,
            "session_headers": list(routing.session_headers),
            "session_cookie": routing.session_cookie or "",
            "body_max_bytes": routing.body_max_bytes,
            "override_host_header": routing.override_host_header,
            "cluster_header": routing.cluster_header,
            "vnodes": routing.vnodes,
            "load_factor": routing.load_factor,
            "services": services,
        },
        "settings": asdict(settings),
    }


def from_wire(doc: dict[str, Any]) -> tuple[RoutingTable, PickerSettings]:
    """Read what :func:`to_wire` wrote (numbers may come back as floats: protobuf Struct).

    Raises:
        ValueError / KeyError / TypeError: the object is not a valid picker configuration.
    """
    r = doc["routing"]
    services = tuple(
        ServiceRoute(
            name=s["name"],
            hosts=tuple(s["hosts"]),
            default_version=s["default_version"],
            clusters=dict(s["clusters"]),
            mixes={m: tuple((int(upto), cluster) for upto, cluster in buckets) for m, buckets in s["mixes"].items()},
        )
        for s in r["services"]
    )
    routing = RoutingTable(
        version_header=r["version_header"],
        session_headers=tuple(r["session_headers"]),
        session_cookie=r["session_cookie"] or None,
        body_max_bytes=int(r["body_max_bytes"]),
        override_host_header=r["override_host_header"],
        cluster_header=r["cluster_header"],
        vnodes=int(r["vnodes"]),
        load_factor=float(r["load_factor"]),
        services=services,
    )
    raw = doc["settings"]
    kinds = {f.name: f.type for f in fields(PickerSettings)}
    values = {k: (int(v) if kinds[k] == "int" else bool(v) if kinds[k] == "bool" else float(v))
              for k, v in raw.items() if k in kinds}
    return routing, PickerSettings(**values)
