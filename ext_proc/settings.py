"""The picker's settings as they travel over xDS: routing table + process settings <-> a JSON object.

The control plane writes them into the metadata of the ``inferlb_ext_proc`` cluster
(``filter_metadata["inferlb.picker"]``), so a picker that subscribes over ADS (``inferlb ext-proc
--xds``) needs no config of its own: Envoy and every picker read one source of truth.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from ext_proc.view import RequestClass, RoutingTable, ServiceRoute

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
        memory_queue: a request no endpoint has GPU memory for waits in the queue, then gets a
            429 (False: it is pinned to the endpoint with the most estimated free memory).
        pin_move_after: spills in a row that move a session's pin.
        failure_hold_s: an endpoint whose connections fail is not picked for this long (s).
        cost_forget, cost_min_samples: the cost model's forgetting factor and samples per class
            before its fit is used (:class:`ext_proc.costmodel.CostModel`).
        shared_view: decide on the sum of every picker's live load (:mod:`ext_proc.shared_load`);
            False: on this picker's load alone (it still reports and gets memory samples).
        shared_view_interval_s: a change of the load is reported at most this often (s).
        shared_view_expiry_s: a view older than this is dropped (s).
    """

    inflight_expiry_s: float
    session_ttl_s: float
    max_sessions: int
    admission: bool
    max_queue: int
    queue_timeout_s: float
    retry_after_s: int
    memory_queue: bool
    pin_move_after: int
    failure_hold_s: float
    cost_forget: float
    cost_min_samples: int
    shared_view: bool
    shared_view_interval_s: float
    shared_view_expiry_s: float


def to_wire(routing: RoutingTable, settings: PickerSettings) -> dict[str, Any]:
    """A JSON-able object carrying ``routing`` and ``settings`` (numbers, strings, lists, objects)."""
    services = [
        {
            "name": s.name,
            "hosts": list(s.hosts),
            "default_version": s.default_version,
            "clusters": dict(s.clusters),
            "mixes": {m: [[upto, cluster] for upto, cluster in buckets] for m, buckets in s.mixes.items()},
            "models": sorted(m.decode() for m in s.models),
            "unavailable": sorted(s.unavailable),
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
            "memory_margin": routing.memory_margin,
            "default_request_mib": routing.default_request_mib,
            "kv_mib_per_token": routing.kv_mib_per_token,
            "default_max_tokens": routing.default_max_tokens,
            "chars_per_token": routing.chars_per_token,
            "request_memory_header": routing.request_memory_header or "",
            "request_class_header": routing.request_class_header,
            "request_classes": {k.decode(): {"memory_mib": c.memory_mib, "prompt_tokens": c.prompt_tokens,
                                             "output_tokens": c.output_tokens}
                                for k, c in routing.request_classes.items()},
            "prefix_messages": routing.prefix_messages,
            "prefix_max_bytes": routing.prefix_max_bytes,
            "prefix_cache_tokens": routing.prefix_cache_tokens,
            "body_mode": routing.body_mode,
            "min_bound": routing.min_bound,
            "pinned_load_factor": routing.pinned_load_factor,
            "affinity_slack": routing.affinity_slack,
            "cost_aware_affinity": routing.cost_aware_affinity,
            "spill_threshold": routing.spill_threshold,
            "protocol": routing.protocol,
        },
        "settings": asdict(settings),
    }


def _opt(value: Any) -> float | None:
    return None if value is None else float(value)


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
            models=frozenset(m.encode() for m in s.get("models", ())),
            unavailable=frozenset(s.get("unavailable", ())),
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
        memory_margin=float(r.get("memory_margin", 0.2)),
        default_request_mib=float(r.get("default_request_mib", 2048.0)),
        kv_mib_per_token=float(r.get("kv_mib_per_token", 0.5)),
        default_max_tokens=int(r.get("default_max_tokens", 128)),
        chars_per_token=float(r.get("chars_per_token", 4.0)),
        request_memory_header=r.get("request_memory_header") or None,
        request_class_header=r.get("request_class_header", "x-inferlb-request-class"),
        request_classes={k: RequestClass(float(c["memory_mib"]), _opt(c.get("prompt_tokens")),
                                         _opt(c.get("output_tokens")))
                         for k, c in r.get("request_classes", {}).items()},
        prefix_messages=int(r.get("prefix_messages", 2)),
        prefix_max_bytes=int(r.get("prefix_max_bytes", 4096)),
        prefix_cache_tokens=int(r.get("prefix_cache_tokens", 0)),  # an older control plane: no index
        body_mode=r.get("body_mode", "buffered"),
        min_bound=float(r.get("min_bound", 2.0)),
        pinned_load_factor=float(r.get("pinned_load_factor", 2.0)),
        affinity_slack=_opt(r.get("affinity_slack")),
        cost_aware_affinity=bool(r.get("cost_aware_affinity", False)),
        spill_threshold=float(r.get("spill_threshold", 0.6)),
        protocol=r.get("protocol", "inferlb"),
    )
    raw = doc["settings"]
    kinds = {f.name: f.type for f in fields(PickerSettings)}
    values = {k: (int(v) if kinds[k] == "int" else bool(v) if kinds[k] == "bool" else float(v))
              for k, v in raw.items() if k in kinds}
    return routing, PickerSettings(**values)
