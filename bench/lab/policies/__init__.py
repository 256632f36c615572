"""The policies the lab compares (one module each), by the names the figures use.

Baselines a user would otherwise run (``random``; Envoy's ``round_robin``, ``least_request``,
``ring_hash_bounded``), the peers' published algorithms (``llm_d``: the llm-d / Gateway API
Inference Extension endpoint picker's default profile; ``sglang_cache_aware``: SGLang's router;
``dynamo_kv``: NVIDIA Dynamo's KV router), the lab's ceiling (``oracle``) and inferlb's own
decision code (``inferlb``; ``inferlb_precise``: its prefix index fed by the engines' KV events;
``inferlb_latency``: its ``predicted-latency`` picker).
Each module's docstring cites the source and version it follows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from bench.lab.policies.dynamo import DynamoKv
from bench.lab.policies.inferlb import Inferlb
from bench.lab.policies.inferlb_latency import InferlbLatency
from bench.lab.policies.inferlb_precise import InferlbPrecise
from bench.lab.policies.least_request import LeastRequest
from bench.lab.policies.llm_d import LlmD
from bench.lab.policies.oracle import Oracle
from bench.lab.policies.random_pick import RandomPick
from bench.lab.policies.ring_hash import RingHashBounded
from bench.lab.policies.round_robin import RoundRobin
from bench.lab.policies.sglang import SglangCacheAware
from bench.lab.policy import Policy

__all__ = ["POLICIES", "POLICY_NAMES"]

#: Policy name -> a factory of a fresh instance (one per run and gateway).
POLICIES: Mapping[str, Callable[[], Policy]] = MappingProxyType({
    "round_robin": RoundRobin,
    "least_request": LeastRequest,
    "ring_hash_bounded": RingHashBounded,
    "random": RandomPick,
    "llm_d": LlmD,
    "sglang_cache_aware": SglangCacheAware,
    "dynamo_kv": DynamoKv,
    "oracle": Oracle,
    "inferlb": Inferlb,
    "inferlb_precise": InferlbPrecise,
    "inferlb_latency": InferlbLatency,
})
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)
