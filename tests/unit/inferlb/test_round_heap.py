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


async def test_a_full_pass_only_once_the_frozen_objects_grew_by_a_quarter(monkeypatch):
    import inferlb.serve as serve

    app = InferLB(parse_config(CONFIG))
    app.control.source = metrics_source(lambda instances: {i: EndpointStats(sample_age_s=1.0) for i in instances})
    passes: list[int] = []
    unfreeze = gc.unfreeze
    monkeypatch.setattr(serve, "UNFREEZE_EVERY", 2)
    monkeypatch.setattr(gc, "unfreeze", lambda: (passes.append(gc.get_freeze_count()), unfreeze()))
    kept: list[list] = []
    try:
        for _ in range(6):  # the second round counts the frozen objects (the baseline); the heap stays as it is
            assert await app.control.run_round()
        assert passes == []
        kept.extend([] for _ in range(int(0.3 * gc.get_freeze_count())))  # alive, tracked: a third more
        assert await app.control.run_round()
        assert passes == []  # counted every UNFREEZE_EVERY rounds only
        assert await app.control.run_round()
        assert len(passes) == 1
        for _ in range(2):  # the pass set the new baseline: none again at the next count
            assert await app.control.run_round()
        assert len(passes) == 1
    finally:
        unfreeze()
        app.recorder.close()


def test_full_pass_due_once_the_frozen_objects_grew_by_a_quarter():
    from inferlb.serve import full_pass_due

    assert not full_pass_due(1249, 1000)
    assert full_pass_due(1250, 1000) and full_pass_due(2000, 1000)
    assert not full_pass_due(900, 1000)  # fewer than after the last pass: the rounds freed what they made
