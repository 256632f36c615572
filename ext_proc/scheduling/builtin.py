"""The built-in per-request scheduling plugins: the one module that imports every one and registers it.

Adding a built-in: write its module under :mod:`ext_proc.scheduling.plugins` and add its class to
:data:`BUILTIN`. A plugin of your own needs no change here: register it from your module
(:func:`ext_proc.scheduling.register`) and name the module in ``picker.plugin_modules``.
"""

from __future__ import annotations

from ext_proc.scheduling.plugins.affinity_slack import AffinitySlack
from ext_proc.scheduling.plugins.bounded_load import BoundedLoad
from ext_proc.scheduling.plugins.failed_endpoints import FailedEndpoints
from ext_proc.scheduling.plugins.least_loaded import LeastLoaded
from ext_proc.scheduling.plugins.max_score import MaxScore
from ext_proc.scheduling.plugins.memory_admission import MemoryAdmission
from ext_proc.scheduling.plugins.predicted_latency import PredictedLatency
from ext_proc.scheduling.plugins.prefix_cache import PrefixCache
from ext_proc.scheduling.plugins.ring_affinity import RingAffinity
from ext_proc.scheduling.plugins.session_affinity import SessionAffinity
from ext_proc.scheduling.registry import REGISTRY

__all__ = ["BUILTIN"]

#: Filters, scorers, pickers.
BUILTIN = (FailedEndpoints, MemoryAdmission, BoundedLoad, AffinitySlack, LeastLoaded, SessionAffinity,
           RingAffinity, PrefixCache, PredictedLatency, MaxScore)

for _plugin in BUILTIN:
    REGISTRY.register(_plugin)
