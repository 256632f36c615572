"""Which KV blocks each engine holds, mirrored from its KV events (Dynamo's indexer; the oracle's view).

vLLM publishes ``BlockStored`` (the block hashes that entered its prefix cache), ``BlockRemoved``
(evicted) and ``AllBlocksCleared``; a consumer that applies them in order holds the set of cached
blocks per engine. A request's *overlap* on an engine is the number of its leading blocks the
engine holds: block keys are chained (each covers every token before it), so a prefix walk stops
at the first miss, as Dynamo's radix-tree match does.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import takewhile

from bench.lab.policy import KvEvents
from sim.engines.api import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = ["KvIndex"]


class KvIndex:
    """``{endpoint: cached block keys}`` from KV events (membership only: no order is read from the sets)."""

    def __init__(self) -> None:
        self.cached: dict[str, set[int]] = {}

    def apply(self, events: Sequence[KvEvents]) -> None:
        """Apply engines' KV events, oldest first."""
        for batch in events:
            held = self.cached.setdefault(batch.endpoint, set())
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    held.update(ev.block_hashes)
                elif isinstance(ev, BlockRemoved):
                    held.difference_update(ev.block_hashes)
                elif isinstance(ev, AllBlocksCleared):
                    held.clear()

    def overlap(self, keys: Sequence[int], endpoint: str) -> int:
        """Leading blocks of ``keys`` the endpoint holds."""
        held = self.cached.get(endpoint)
        if not held or not keys or keys[0] not in held:
            return 0
        return len(list(takewhile(held.__contains__, keys)))  # the walk, in C
