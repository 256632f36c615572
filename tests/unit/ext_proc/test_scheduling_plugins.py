"""The scheduling plugins one by one, the registry, the decisions' plugin labels, and a plugin registered
from a module outside the package that a profile then uses (docs/picker.md, "A new scorer")."""

from __future__ import annotations

import random
import sys
import textwrap

import pytest

from ext_proc.picker import pick
from ext_proc.prefix_choice import choose_cached
from ext_proc.prefix_index import PrefixIndex
from ext_proc.ring import HashRing
from ext_proc.scheduling import (
    DEFAULT_STEPS,
    REGISTRY,
    NoParams,
    Request,
    build_profile,
    default_profile,
    register,
)
from ext_proc.scheduling.plugins.affinity_slack import Params as SlackParams
from ext_proc.scheduling.scan import TIE
from ext_proc.settings import from_wire, to_wire
from ext_proc.view import ClusterEndpoints
from tests.unit.ext_proc.test_scheduling_equivalence import random_case

FOUR = [f"10.0.0.{i}:8000" for i in range(4)]


def request(endpoints=FOUR, position=None, pinned=None, loads=None, total=None, need=0.0, free=None,
            failed=frozenset(), weights=None, request_id=b"r") -> Request:
    pool = ClusterEndpoints("c", tuple(endpoints), HashRing(endpoints), 0, weights or {}, {})
    loads = loads or {}
    return Request("c", pool, position, "none" if position is None else "session", pinned,
                   request_id if position is None else b"", 1.0, need, loads,
                   sum(loads.values()) if total is None else total, free, failed, None, None)


def as_request(case) -> Request:
    need = case["need_mib"] * (1.0 + case["margin"])
    free = case["free_mib"] if (case["free_mib"] and need > 0) else None
    return Request("c", case["pool"], case["position"], "prefix", case["pinned"],
                   case["request_id"] if case["position"] is None else b"", case["work"], need, case["loads"],
                   case["total"], free, case["failed"], None, None)


# --- each filter: its rule for one request is its keep() ------------------------------------------


@pytest.mark.parametrize("plugin", ["failed-endpoints", "memory-admission", "bounded-load", "affinity-slack"])
def test_a_filters_rule_for_a_request_keeps_what_its_keep_keeps(plugin):
    f = REGISTRY.get(plugin)(REGISTRY.get(plugin).Params())
    rng = random.Random(plugin)
    checked = 0
    for _ in range(400):
        r = as_request(random_case(rng))
        rule = f.rule(r)
        for e in r.pool.endpoints:
            assert f.keep(r, e) == (True if rule is None else rule(e))  # None: it keeps every endpoint
            checked += 1
    assert checked > 1000


def test_failed_endpoints_turns_away_the_failing_and_repins():
    f = REGISTRY.get("failed-endpoints")(NoParams())
    r = request(failed={FOUR[1]: 1.0})
    assert [f.keep(r, e) for e in FOUR] == [True, False, True, True]
    assert f.repins and not f.soft and f.rule(request()) is None  # nothing fails: no rule, no cost


def test_memory_admission_keeps_unknown_memory_and_refuses_short_memory_apart():
    f = REGISTRY.get("memory-admission")(NoParams())
    r = request(need=2400.0, free={FOUR[0]: 2399.0, FOUR[1]: 2400.0})
    assert [f.keep(r, e) for e in FOUR] == [False, True, True, True]  # FOUR[2:] have no sample: admitted
    assert f.outcome == "memory" and not f.repins and f.rule(request()) is None


def test_bounded_load_bounds_affinity_by_weight_with_a_looser_bound_for_the_pin():
    f = REGISTRY.get("bounded-load")(REGISTRY.get("bounded-load").Params(load_factor=1.25, pinned_load_factor=2.0,
                                                                           min_bound=0.0))
    loads = {FOUR[0]: 3.0, FOUR[1]: 3.0}  # total 6, + 1: the bound is 1.25 x 7 / 4 = 2.19; the pin's 3.5
    r = request(position=1, pinned=FOUR[1], loads=loads)
    assert [f.keep(r, e) for e in FOUR] == [False, True, True, True]
    heavy = request(position=1, loads=loads, weights={FOUR[0]: 3, FOUR[1]: 1, FOUR[2]: 1, FOUR[3]: 1})
    assert f.keep(heavy, FOUR[0]) and not f.keep(heavy, FOUR[1])  # 3 < 1.25 x 7 x 1/2: weight carries
    assert f.rule(request(loads=loads)) is None and f.keep(request(loads=loads), FOUR[0])  # no key: no bound


def test_affinity_slack_keeps_endpoints_within_slack_requests_of_the_least_loaded():
    plugin = REGISTRY.get("affinity-slack")
    f = plugin(SlackParams(slack=1.0))
    r = request(position=1, loads={FOUR[0]: 2.0, FOUR[1]: 1.0, FOUR[2]: 1.0})  # the least loaded: 0 + 1
    assert [f.keep(r, e) for e in FOUR] == [False, True, True, True]  # 3 > 1 + 1, 2 <= 2
    assert plugin(SlackParams(slack=2.0)).keep(r, FOUR[0])
    with pytest.raises(ValueError, match="slack is null and cost_aware is false"):
        SlackParams(slack=None)


def test_least_loaded_scores_one_idle_and_less_per_share_of_load():
    s = REGISTRY.get("least-loaded")(NoParams())
    r = request(loads={FOUR[0]: 1.0, FOUR[1]: 3.0}, weights={FOUR[0]: 1, FOUR[1]: 3, FOUR[2]: 2, FOUR[3]: 2})
    scores = s.score(r, FOUR)
    assert scores[2] == scores[3] == 1.0 and scores[0] == pytest.approx(scores[1])  # 1 / (1/8) = 3 / (3/8)
    assert 0 < scores[0] < 1


def test_session_affinity_scores_the_pin_only():
    s = REGISTRY.get("session-affinity")(NoParams())
    assert s.score(request(position=1, pinned=FOUR[2]), FOUR) == [0.0, 0.0, 1.0, 0.0]
    assert s.rule(request()) is None


# --- pickers -------------------------------------------------------------------------------------


def test_max_score_weighs_the_pin_against_the_load():
    profile = build_profile([{"plugin": "memory-admission"}, {"plugin": "session-affinity", "weight": 1},
                             {"plugin": "least-loaded", "weight": 2}, {"plugin": "max-score"}])
    idle_pin = request(position=1, pinned=FOUR[1], loads={FOUR[0]: 1.0, FOUR[2]: 1.0, FOUR[3]: 1.0})
    assert profile.choose(idle_pin) == (FOUR[1], "affinity", "session-affinity+least-loaded")
    # The pin holds 3 requests: 1 + 2 / 4 = 1.5 against 2 x 1 for an idle endpoint: it moves.
    busy_pin = request(position=1, pinned=FOUR[1], loads={FOUR[1]: 3.0 / 4})
    endpoint, outcome, plugins = profile.choose(busy_pin)
    assert endpoint == FOUR[0] and outcome == "spilled" and plugins == "session-affinity+least-loaded"
    short = request(position=1, pinned=FOUR[1], need=100.0, free={FOUR[1]: 0.0})
    assert profile.choose(short)[1:] == ("memory", "memory-admission+session-affinity+least-loaded")
    assert profile.choose(request(need=100.0, free=dict.fromkeys(FOUR, 0.0))) == (None, "no-memory",
                                                                                "memory-admission")


def test_max_score_draws_ties_by_weight_from_the_request_id():
    profile = build_profile([{"plugin": "least-loaded"}, {"plugin": "max-score"}])
    chosen = {profile.choose(request(request_id=b"%d" % i)).endpoint for i in range(200)}
    assert chosen == set(FOUR)  # an idle pool: every endpoint drawn
    assert {profile.choose(request(request_id=b"7")).endpoint for _ in range(5)} == {
        profile.choose(request(request_id=b"7")).endpoint}  # the same id, the same endpoint


def test_a_conversations_inferred_hit_holds_only_within_the_bounded_load():
    """The endpoint of a conversation's latest turn counts as holding the prompt before its newest
    message (the reply the index never saw) only while the profile's filters keep it for the request:
    past bounded-load's bound (1.25 x (total + work) / 4 here) its next turn goes elsewhere, where by
    the cached share against the load alone (choose_cached) it would have stayed."""
    index = PrefixIndex()
    index.sent_turn(99, FOUR[2])

    def turn(busy: float) -> Request:
        loads = {**dict.fromkeys(FOUR, 8.0), FOUR[2]: busy}
        return request(position=99, loads=loads)._replace(key="prefix", blocks=(11, 22, 33), prefixes=index,
                                                          continued=0.9)

    profile = default_profile()
    assert profile.choose(turn(10.0))[:2] == (FOUR[2], "affinity")  # 10 < 1.25 x 35 / 4
    over = turn(12.0)  # 12 >= 1.25 x 37 / 4
    assert choose_cached(over.blocks, FOUR, over.loads, over.pool.shares, index,
                         continued=(FOUR[2], 0.9))[0] == FOUR[2]
    assert profile.choose(over).endpoint != FOUR[2]


# --- the decisions' plugins: a bounded label set -----------------------------------------------------


def test_the_default_profiles_decisions_name_their_plugins_from_a_bounded_set():
    rng = random.Random(3)
    profile = default_profile()
    seen: dict[str, set[str]] = {}
    for _ in range(3000):
        choice = profile.choose(as_request(random_case(rng)))
        seen.setdefault(choice.outcome, set()).add(choice.plugins)
    names = {s["plugin"] for s in DEFAULT_STEPS}
    labels = set().union(*seen.values())
    assert all(set(label.split("+")) <= names for label in labels)
    assert len(labels) <= 2 ** len(DEFAULT_STEPS)
    assert seen["affinity"] <= {"prefix-cache", "failed-endpoints+prefix-cache"}  # (a repin's walk)
    assert seen["least-loaded"] == {"least-loaded"}
    assert "bounded-load+prefix-cache" in seen["spilled"]
    assert "memory-admission+prefix-cache" in seen["memory"] and "bounded-load+least-loaded" in seen["memory"]
    assert seen["no-memory"] <= {"memory-admission", "failed-endpoints+memory-admission", "failed-endpoints"}


def test_ties_are_values_within_the_tie_of_each_other():
    profile = build_profile([{"plugin": "least-loaded"}, {"plugin": "ring-affinity"}])
    loads = {FOUR[0]: 1.0 + TIE / 8, FOUR[1]: 1.0, FOUR[2]: 2.0, FOUR[3]: 2.0}  # 4 + TIE/2 per share vs 4: a tie
    chosen = {profile.choose(request(loads=loads, request_id=b"%d" % i)).endpoint for i in range(100)}
    assert chosen == {FOUR[0], FOUR[1]}


# --- the registry ------------------------------------------------------------------------------


def test_the_registry_refuses_what_is_no_plugin_or_takes_a_name_twice():
    class NoKind:
        name = "no-kind"
        Params = NoParams

    with pytest.raises(TypeError, match="no scheduling plugin"):
        register(NoKind)

    class Shadow:
        name = "least-loaded"
        Params = NoParams
        default_weight = 1.0

        def __init__(self, params): ...

        def score(self, request, endpoints): return [0.0] * len(endpoints)

    with pytest.raises(ValueError, match="already registered"):
        register(Shadow)

    class BadName(Shadow):
        name = "Bad Name"

    with pytest.raises(ValueError, match="lower case"):
        register(BadName)
    assert REGISTRY.get("least-loaded") is not Shadow


# --- a plugin of your own: one module, one registration, config ---------------------------------

PLUGIN = '''
"""A scorer of our own: the endpoints of one rack first (``params.rack``: a prefix of their address)."""

from collections.abc import Sequence

from ext_proc.scheduling import PluginParams, Request, register


class Params(PluginParams):
    rack: str = "10.0.0."


@register
class SameRack:
    name = "same-rack"
    Params = Params
    default_weight = 1.0

    def __init__(self, params: Params) -> None:
        self.rack = params.rack

    def score(self, request: Request, endpoints: Sequence[str]) -> list[float]:
        return [1.0 if e.startswith(self.rack) else 0.0 for e in endpoints]
'''


def test_a_scorer_registered_from_a_module_outside_the_package_is_used_by_a_profile(tmp_path, monkeypatch):
    from inferlb.picker_config import picker_settings, routing_table
    from tests.support.factories import config, service, version

    (tmp_path / "my_rack_scorer.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_rack_scorer", raising=False)
    endpoints = [{"address": f"10.0.{rack}.{i}:8000"} for rack in (0, 1) for i in (1, 2)]
    steps = [{"plugin": "failed-endpoints"}, {"plugin": "memory-admission"},
             {"plugin": "same-rack", "weight": 4, "params": {"rack": "10.0.1."}},
             {"plugin": "least-loaded"}, {"plugin": "max-score"}]
    cfg = config([service("llm", [version("v1", endpoints)], picker_profile="rack")],
                 picker={"plugin_modules": ["my_rack_scorer"], "profiles": {"rack": steps}})
    routing = routing_table(cfg)
    assert "same-rack" in REGISTRY
    from ext_proc.view import EndpointView
    from tests.unit.ext_proc.test_scheduler import cla
    view = EndpointView.build({"llm-v1": cla("llm-v1", {e["address"]: 1 for e in endpoints})}, routing)
    loads = {"10.0.1.1:8000": 2.0}  # the rack's first endpoint is busy; its other one is idle
    for i in range(20):
        d = pick({":authority": b"x", "x-request-id": b"%d" % i}, view, loads)
        assert (d.endpoint, d.reason, d.plugins) == ("10.0.1.2:8000", "least-loaded", "same-rack+least-loaded")
    # A standalone picker gets the module's name over the wire and imports it before building the profile.
    back, _ = from_wire(to_wire(routing, picker_settings(cfg)))
    assert back.plugin_modules == ("my_rack_scorer",) and back.profiles["rack"] == routing.profiles["rack"]


BROKEN = '''
from ext_proc.scheduling import PluginParams, register


class Params(PluginParams):
    answer: str = "nan"


@register
class BrokenScores:
    name = "broken-scores"
    Params = Params
    default_weight = 1.0

    def __init__(self, params):
        self.answer = params.answer

    def score(self, request, endpoints):
        if self.answer == "short":
            return [1.0] * (len(endpoints) - 1)
        return [float(self.answer)] * len(endpoints)
'''


@pytest.mark.parametrize(("answer", "shown"), [("nan", "[nan, nan"), ("short", "3 scores for 4"), ("1.5", "[1.5, 1.5")])
def test_a_scorer_that_breaks_its_contract_fails_the_pick_naming_it(tmp_path, monkeypatch, answer, shown):
    """One score in [0, 1] per endpoint: a NaN had made every endpoint look refused (outcome
    ``no-memory``, the plugin's name dropped) and too few scores decided silently. The pick raises,
    which the handler reports as ``pick-failed`` and Envoy's failure mode routes."""
    from inferlb.picker_config import routing_table
    from tests.support.factories import config, service, version

    (tmp_path / "my_broken_scorer.py").write_text(textwrap.dedent(BROKEN))
    monkeypatch.syspath_prepend(str(tmp_path))   # imported once per process: a class registers once
    endpoints = [{"address": e} for e in FOUR]
    steps = [{"plugin": "broken-scores", "params": {"answer": answer}}, {"plugin": "least-loaded"},
             {"plugin": "max-score"}]
    cfg = config([service("llm", [version("v1", endpoints)], picker_profile="broken")],
                 picker={"plugin_modules": ["my_broken_scorer"], "profiles": {"broken": steps}})
    from ext_proc.view import EndpointView
    from tests.unit.ext_proc.test_scheduler import cla
    routing = routing_table(cfg)
    view = EndpointView.build({"llm-v1": cla("llm-v1", {e: 1 for e in FOUR})}, routing)
    with pytest.raises(ValueError, match=r"scorer 'broken-scores' gave") as raised:
        pick({":authority": b"x", "x-request-id": b"1"}, view, {})
    assert shown in str(raised.value)
