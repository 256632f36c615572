"""Every engine plugin, by name, in the order the pipeline runs them.

Adding a plugin: write its module (see :mod:`.plugin`) and add its ``PLUGIN`` to one tuple here.
Config keys under ``engine.filters`` / ``engine.scorers`` / ``engine.factors`` are these names.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from xds_server.engine.factors import balance, capacity, slow_start
from xds_server.engine.filters import gpu_memory, latency_outlier, max_concurrency, oom
from xds_server.engine.plugin import Factor, Filter, Scorer
from xds_server.engine.scorers import concurrency, errors, idle_compute, kv_cache, latency, memory, queue

FILTERS: Mapping[str, Filter] = MappingProxyType({p.name: p for p in (
    gpu_memory.PLUGIN, max_concurrency.PLUGIN, oom.PLUGIN, latency_outlier.PLUGIN,
)})
SCORERS: Mapping[str, Scorer] = MappingProxyType({p.name: p for p in (
    idle_compute.PLUGIN, concurrency.PLUGIN, latency.PLUGIN, queue.PLUGIN, memory.PLUGIN, kv_cache.PLUGIN,
    errors.PLUGIN,
)})
FACTORS: Mapping[str, Factor] = MappingProxyType({p.name: p for p in (
    capacity.PLUGIN, slow_start.PLUGIN, balance.PLUGIN,
)})


def plugin(name: str) -> Filter | Scorer | Factor:
    """The plugin called ``name`` (plugin names are unique across kinds). Raises KeyError."""
    for table in (FILTERS, SCORERS, FACTORS):
        if name in table:
            return table[name]
    raise KeyError(name)
