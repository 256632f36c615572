"""The built-in plugin set, in the order the pipeline runs them: the one module that imports every plugin.

Adding a plugin: write its module (see :mod:`.plugin`) and add its ``PLUGIN`` to one tuple here.
Config keys under ``engine.filters`` / ``engine.scorers`` / ``engine.factors`` are these names.
"""

from __future__ import annotations

from types import MappingProxyType

from tests.support.reference_engine.factors import balance, capacity, gpu_memory, max_concurrency, slow_start
from tests.support.reference_engine.filters import latency_outlier, oom
from tests.support.reference_engine.plugin import PluginSet
from tests.support.reference_engine.scorers import concurrency, errors, idle_compute, kv_cache, latency, memory, queue


def _by_name(*plugins):
    return MappingProxyType({p.name: p for p in plugins})


BUILTIN = PluginSet(
    filters=_by_name(oom.PLUGIN, latency_outlier.PLUGIN),
    scorers=_by_name(idle_compute.PLUGIN, concurrency.PLUGIN, latency.PLUGIN, queue.PLUGIN, memory.PLUGIN,
                     kv_cache.PLUGIN, errors.PLUGIN),
    factors=_by_name(capacity.PLUGIN, gpu_memory.PLUGIN, max_concurrency.PLUGIN, slow_start.PLUGIN,
                     balance.PLUGIN),
)
