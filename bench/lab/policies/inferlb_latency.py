"""``inferlb_latency``: the ``inferlb`` policy with the ``predicted-latency`` picker in its profile.

Everything is the ``inferlb`` policy's (:mod:`bench.lab.policies.inferlb`: the real handler, its
loads, queues, and its cost model fed by the access log as Envoy feeds it) except the cluster's
scheduling profile: :data:`STEPS`, the default profile's steps with ``prefix-cache`` replaced by
``predicted-latency`` (:mod:`ext_proc.scheduling.plugins.predicted_latency`), as an operator would
write it in ``picker.profile``.
"""

from __future__ import annotations

import dataclasses

from bench.lab.policies.inferlb import Inferlb
from bench.lab.policy import Context
from ext_proc.scheduling import DEFAULT_STEPS

__all__ = ["STEPS", "InferlbLatency"]

#: The profile: the default one's filters and scorer, ``predicted-latency`` as the picker.
STEPS = tuple({"plugin": "predicted-latency"} if s["plugin"] == "prefix-cache" else dict(s) for s in DEFAULT_STEPS)


class InferlbLatency(Inferlb):
    """The ``inferlb`` policy whose cluster config names :data:`STEPS` as ``picker.profile``."""

    name = "inferlb_latency"

    def start(self, ctx: Context) -> None:
        cfg = ctx.config
        if cfg is not None:
            picker = type(cfg.picker).model_validate({**cfg.picker.model_dump(), "profile": STEPS})
            ctx = dataclasses.replace(ctx, config=cfg.model_copy(update={"picker": picker}))
        super().start(ctx)
