"""``oracle``: a practical ceiling - perfect, instant knowledge, the lowest predicted TTFT, KV pressure priced in.

Not a published algorithm: the lab's upper reference. It knows what no real router knows at once:

- every engine's prefix cache exactly (its KV events with no delay: the blocks stored and not yet
  evicted), so a request's cached prefix on each engine is exact;
- every engine's running batch, waiting queue and free KV blocks now (the engines' own gauges,
  read at the moment of the decision: :attr:`bench.lab.policy.Needs.engines`), and its step-time
  constants (:attr:`sim.engines.llm.LlmEngine.spec`);
- the prompt tokens still to prefill of every request it sent that has no first token yet.

For each request it predicts the TTFT on every engine: the prefill queued there before it plus
its own uncached tokens, at the engine's chunk budget per step, each step costing
``beta0 + beta1 x prefill tokens + beta2 x running decodes``; and it prices the KV pressure the
request causes: when the blocks it needs (its uncached prompt and its output hint, plus those of
the requests queued there) exceed the engine's free blocks, it adds the time for that many blocks
to be released at the rate the running batch releases them. The lowest sum wins (ties at random).
A choice that ignored the pressure would spread prefixes freely and fall below the prefix-aware
peers once the KV cache is full. Greedy, one request at a time: a ceiling in practice, not a proof
of optimality, and not always a ceiling: in the full lab's ``shared_prefix`` at 72 QPS (16 A100s,
commit 1863558) its TTFT p90 was 320.6 s where llm-d's rule kept 88 ms. Its prediction counts the
prefill queued before a request but not what a miss evicts for the requests after it, so under
pressure it scatters the groups that the peers' prefix stickiness keeps. ``job`` engines (no prefix
cache, no steps) are scored by their free memory and queue instead: the most free memory left
after the request, then the fewest held.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from bench.lab.policies.kvindex import KvIndex
from bench.lab.policies.proxy import ProxyPolicy
from bench.lab.policy import Endpoint, Finished, FirstToken, KvEvents, Needs, Progress, Request
from bench.lab.workloads.tokens import prompt_keys

__all__ = ["Oracle"]


class Oracle(ProxyPolicy):
    """The lab's ceiling (see the module docstring)."""

    name = "oracle"
    needs = Needs(kv_events=True, engines=True)

    def __init__(self) -> None:
        super().__init__()
        self.index = KvIndex()
        self.pending: dict[str, int] = {}  # endpoint -> prompt tokens of its requests still to prefill
        self.pending_blocks: dict[str, int] = {}
        self._sent: dict[int, tuple[str, int, int]] = {}

    def on_kv_events(self, events: Sequence[KvEvents]) -> None:
        self.index.apply(events)

    def _llm_cost(self, engine: Any, address: str, keys: Sequence[int], tokens: int, output: int
                  ) -> tuple[float, int, int]:
        spec = engine.spec
        bs = spec.block_size
        new = max(1, tokens - self.index.overlap(keys, address) * bs)
        stats = engine.stats()
        c = spec.coefficients
        decode_step_us = c.beta0_us + c.beta2_us * stats.running
        prefill = self.pending.get(address, 0) + new
        steps = math.ceil(prefill / spec.max_num_batched_tokens)
        ttft_s = (steps * decode_step_us + c.beta1_us * prefill) * 1e-6
        need = -(-(new + output) // bs) + self.pending_blocks.get(address, 0)
        free = stats.kv_blocks_total - stats.kv_blocks_used
        if need > free and stats.kv_blocks_used:
            # the running batch releases its blocks as its requests end: a request lives about
            # ``output`` decode steps, so the batch frees its blocks over that many steps
            lifetime_s = max(1, output) * decode_step_us * 1e-6
            ttft_s += (need - free) * lifetime_s / stats.kv_blocks_used
        return ttft_s, new, -(-(new + output) // bs)

    def choose(self, request: Request, cluster: str, endpoints: Sequence[Endpoint]) -> Endpoint:
        assert self.ctx is not None
        engines = self.ctx.engines
        output = request.max_tokens or 256
        best: list[tuple[Endpoint, int, int]] = []
        low = math.inf
        keys: Sequence[int] = ()
        for e in endpoints:
            engine = engines[e.address]
            if getattr(engine, "kind", "llm") == "llm":
                if not keys:
                    keys = prompt_keys(request.prompt, engine.spec.block_size)
                cost, new, blocks = self._llm_cost(engine, e.address, keys, request.prompt.tokens, output)
            else:
                stats = engine.stats()
                left = stats.memory_free_mib - (request.memory_mib or 0.0)
                cost = (0.0 if left >= 0 else 1e9 - left) + (stats.running + stats.waiting) * 1e-3 - left * 1e-9
                new = blocks = 0
            if cost < low - 1e-12:
                low, best = cost, [(e, new, blocks)]
            elif cost <= low + 1e-12:
                best.append((e, new, blocks))
        chosen, new, blocks = best[self.ctx.rng.randrange(len(best))] if len(best) > 1 else best[0]
        a = chosen.address
        self.pending[a] = self.pending.get(a, 0) + new
        self.pending_blocks[a] = self.pending_blocks.get(a, 0) + blocks
        self._sent[request.id] = (a, new, blocks)
        return chosen

    def on_progress(self, events: Sequence[Progress]) -> None:
        for event in events:
            if isinstance(event, FirstToken | Finished):
                got = self._sent.pop(event.request_id, None)
                if got is not None:
                    a, new, blocks = got
                    self.pending[a] -= new
                    self.pending_blocks[a] -= blocks
            if isinstance(event, Finished):
                self.ended(event)
