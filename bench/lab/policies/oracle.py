"""``oracle``: a practical ceiling - perfect instant knowledge, the lowest predicted TTFT, queueing and KV priced in.

Not a published algorithm: the lab's upper reference. It knows what no real router knows at once,
read from the engines at the moment of each decision (:attr:`bench.lab.policy.Needs.engines`):

- each engine's prefix cache exactly: how many leading blocks of the request's prompt it holds and
  how many requests use each (:meth:`sim.engines.llm.LlmEngine.prefix_users`), its cached blocks no
  request uses (:attr:`~sim.engines.llm.LlmEngine.idle_cached_blocks`) and all its cached blocks;
- each engine's running batch, free KV blocks, the end of the step in flight
  (:meth:`~sim.engines.llm.LlmEngine.step_end_s`), the prompt tokens its prefilling requests have
  done (:meth:`~sim.engines.llm.LlmEngine.prefilled_tokens`) and its step-time constants;
- the prompt tokens still to prefill of every request it sent that has no first token yet;
- from the past only (never the arrivals to come): the arrival rate, the share of requests whose
  prompt start some engine had cached, and how often an evicted block is prefilled again within
  ``comeback_s`` (the engines' KV events: a sample of the evicted keys, followed until they are
  stored again or the time is up).

For each request and engine it adds three costs, all in seconds of TTFT:

1. **its own TTFT there**: the step in flight, then the prefill queued before it and its own
   uncached tokens at the engine's token budget per step, each step ``beta0 + beta1 x prefill
   tokens + beta2 x running decodes``; when its blocks (and those of the requests queued there)
   exceed the free blocks, the time the running batch takes to release them;
2. **the wait it puts on others**: the requests that reach that engine while it waits and prefills
   (the arrival rate, split as requests go: those whose prefix is cached follow the engine's share of
   the cluster's cached blocks, the others spread evenly) each wait for its prefill, and, when the
   engine is short of blocks, for the blocks it holds;
3. **the KV pressure**: the blocks it takes (its uncached prompt and its output, and the idle cached
   blocks it uses) come first from the free blocks that hold nothing; beyond them each evicts a cached
   block, which a later request prefills again as often as evicted blocks come back.

The lowest sum wins (ties at random). Without (2) and (3) a choice spreads prefixes freely and falls
below the prefix-aware peers once the KV cache is full: the previous oracle (its own TTFT and a
release-time pressure term only) had a TTFT p90 of 320.6 s in the full lab's ``shared_prefix`` at 72
QPS (commit 1863558) where llm-d's rule kept 88 ms. This one, measured on single points of
``shared_prefix`` (seed 1): at full scale (16 A100s, 10 virtual minutes) TTFT p90 86.9 ms at 48 QPS
and 88.0 ms at 72 QPS, against 86.6 and 87.7 ms for the best peer (llm-d), 0 preemptions, the same
tok/s: a tie with the prefix-aware peers, not a margin; with ``--quick`` (4 engines, 60 s) 419.5,
420.0 and 269.3 ms at 2, 6 and 12 QPS against the best peer's 424.8, 426.6 and 223.1 ms (SGLang's
rule at 12 QPS, where misses of new groups queue in front of hits and where the smallest-tree choice
for a miss does better). Greedy, one request at a time: a ceiling in practice, not a proof of
optimality. ``job`` engines (no prefix cache, no steps) are scored by their free memory and queue
instead: the most free memory left after the request, then the fewest held.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from bench.lab.policies.proxy import ProxyPolicy
from bench.lab.policy import Endpoint, Finished, FirstToken, KvEvents, Needs, Progress, Request
from bench.lab.workloads.tokens import prompt_keys
from sim.engines.api import BlockRemoved, BlockStored

__all__ = ["Oracle"]

#: One evicted key in this many (by its hash: an unbiased sample) is followed to see whether it comes back.
_SAMPLE = 16


class Oracle(ProxyPolicy):
    """The lab's ceiling (see the module docstring).

    Args:
        rate_window_s: the time constant of the arrival rate's exponential average (s).
        comeback_s: an evicted block prefilled again within this long counts as one that came back (s).
        reuse_window: the recent evicted blocks (sampled) and requests its shares are taken over.
    """

    name = "oracle"
    needs = Needs(kv_events=True, engines=True)

    def __init__(self, rate_window_s: float = 60.0, comeback_s: float = 60.0, reuse_window: int = 1 << 14) -> None:
        super().__init__()
        self.pending: dict[str, int] = {}  # endpoint -> prompt tokens of its requests still to prefill
        self.pending_blocks: dict[str, int] = {}
        self._sent: dict[int, tuple[str, int, int]] = {}
        self.rate_window_s = rate_window_s
        self._rate = 0.0                  # arrivals per s (an exponential average, not yet corrected) ...
        self._rate_at: float | None = None  # ... as of this time
        self._start: float | None = None  # the first request's time
        self.found = 1.0    # recent requests whose prompt some engine had cached the start of (a prior of one)
        self.arrived = 2.0  # recent requests
        self.comeback_s = comeback_s
        self.reuse_window = reuse_window
        self._evicted: OrderedDict[int, float] = OrderedDict()  # a sample of evicted keys -> when, oldest first
        self.came_back = 1.0  # sampled evicted blocks stored again within comeback_s (a prior of one)
        self.gone = 1.0       # sampled evicted blocks not stored again within comeback_s

    @property
    def reuse(self) -> float:
        """The share of evicted cached blocks that a later request prefilled again within
        ``comeback_s`` (recent evictions, a sample of one key in :data:`_SAMPLE`)."""
        return self.came_back / (self.came_back + self.gone)

    def on_kv_events(self, events: Sequence[KvEvents]) -> None:
        evicted = self._evicted
        for batch in events:
            for ev in batch.events:
                if isinstance(ev, BlockRemoved):
                    for h in ev.block_hashes:
                        if not h % _SAMPLE:
                            evicted.pop(h, None)
                            evicted[h] = batch.at_s
                elif isinstance(ev, BlockStored):
                    for h in ev.block_hashes:
                        if not h % _SAMPLE and evicted.pop(h, None) is not None:
                            self.came_back += 1.0
            horizon = batch.at_s - self.comeback_s
            while evicted:
                h = next(iter(evicted))
                if evicted[h] > horizon:
                    break
                del evicted[h]
                self.gone += 1.0
        seen = self.came_back + self.gone
        if seen > self.reuse_window:
            self.came_back *= self.reuse_window / seen
            self.gone *= self.reuse_window / seen

    def arrival_rate(self, now: float) -> float:
        """Requests per s lately (an exponential average over ``rate_window_s``, corrected for the
        time before the first request, as the average starts at 0)."""
        if self._rate_at is None or self._start is None:
            return 0.0
        seen = 1.0 - math.exp((self._start - now) / self.rate_window_s)
        return self._rate * math.exp((self._rate_at - now) / self.rate_window_s) / seen if seen > 0 else 0.0

    def _llm_cost(self, engine: Any, address: str, users: list[int], tokens: int, output: int, now: float,
                  arrivals: float) -> tuple[float, int, int]:
        spec = engine.spec
        bs = spec.block_size
        new = max(1, tokens - len(users) * bs)
        c = spec.coefficients
        block_s = bs * c.beta1_us * 1e-6  # the prefill of one block
        decode_step_us = c.beta0_us + c.beta2_us * engine.running
        prefill = max(0, self.pending.get(address, 0) - engine.prefilled_tokens()) + new
        steps = math.ceil(prefill / spec.max_num_batched_tokens)
        ttft_s = engine.step_end_s(now) - now + (steps * decode_step_us + c.beta1_us * prefill) * 1e-6
        own_s = c.beta1_us * new * 1e-6  # the time its prefill adds to the engine's steps
        blocks = -(-(new + output) // bs)
        need = blocks + self.pending_blocks.get(address, 0)
        free = engine.free_blocks
        used = spec.num_blocks - free
        if need > free and used:
            # the running batch releases its blocks as its requests end: a request lives about
            # ``output`` decode steps, so the batch frees its blocks over that many steps
            release_s = max(1, output) * decode_step_us * 1e-6 / used  # per block
            ttft_s += (need - free) * release_s
            own_s += blocks * release_s  # the blocks it holds keep the requests behind it waiting
        # the requests that reach the engine while it waits or prefills wait for its prefill (and its
        # blocks) too; the blocks it takes (those its prompt and output fill, and the cached ones no
        # request was using) come first from the free blocks that hold nothing, then evict cached
        # blocks, each prefilled again by a later request as often as evicted blocks come back
        idle_hits = users.count(0)
        empty = free - engine.idle_cached_blocks
        evicts = min(blocks + idle_hits, max(0, need + idle_hits - empty))
        return ttft_s + arrivals * ttft_s * own_s + self.reuse * evicts * block_s, new, blocks

    def choose(self, request: Request, cluster: str, endpoints: Sequence[Endpoint]) -> Endpoint:
        assert self.ctx is not None
        engines = self.ctx.engines
        now = self.ctx.clock()
        if self._start is None:
            self._start = now
        output = request.max_tokens or 256
        best: list[tuple[Endpoint, int, int]] = []
        low = math.inf
        users: dict[str, list[int]] = {}
        keys: dict[int, tuple[int, ...]] = {}  # block size -> the prompt's keys
        for e in endpoints:
            engine = engines[e.address]
            if getattr(engine, "kind", "llm") == "llm":
                bs = engine.spec.block_size
                if bs not in keys:
                    keys[bs] = prompt_keys(request.prompt, bs)
                users[e.address] = engine.prefix_users(keys[bs])
        # who reaches an engine next: requests that find their prefix cached go where it is (the engine's
        # share of the cluster's cached blocks), the others anywhere
        rate = self.arrival_rate(now)
        found = self.found / self.arrived
        cached = {a: engines[a].cached_blocks for a in users}
        total = sum(cached.values())
        for e in endpoints:
            engine = engines[e.address]
            if e.address in users:
                share = cached[e.address] / total if total else 1.0 / len(users)
                arrivals = rate * (found * share + (1.0 - found) / len(users))
                cost, new, blocks = self._llm_cost(engine, e.address, users[e.address], request.prompt.tokens, output,
                                                   now, arrivals)
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
        self._rate = (self._rate * math.exp((self._rate_at - now) / self.rate_window_s) if self._rate_at is not None
                      else 0.0) + 1.0 / self.rate_window_s
        self._rate_at = now
        self.found += 1.0 if any(users.values()) else 0.0
        self.arrived += 1.0
        if self.arrived > self.reuse_window:
            self.found *= self.reuse_window / self.arrived
            self.arrived = float(self.reuse_window)
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
