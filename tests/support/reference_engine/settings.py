"""YAML plugin sections -> validated plugin parameters, and config -> :class:`EngineParams`.

``engine.filters`` and ``engine.factors``: ``{name: mapping of params}``, ``{name: true}`` (defaults)
or ``{name: false}`` (off). ``engine.scorers``: ``{name: weight}`` or ``{name: {weight: W, <params>}}``
(weight >= 0; 0 = off). Unknown names and bad parameters raise ``ValueError`` naming them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from pydantic import ValidationError

from tests.support.reference_engine.builtin import BUILTIN
from xds_server.engine.types import EngineParams


def _key(part: object) -> str:
    """A location part as one line: odd keys (spaces, control characters, empty) quoted."""
    text = str(part)
    return text if re.fullmatch(r"[A-Za-z0-9_-]+", text) else repr(text)


def _params(kind: str, name: str, cls: type, raw: Mapping[str, Any]) -> Any:
    try:
        return cls.model_validate(dict(raw))
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(_key(p) for p in e['loc']) or name}: {e['msg']}" for e in err.errors())
        raise ValueError(f"{kind}.{name}: {problems}") from None


#: Plugins that changed kind: a clear error instead of "unknown" (saturation is not health, issue 13).
MOVED = {("filters", "gpu_memory"): "factors", ("filters", "max_concurrency"): "factors"}


def _known(kind: str, name: object, table: Mapping[str, Any]) -> str:
    moved = MOVED.get((kind, name)) if isinstance(name, str) else None
    if moved is not None:
        raise ValueError(f"{kind}.{name} is now engine.{moved}.{name}: momentary saturation no longer excludes an "
                         f"endpoint (the picker admits each request); the slow loop only lowers the weight of an "
                         f"endpoint persistently short")
    if not isinstance(name, str) or name not in table:
        raise ValueError(f"unknown {kind[:-1]} {name!r}; known: {sorted(table)}")
    return name


def parse_switchable(kind: str, raw: Mapping[str, Any] | None) -> dict[str, Any]:
    """``engine.filters`` / ``engine.factors`` -> ``{name: params model or False}``.

    Raises:
        ValueError: unknown name, or a value that is neither a bool nor a mapping of valid params.
    """
    table = BUILTIN.filters if kind == "filters" else BUILTIN.factors
    out: dict[str, Any] = {}
    for name, value in (raw or {}).items():
        _known(kind, name, table)
        if value is False:
            out[name] = False
        elif value is True or value is None:
            out[name] = table[name].params()
        elif isinstance(value, Mapping):
            out[name] = _params(kind, name, table[name].params, value)
        else:
            raise ValueError(f"{kind}.{name}: expected a mapping of parameters, true or false, got {value!r}")
    return out


def parse_scorers(raw: Mapping[str, Any] | None) -> dict[str, tuple[float, Any]]:
    """``engine.scorers`` -> ``{name: (weight, params model)}`` for the scorers named.

    Raises:
        ValueError: unknown name, a negative or non-numeric weight, or bad parameters.
    """
    out: dict[str, tuple[float, Any]] = {}
    for name, value in (raw or {}).items():
        _known("scorers", name, BUILTIN.scorers)
        params: Mapping[str, Any] = {}
        if isinstance(value, Mapping):
            params = {k: v for k, v in value.items() if k != "weight"}
            value = value.get("weight", BUILTIN.scorers[name].default_weight)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise ValueError(f"scorers.{name}: the weight must be a number >= 0, got {value!r}")
        out[name] = (float(value), _params("scorers", name, BUILTIN.scorers[name].params, params))
    return out


#: Plugins off unless the config names them: ``balance`` nudges request-rate shares toward the weight
#: shares, which fights the picker now that it decides every request from its live in-flight load
#: (a slower GPU rightly gets fewer requests per unit of weight; balance would inflate its weight).
DEFAULT_OFF = frozenset({"balance"})


def engine_params(
    *, stale_after_s: float, request_memory_mib: float, memory_margin: float, max_weight: int, hysteresis: float,
    quantum: float, max_change: float | None, drain_timeout_s: float, filters: Mapping[str, Any],
    scorers: Mapping[str, tuple[float, Any]], factors: Mapping[str, Any], health_rounds: int = 2,
) -> EngineParams:
    """:class:`EngineParams` from validated config values (``filters``/``factors`` from
    :func:`parse_switchable`, ``scorers`` from :func:`parse_scorers`)."""
    weights = {name: w for name, (w, _) in scorers.items()}
    plugin_params: dict[str, Any] = {name: p for name, (_, p) in scorers.items()}
    disabled = set(DEFAULT_OFF - set(factors))
    for table in (filters, factors):
        for name, value in table.items():
            if value is False:
                disabled.add(name)
            else:
                plugin_params[name] = value
    return EngineParams(
        stale_after_s=stale_after_s, request_memory_mib=request_memory_mib, memory_margin=memory_margin,
        max_weight=max_weight, hysteresis=hysteresis, scorer_weights=MappingProxyType(weights), quantum=quantum,
        max_change=max_change, drain_timeout_s=drain_timeout_s, plugin_params=MappingProxyType(plugin_params),
        disabled=frozenset(disabled), health_rounds=health_rounds,
    )
