"""The picker's settings as they travel over xDS: routing table + process settings <-> a JSON object.

The control plane writes them into the metadata of the ``inferlb_ext_proc`` cluster
(``filter_metadata["inferlb.picker"]``), so a picker that subscribes over ADS (``inferlb ext-proc
--xds``) needs no config of its own: Envoy and every picker read one source of truth.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields, is_dataclass
from functools import cache
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

from ext_proc.scheduling import Profile, build_profile, import_plugins
from ext_proc.view import RoutingTable

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
        prefix_source: what feeds the prefix-cache index: "routing" (the picker's picks:
            :class:`ext_proc.prefix_index.PrefixIndex`) or "kv_events" (the engines' KV-cache events:
            :class:`ext_proc.prefix_events.EventIndex`, its subscriber :class:`ext_proc.kv_events.KvEventFeed`).
        kv_events_endpoint: each endpoint's event publisher, a template of ``{host}``, ``{port}``,
            ``{port+N}`` (:func:`ext_proc.kv_events.publisher_address`).
        kv_events_topic: the publishers' topic.
        pending_s: how long a pick counts its prompt's blocks as held before events confirm them (s).
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
    prefix_source: str
    kv_events_endpoint: str
    kv_events_topic: str
    pending_s: float


def to_wire(routing: RoutingTable, settings: PickerSettings) -> dict[str, Any]:
    """A JSON-able object carrying ``routing`` and ``settings`` (numbers, strings, lists, objects),
    derived from their fields: every init field of :class:`RoutingTable`, :class:`ServiceRoute` and
    :class:`RequestClass`, each profile as its steps (:meth:`ext_proc.scheduling.Profile.wire`)."""
    return {"routing": _out(routing), "settings": _out(settings)}


def from_wire(doc: dict[str, Any]) -> tuple[RoutingTable, PickerSettings]:
    """Read what :func:`to_wire` wrote (numbers may come back as floats: protobuf Struct), each value
    read by its field's type; a field missing keeps its default. The routing table's
    ``plugin_modules`` are imported before its profiles are built.

    Raises:
        ValueError / KeyError / TypeError: the object is not a valid picker configuration (an
            unknown plugin, a plugin module that cannot be imported, bad parameters, bad values).
    """
    r = dict(doc["routing"])
    import_plugins([str(m) for m in r.get("plugin_modules", ())])
    profiles = {name: build_profile(steps, name) for name, steps in r.pop("profiles", {}).items()}
    if profiles:
        r["profiles"] = profiles
    return _in(RoutingTable, r), _in(PickerSettings, doc["settings"])


def _out(value: Any) -> Any:
    """``value`` as JSON-able data: dataclasses as objects of their init fields, profiles as their
    steps, bytes as text, sets sorted, tuples as lists."""
    if isinstance(value, Profile):
        return value.wire()
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _out(getattr(value, f.name)) for f in fields(value) if f.init}
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, Mapping):
        return {_out(k): _out(v) for k, v in value.items()}
    if isinstance(value, frozenset | set):
        return sorted(_out(v) for v in value)
    if isinstance(value, tuple | list):
        return [_out(v) for v in value]
    return value


@cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls, vars(sys.modules[cls.__module__]))


def _in(kind: Any, value: Any) -> Any:
    """``value`` (from :func:`_out`, through JSON) read as type ``kind``."""
    origin, args = get_origin(kind), get_args(kind)
    if origin is UnionType or origin is Union:
        if value is None:
            return None
        kind = next(a for a in args if a is not type(None))
        origin, args = get_origin(kind), get_args(kind)
    if kind is Profile:  # built already (from_wire: its name is its key)
        return value
    if is_dataclass(kind):
        hints = _hints(kind)
        names = {f.name for f in fields(kind) if f.init}
        return kind(**{k: _in(hints[k], v) for k, v in value.items() if k in names})
    if kind is bytes:
        return value.encode()
    if kind is int or kind is float or kind is str or kind is bool:
        return kind(value)
    if origin is tuple:
        return tuple(_in(args[0], v) for v in value)
    if origin is frozenset:
        return frozenset(_in(args[0], v) for v in value)
    if origin is Mapping or origin is dict:
        return {_in(args[0], k): _in(args[1], v) for k, v in value.items()}
    return _frozen(value)


def _frozen(value: Any) -> Any:
    """Untyped data (``Any``) with lists as tuples, at every depth."""
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return {k: _frozen(v) for k, v in value.items()}
    return value
