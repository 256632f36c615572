"""``inferlb_precise``: the ``inferlb`` picker with its prefix-cache index fed by the engines' KV events.

Everything is the ``inferlb`` policy's (:mod:`bench.lab.policies.inferlb`: the real handler, its
scheduling profile, its loads and queues) except the prefix-cache index the ``prefix-cache`` scorer
reads: :class:`ext_proc.prefix_events.EventIndex` instead of the approximate
:class:`ext_proc.prefix_index.PrefixIndex`, as llm-d's precise prefix scorer replaces its approximate
one.

- **Keys.** A prompt's block keys are the engines' own (:func:`bench.lab.workloads.tokens.prompt_keys`:
  the prompt's token ids as the engines' tokenizer makes them, in the engines' blocks, chained as the
  engine chains them), not the approximate index's byte blocks: the precise scorer tokenizes the
  prompt and computes the engine's block hashes (llm-d's ``llm-d-kv-cache``). They replace the body's
  byte-block keys in :attr:`ext_proc.picker.BodyFields.blocks`, and the body follows no conversation
  (:attr:`~ext_proc.picker.BodyFields.continued` None), as the handler's body reading gives it when the
  index is keyed as the engine keys (``picker.engine_block_size``): the engines' events hold a
  conversation's replies, which the approximate index infers. The handler's request path is otherwise
  unchanged.
- **Events.** Each engine's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` reach the index
  ``kv_event_delay_s`` after the engine published them (:attr:`bench.lab.policy.Needs.kv_event_delay_s`).
  Its bound per endpoint is the picker's ``prefix_cache_tokens`` in blocks (what an engine's KV cache
  holds, as docs/picker.md asks an operator to set it).
- **Pending keys.** The picker's own picks count for ``pending_s`` until the events confirm them
  (:data:`ext_proc.prefix_events.PENDING_S`; 0: events alone).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from bench.lab.policies.inferlb import Inferlb
from bench.lab.policy import Context, KvEvents, Request
from bench.lab.workloads.tokens import prompt_keys
from ext_proc.body import NO_BODY
from ext_proc.prefix_events import PENDING_S, EventIndex
from sim.engines.api import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = ["KV_EVENT_DELAY_S", "InferlbPrecise"]

#: How late an engine's KV events reach the picker (s), the lab's choice: a ZMQ hop and the
#: subscriber's batch (vLLM publishes a batch per engine step, ~10-50 ms apart).
KV_EVENT_DELAY_S = 0.05


class InferlbPrecise(Inferlb):
    """The ``inferlb`` policy with the KV-event-fed prefix index (see the module docstring).

    Args:
        kv_event_delay_s: how late KV events reach the picker (s, >= 0; :data:`KV_EVENT_DELAY_S`).
        pending_s: how long a picked prompt's keys count before its events confirm them (s, >= 0;
            :data:`ext_proc.prefix_events.PENDING_S`).
    """

    name = "inferlb_precise"

    def __init__(self, kv_event_delay_s: float = KV_EVENT_DELAY_S, pending_s: float = PENDING_S) -> None:
        super().__init__()
        if not kv_event_delay_s >= 0:
            raise ValueError(f"kv_event_delay_s must be >= 0, got {kv_event_delay_s}")
        self.kv_event_delay_s = kv_event_delay_s
        self.pending_s = pending_s
        self.needs = dataclasses.replace(self.needs, kv_events=True, kv_event_delay_s=kv_event_delay_s)
        self.index: EventIndex | None = None
        self._capacity = 0
        self._block_size = 16

    def start(self, ctx: Context) -> None:
        super().start(ctx)
        assert self.handler is not None
        self.needs = dataclasses.replace(self.needs, kv_events=True, kv_event_delay_s=self.kv_event_delay_s)
        self.index = EventIndex(self.pending_s, clock=ctx.clock)
        self.handler.control.prefixes = self.index  # type: ignore[assignment]
        self._block_size = ctx.block_size
        self._capacity = self.routing.prefix_cache_tokens // ctx.block_size

    def _body(self, request: Request) -> Any:
        fields = super()._body(request)
        if fields is NO_BODY or not self.routing.prefix_cache_tokens:  # no body read, or the prefix index off
            return fields
        return fields._replace(blocks=prompt_keys(request.prompt, self._block_size), continued=None)

    def on_kv_events(self, events: Sequence[KvEvents]) -> None:
        index, capacity = self.index, self._capacity
        assert index is not None
        for batch in events:
            endpoint = batch.endpoint
            for event in batch.events:
                if isinstance(event, BlockStored):
                    index.stored(endpoint, event.block_hashes, event.parent_block_hash, capacity)
                elif isinstance(event, BlockRemoved):
                    index.removed(endpoint, event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    index.cleared(endpoint)

