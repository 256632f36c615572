"""``gpu_memory``: excludes an endpoint whose free GPU memory can't hold a request plus the safety margin.

Needed: ``engine.request_memory_mib x (1 + engine.memory_margin)`` (default 2048 MiB + 20 %). Free
memory is the stat's ``gpu_mem_free_mib`` (the GPU with the least free memory), or, when only the
used memory is known, the endpoint's configured GPU memory minus it. No memory data: not excluded.
"""

from __future__ import annotations

from xds_server.engine.inputs import free_mib, needed_mib
from xds_server.engine.plugin import ClusterRound, Member, NoParams, per_endpoint_filter


def _check(m: Member, _: NoParams, rnd: ClusterRound) -> str | None:
    free, need = free_mib(m), needed_mib(rnd)
    if free is not None and free < need:
        return f"gpu memory free {free:.0f} MiB < {need:.0f} MiB needed (request + margin)"
    return None


PLUGIN = per_endpoint_filter("gpu_memory", NoParams, _check)
