"""``dynamo_kv``: NVIDIA Dynamo's KV router (``--router-mode kv``), fed by the engines' KV events.

Sources: Dynamo's docs, "Router Guide" / "Routing Concepts" / "Router Design" (docs.nvidia.com/
dynamo, v0.8.1 and v1.x): defaults ``--router-kv-overlap-score-weight`` 1 (the credit of cached
blocks in the prefill cost), ``--router-temperature`` 0 (the lowest cost wins; above 0 a softmax
over the costs), ``--kv-cache-block-size`` the backend's (vLLM's 16), KV events on; and the
design they describe:

- **cached blocks**, global: a prefix tree of the blocks each worker reported stored and not yet
  removed (vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events, which the
  router's indexer consumes); a request's *overlap* on a worker is the number of its leading
  blocks that worker holds;
- **active load**, local to the router: per worker, the prompt tokens of its requests that have
  not produced their first token yet (active prefill; the first token "signals prefill
  completion"), and the KV blocks of its requests in flight (active decode blocks, released when
  the request completes);
- cost per worker = ``overlap_weight x (active prefill tokens + this request's tokens not cached
  there) / block_size + (active decode blocks + this request's blocks)``; the lowest cost wins,
  ties drawn at random.

The block keys are the engines' own (:func:`sim.engines.kv.chain_hashes`, via
:func:`bench.lab.workloads.tokens.prompt_keys`): a request's keys are computed from its tokens exactly as
the engine keys the blocks it reports. The router's active
blocks grow with the prompt only (this router sees no per-token stream from the lab's engines: a
request's output blocks are not counted until it ends).
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.lab.policies.kvindex import KvIndex
from bench.lab.policies.proxy import ProxyPolicy
from bench.lab.policy import Endpoint, Finished, FirstToken, KvEvents, Needs, Progress, Request
from bench.lab.workloads.tokens import prompt_keys

__all__ = ["DynamoKv"]

class DynamoKv(ProxyPolicy):
    """Dynamo's KV router (see the module docstring for the source of each rule).

    Args:
        overlap_weight: ``--router-kv-overlap-score-weight`` (1.0).
        kv_event_delay_s: how late KV events reach the router (s; 0: as published).
    """

    name = "dynamo_kv"

    def __init__(self, overlap_weight: float = 1.0, kv_event_delay_s: float = 0.0) -> None:
        super().__init__()
        self.overlap_weight = overlap_weight
        self.needs = Needs(kv_events=True, kv_event_delay_s=kv_event_delay_s)
        self.index = KvIndex()
        self.prefill_tokens: dict[str, int] = {}
        self.decode_blocks: dict[str, int] = {}
        self._pending: dict[int, tuple[str, int, int]] = {}  # request -> (worker, prefill tokens, blocks)

    def on_kv_events(self, events: Sequence[KvEvents]) -> None:
        self.index.apply(events)

    def overlap(self, keys: Sequence[int], worker: str) -> int:
        """Leading blocks of ``keys`` the worker holds (its KV events so far)."""
        return self.index.overlap(keys, worker)

    def choose(self, request: Request, cluster: str, endpoints: Sequence[Endpoint]) -> Endpoint:
        assert self.ctx is not None
        bs = self.ctx.block_size
        keys = prompt_keys(request.prompt, bs)
        tokens = request.prompt.tokens
        blocks = -(-tokens // bs)
        best: list[tuple[Endpoint, int]] = []
        low = None
        for e in endpoints:
            new = tokens - self.overlap(keys, e.address) * bs
            cost = (self.overlap_weight * (self.prefill_tokens.get(e.address, 0) + new) / bs
                    + self.decode_blocks.get(e.address, 0) + blocks)
            if low is None or cost < low - 1e-9:
                low, best = cost, [(e, new)]
            elif cost <= low + 1e-9:
                best.append((e, new))
        chosen, new = best[self.ctx.rng.randrange(len(best))] if len(best) > 1 else best[0]
        a = chosen.address
        self.prefill_tokens[a] = self.prefill_tokens.get(a, 0) + new
        self.decode_blocks[a] = self.decode_blocks.get(a, 0) + blocks
        self._pending[request.id] = (a, new, blocks)
        return chosen

    def on_progress(self, events: Sequence[Progress]) -> None:
        for event in events:
            if isinstance(event, FirstToken):
                self._prefilled(event.request_id)
            elif isinstance(event, Finished):
                self._prefilled(event.request_id)
                got = self._pending.pop(event.request_id, None)
                if got is not None:
                    self.decode_blocks[got[0]] -= got[2]
                self.ended(event)

    def _prefilled(self, request_id: int) -> None:
        got = self._pending.get(request_id)
        if got is not None and got[1]:
            worker, new, blocks = got
            self.prefill_tokens[worker] -= new
            self._pending[request_id] = (worker, 0, blocks)
