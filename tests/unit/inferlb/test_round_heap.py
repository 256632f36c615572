"""``inferlb serve`` keeps the cyclic GC out of a weight round and freezes what survives it."""

from __future__ import annotations

import gc

from inferlb.serve import InferLB
from tests.support.factories import metrics_source
from tests.unit.inferlb.test_replicas import CONFIG
from xds_server.config import parse_config
from xds_server.metrics.stats import EndpointStats


async def test_no_automatic_gc_during_a_round_and_the_survivors_frozen_after_it():
    app = InferLB(parse_config(CONFIG))
    during: list[bool] = []

    def fetch(instances):
        during.append(gc.isenabled())  # the fetch is not in the round context: the GC still runs
        return {i: EndpointStats(sample_age_s=1.0, gpu_util=0.5) for i in instances}

    app.control.source = metrics_source(fetch)
    app.control._hooks.append(lambda snap, weights: during.append(gc.isenabled()))
    frozen_before = gc.get_freeze_count()
    try:
        assert gc.isenabled()
        assert await app.control.run_round()
        assert during == [True, False]  # the snapshot hook ran inside the round: no automatic GC
        assert gc.isenabled()  # and it is back on after the round
        assert gc.get_freeze_count() > frozen_before  # the round's survivors left the collector's generations
    finally:
        gc.unfreeze()
        app.recorder.close()
