"""The lab's ``inferlb_precise``: inferlb's picker with its prefix index fed by the engines' KV events."""

from __future__ import annotations

from bench.lab.cluster import Cluster, Node
from bench.lab.figures import point_figures
from bench.lab.harness import RunSpec, run
from bench.lab.policies.inferlb_precise import InferlbPrecise
from bench.lab.policy import Answer, Request
from bench.lab.workloads.shared_prefix import SharedPrefix
from bench.lab.workloads.sharegpt_chat import ShareGptChat
from bench.lab.workloads.tokens import prompt_keys
from ext_proc.prefix_events import EventIndex


def _spec(qps: float = 0.2) -> RunSpec:
    return RunSpec(Cluster(tuple(Node() for _ in range(4))), SharedPrefix(groups=1, users=1, output_tokens=50),
                   qps, 60.0, drain_s=30.0)


class _Seen(InferlbPrecise):
    """The policy, keeping the requests it decided."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.seen: list[Request] = []

    def decide(self, request: Request) -> Answer:
        self.seen.append(request)
        return super().decide(request)


def test_a_shared_prefix_stays_on_the_engine_whose_events_hold_it() -> None:
    policy = _Seen(kv_event_delay_s=0.05)
    result = run(_spec(), lambda: policy)
    assert policy.needs.kv_events and policy.needs.kv_event_delay_s == 0.05
    index = policy.index
    assert isinstance(index, EventIndex) and policy.handler is not None and policy.handler.control.prefixes is index
    served = {r.endpoint for r in result.records[3:]}
    assert len(served) == 1
    (endpoint,) = served
    assert point_figures(result)["prefix_hit_rate"] > 0.8
    # what the index holds came from the engine's events, keyed as the engine keys the prompt's blocks
    keys = prompt_keys(policy.seen[-1].prompt, 16)
    assert len(keys) > 100 and index.matched(keys, [endpoint])[endpoint] == len(keys)
    assert index.held(endpoint) >= len(keys)


def test_the_precise_policy_is_deterministic() -> None:
    runs = [[(r.endpoint, r.first_s) for r in run(_spec(2.0), InferlbPrecise).records] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) > 50


def test_conversations_are_routed_by_the_events_alone() -> None:
    # The handler reads no conversation from a body keyed as the engines key it (the events hold the
    # replies), so the precise index is never asked where a conversation's latest turn went: before,
    # the lab's policy kept the approximate index's conversation, and the first chat turn crashed it.
    policy = _Seen()
    spec = RunSpec(Cluster(tuple(Node() for _ in range(4))), ShareGptChat(think_s=1.0), 2.0, 60.0, drain_s=30.0)
    result = run(spec, lambda: policy)
    assert len(result.records) > 50 and all(r.endpoint for r in result.records)
    assert point_figures(result)["prefix_hit_rate"] > 0.5
