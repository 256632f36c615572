"""``memory``: GPU-memory headroom ``(free - need) / (total - need)``, 0–1.

``need`` is a request plus the margin (``engine.request_memory_mib x (1 + memory_margin)``), ``total``
the endpoint's configured GPU memory, ``free`` as the ``gpu_memory`` factor reads it. Bigger GPUs
score higher, which is why the default weight is small (0.25).
"""

from __future__ import annotations

from tests.support.reference_engine.inputs import free_mib, needed_mib
from tests.support.reference_engine.plugin import ClusterRound, Member, NoParams, clamp01, per_endpoint_scorer


def _score(m: Member, _: NoParams, rnd: ClusterRound) -> float | None:
    free, need = free_mib(m), needed_mib(rnd)
    if free is None:
        return None
    room = m.spec.memory_mib - need
    return 0.0 if room <= 0 else clamp01((free - need) / room)


PLUGIN = per_endpoint_scorer("memory", NoParams, 0.25, _score)
