"""``shared_prefix``: llm-d's precise-prefix benchmark shape (groups x users sharing a system prompt).

Source: llm-d's blog "KV-Cache Wins You Can See" (2025-09-24) and its guide's inference-perf
``shared_prefix`` data: 150 groups, each a 6 000-token system prompt shared by 5 users, each
user a 1 200-token question of its own (asked again and again), 1 000 output tokens; Poisson
arrivals from 3 to 60 QPS on 8 pods x 2 H100 with Qwen-32B (307 328 KV tokens per pod), where
the groups' prompts (6 000 + 5 x 1 200 tokens each) fill ~73 % of the cluster's KV cache.

Here the same shape is sized to the lab's cluster: the number of groups is chosen so that every
group's prompts fill :attr:`SharedPrefix.kv_share` of the cluster's KV tokens (default 0.73, as
theirs). Each request picks a group and one of its users uniformly. A prompt is two messages
(the group's system prompt, the user's question), both made once and shared, so building
36 000 requests costs 36 000 tuple lookups.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from bench.lab.policy import Prompt
from bench.lab.workloads.base import Draft, Sizing, poisson
from bench.lab.workloads.tokens import Synth

__all__ = ["SharedPrefix"]


@dataclass
class SharedPrefix:
    """llm-d's shared-prefix workload sized to the cluster.

    Attributes:
        system_tokens: the system prompt each group shares (tokens; theirs: 6 000).
        question_tokens: each user's question (tokens; theirs: 1 200).
        users: users per group (theirs: 5).
        output_tokens: tokens generated per request (theirs: 1 000).
        kv_share: the groups' prompts fill this share of the cluster's KV tokens (theirs: ~0.73).
        groups: the number of groups (None: from ``kv_share``).
        seed: the token ids' seed (the prompts are the same at every QPS point).
    """

    system_tokens: int = 6000
    question_tokens: int = 1200
    users: int = 5
    output_tokens: int = 1000
    kv_share: float = 0.73
    groups: int | None = None
    seed: int = 1
    name: str = "shared_prefix"
    _prompts: dict[int, list[Prompt]] = field(default_factory=dict, repr=False)

    def group_count(self, sizing: Sizing) -> int:
        """Groups whose prompts fill ``kv_share`` of ``sizing.kv_tokens`` (at least 1)."""
        if self.groups is not None:
            return self.groups
        per_group = self.system_tokens + self.users * self.question_tokens
        return max(1, round(self.kv_share * sizing.kv_tokens / per_group))

    def prompts(self, groups: int) -> list[Prompt]:
        """Every group's users' prompts (group-major), made once per group count."""
        made = self._prompts.get(groups)
        if made is None:
            synth = Synth(self.seed)
            made = []
            for _ in range(groups):
                system = synth.message("system", self.system_tokens)
                made.extend(Prompt((system, synth.message("user", self.question_tokens))) for _ in range(self.users))
            self._prompts[groups] = made
        return made

    def arrivals(self, qps: float, duration_s: float, sizing: Sizing, rng: random.Random
                 ) -> Iterator[tuple[float, Draft]]:
        prompts = self.prompts(self.group_count(sizing))
        for t in poisson(rng, qps, 0.0, duration_s):
            yield t, Draft(prompts[rng.randrange(len(prompts))], self.output_tokens, self.output_tokens)
