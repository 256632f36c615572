"""The ``predicted-latency`` picker (ext_proc/scheduling/plugins/predicted_latency.py) on hand-made
cases, one per rule: the cost in ms, the spill when the queue outweighs the prefill, partial hits,
each endpoint's own GPU class, ties, the fallback to ``prefix-cache``'s rule while the fit is not
ready, prompts cached nowhere; and the cost model's TTFT load term it reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ext_proc.costmodel import CostModel, Fit
from ext_proc.prefix_choice import choose_cached, rendezvous
from ext_proc.prefix_index import PrefixIndex, block_hashes
from ext_proc.ring import HashRing
from ext_proc.scheduling import Request, build_profile
from ext_proc.scheduling.plugins.predicted_latency import FALLBACK_LABEL, latency_costs
from ext_proc.view import ClusterEndpoints

FOUR = [f"10.0.0.{i}:8000" for i in range(4)]
SYSTEM = "s" * 4096  # 8 blocks
PROMPT = block_hashes((SYSTEM + "q" * 1024).encode())  # 10 blocks, 80 % the system prompt
PROFILE = build_profile([{"plugin": "failed-endpoints"}, {"plugin": "predicted-latency"}], "latency")


def fit(g: float = 1.0, d: float = 1.0, m: float = 0.0, e: float = 100.0) -> Fit:
    """A class's fit: ``g`` ms of TTFT per request in flight, ``d`` ms of duration per request in
    flight, a hit saving ``m + e`` ms per 1000 prompt tokens."""
    return Fit((100.0, 10.0, 50.0, d), (5.0, 1.0, m, e), 1000.0, 10.0, 100, (5.0, 1.0, m, e, g))


def model(**fits: Fit) -> CostModel:
    costs = CostModel()
    costs.fits = dict(fits)
    return costs


def request(loads, index, costs, classes=None, failed=frozenset(), prompt=1000.0, blocks=PROMPT) -> Request:
    pool = ClusterEndpoints("c", tuple(FOUR), HashRing(FOUR), 0, {}, classes or {e: "a100" for e in FOUR})
    return Request("c", pool, None, "prefix", None, b"", 1.0, 0.0, loads, sum(loads.values()), None, failed,
                   prompt, costs, blocks, index)


def cached_on(*endpoints: str, prompt=PROMPT) -> PrefixIndex:
    index = PrefixIndex()
    for e in endpoints:
        index.insert(e, prompt, 1000)
    return index


def test_the_cost_is_the_queue_plus_the_uncached_prefill_plus_what_it_adds_to_the_running():
    """g = 1 ms and d = 2 ms per request in flight, a whole-prompt hit saves 100 ms (1000 tokens)."""
    costs = latency_costs(FOUR, {FOUR[0]: 10.0, FOUR[1]: 4.0}, {FOUR[0]: 1.0, FOUR[1]: 0.5},
                          dict.fromkeys(FOUR, "a100"), {"a100": fit(g=1.0, d=2.0)}, 1000.0)
    assert costs == {FOUR[0]: 30.0, FOUR[1]: 12.0 + 50.0, FOUR[2]: 100.0, FOUR[3]: 100.0}


def test_a_cached_prompt_stays_while_its_queue_costs_less_than_the_prefill_it_saves():
    """Cost per request in flight g + d = 2 ms, a hit saves 100 ms: it stays up to 50 requests more."""
    index, costs = cached_on(FOUR[2]), model(a100=fit())
    stay = PROFILE.choose(request({FOUR[2]: 49.0}, index, costs))
    assert stay == (FOUR[2], "affinity", "predicted-latency")
    spill = PROFILE.choose(request({FOUR[2]: 51.0, FOUR[0]: 1.0, FOUR[1]: 1.0}, index, costs))
    assert spill == (FOUR[3], "spilled", "predicted-latency")  # the only idle one


def test_a_partial_hit_is_priced_by_the_share_it_saves():
    """FOUR[1] holds 80 % (the system prompt: 20 ms of prefill left), FOUR[2] all of it."""
    index = cached_on(FOUR[2])
    index.insert(FOUR[1], block_hashes(SYSTEM.encode()), 1000)
    costs = model(a100=fit())
    assert PROFILE.choose(request({FOUR[2]: 20.0, FOUR[1]: 9.0}, index, costs))[:2] == (FOUR[1], "spilled")
    assert PROFILE.choose(request({FOUR[2]: 20.0, FOUR[1]: 11.0}, index, costs))[:2] == (FOUR[2], "affinity")


def test_each_endpoint_is_priced_by_its_own_gpu_class():
    """The same loads and cache: an l4 endpoint's queue costs 10 ms a request, an a100's 1 ms."""
    classes = {FOUR[0]: "l4", FOUR[1]: "l4", FOUR[2]: "a100", FOUR[3]: "a100"}
    index = cached_on(FOUR[0], FOUR[2])
    costs = model(a100=fit(g=1.0, d=0.0), l4=fit(g=10.0, d=0.0))
    loads = dict.fromkeys(FOUR, 5.0)
    assert PROFILE.choose(request(loads, index, costs, classes))[:2] == (FOUR[2], "affinity")
    # Without a fit for the l4 class, the whole decision falls back (no mixed units).
    assert PROFILE.choose(request(loads, index, model(a100=fit()), classes)).plugins == FALLBACK_LABEL


def test_equal_costs_go_to_the_highest_rendezvous_hash_in_every_process():
    index, costs = cached_on(*FOUR), model(a100=fit())
    best = max(FOUR, key=lambda e: rendezvous(PROMPT[0], e))
    assert PROFILE.choose(request({}, index, costs)) == (best, "affinity", "predicted-latency")


def test_a_negative_duration_load_coefficient_counts_as_zero():
    costs = latency_costs(FOUR[:1], {FOUR[0]: 10.0}, {}, {FOUR[0]: "a100"}, {"a100": fit(g=1.0, d=-5.0)}, 1000.0)
    assert costs == {FOUR[0]: 10.0 + 100.0}


@pytest.mark.parametrize("costs", [
    None,                                      # no cost model
    model(),                                   # no class ready
    model(a100=Fit((1.0, 1.0, 1.0, 1.0), None, 1000.0, 10.0, 100)),  # no TTFT data (hits and misses)
    model(a100=fit(g=0.0, d=0.0)),             # load costs nothing measurable
])
def test_until_the_fit_is_ready_prefix_caches_rule_decides_and_the_decision_says_so(costs):
    index = cached_on(FOUR[2])
    loads = {FOUR[2]: 30.0, FOUR[0]: 2.0}
    choice = PROFILE.choose(request(loads, index, costs))
    assert choice.plugins == FALLBACK_LABEL
    assert (choice.endpoint, choice.outcome) == choose_cached(PROMPT, FOUR, loads, {e: 0.25 for e in FOUR}, index)


def test_unknown_prompt_tokens_fall_back():
    choice = PROFILE.choose(request({}, cached_on(FOUR[1]), model(a100=fit()), prompt=None))
    assert choice == (FOUR[1], "affinity", FALLBACK_LABEL)


def test_a_prompt_cached_nowhere_takes_prefix_caches_turn_named_by_this_picker():
    index, loads = PrefixIndex(), {FOUR[0]: 3.0}
    choice = PROFILE.choose(request(loads, index, model(a100=fit())))
    assert choice.plugins == "predicted-latency" and choice.outcome == "least-loaded"
    assert choice.endpoint == choose_cached(PROMPT, FOUR, loads, {e: 0.25 for e in FOUR}, index)[0]


def test_failing_endpoints_are_never_chosen():
    """The only endpoint holding the prompt is failing: among the others it is cached nowhere."""
    index, costs = cached_on(FOUR[2]), model(a100=fit())
    choice = PROFILE.choose(request({}, index, costs, failed=frozenset({FOUR[2]})))
    assert choice.endpoint != FOUR[2] and choice.outcome == "least-loaded"


def test_the_cost_models_ttft_load_term_is_learned_with_the_uncached_share():
    """TTFT = 5 ms + 40 ms per 1000 uncached prompt tokens + 3 ms per request in flight, where the
    endpoint holding the prompt also runs the most requests (the confounding a binary miss keeps)."""
    costs = CostModel(forget=1.0, min_samples=20)
    for i in range(300):
        uncached = (i % 5) / 4.0
        load, prompt = 20.0 * (1.0 - uncached) + (i % 3), 500.0 + 100 * (i % 7)
        ttft = 5.0 + 40.0 * uncached * prompt / 1000 + 3.0 * load
        costs.observe("a100", prompt, 100.0, 1000.0 + load, ttft, load, uncached > 0.5, uncached)
    f = costs.refit()["a100"]
    assert f.queue_ms() == pytest.approx(3.0, rel=0.02)
    assert f.prefill_ms(1000.0) == pytest.approx(40.0, rel=0.02)
    described = costs.describe()["classes"]["a100"]["ttft_uncached_ms"]
    assert described["per_request_in_flight"] == f.queue_ms()
    assert described["uncached"] + described["per_1k_prompt_tokens_uncached"] == pytest.approx(40.0, rel=0.02)


def test_without_the_uncached_share_the_binary_miss_stands_for_it():
    costs = CostModel(forget=1.0, min_samples=20)
    for i in range(200):
        load, miss, prompt = float(i % 13), i % 3 != 0, 500.0 + 100 * (i % 7)
        costs.observe("a100", prompt, 100.0, 1000.0, 5.0 + (40.0 * prompt / 1000 if miss else 0.0) + 2.0 * load,
                      load, miss)
    f = costs.refit()["a100"]
    assert f.queue_ms() == pytest.approx(2.0, rel=0.02) and f.prefill_ms(2000.0) == pytest.approx(80.0, rel=0.02)
    costs.observe("a100", 1000.0, 100.0, 1000.0, 50.0, 1.0, True, uncached=1.5)  # out of 0-1: the miss counts
    assert costs._sums["a100"].nt == 201


def test_a_request_memory_admission_applies_to_is_left_to_the_ring_and_memory_admission():
    """A `job` engine's request (a GPU memory need, free-memory samples): the cached endpoint has no
    memory for it, so it goes elsewhere, however cheap the fit prices the cache hit."""
    profile = build_profile([{"plugin": "failed-endpoints"}, {"plugin": "memory-admission"},
                             {"plugin": "predicted-latency"}], "jobs")
    free = {e: 0.0 if e == FOUR[2] else 10_000.0 for e in FOUR}
    r = request({}, cached_on(FOUR[2]), model(a100=fit()))._replace(need_mib=500.0, free_mib=free)
    choice = profile.choose(r)
    assert choice.endpoint != FOUR[2] and choice.endpoint in FOUR
    assert PROFILE.choose(request({}, cached_on(FOUR[2]), model(a100=fit()))).endpoint == FOUR[2]


def test_the_profiles_bounded_load_turns_away_a_cached_endpoint_the_fit_would_keep():
    """Cost per request in flight 2 ms, a hit saves 100 ms: at 30 requests the cached endpoint still
    costs least (60 ms against 104), but it runs over 1.25 x its share of the cluster's load."""
    profile = build_profile([{"plugin": "failed-endpoints"}, {"plugin": "bounded-load"},
                             {"plugin": "predicted-latency"}], "bounded")
    loads = {FOUR[2]: 30.0, FOUR[0]: 2.0, FOUR[1]: 2.0, FOUR[3]: 2.0}
    r = request(loads, cached_on(FOUR[2]), model(a100=fit()))._replace(position=123)
    assert PROFILE.choose(r)[:2] == (FOUR[2], "affinity")
    choice = profile.choose(r)
    assert choice.endpoint != FOUR[2] and choice.outcome == "spilled"
    assert choice.plugins == "bounded-load+predicted-latency"


_CHILD = """
import json
from tests.unit.ext_proc.test_predicted_latency import FOUR, PROFILE, cached_on, fit, model, request
index, costs = cached_on(*FOUR), model(a100=fit())
out = [PROFILE.choose(request({FOUR[i % 4]: float(i % 3)}, index, costs))[0] for i in range(12)]
print(json.dumps(out))
"""


def test_the_same_inputs_give_the_same_choices_in_another_process():
    """Every endpoint holds the prompt, loads tie in pairs: the ties go by the rendezvous hash, not by
    Python's per-process hash()."""
    runs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[3], env=env, check=True)
        runs.append(json.loads(done.stdout))
    index, costs = cached_on(*FOUR), model(a100=fit())
    here = [PROFILE.choose(request({FOUR[i % 4]: float(i % 3)}, index, costs))[0] for i in range(12)]
    assert runs[0] == runs[1] == here
    assert len(set(here)) > 1
