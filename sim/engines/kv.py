"""KV blocks of an ``llm`` engine: the block pool, the automatic prefix cache, the KV-cache events.

Modelled on vLLM V1's ``BlockPool`` / ``KVCacheManager`` (``vllm/v1/core/block_pool.py``,
``vllm/v1/core/kv_cache_manager.py``):

- a fixed number of blocks of ``block_size`` tokens; a request holds a list of them;
- the **free queue** holds every block no request uses, least recently freed first; an allocation
  takes blocks from its head. A freed block keeps its key (it stays *cached*) until it is taken
  again, which evicts it (:class:`~sim.engines.api.BlockRemoved`). A request's blocks are freed
  tail first, so its last blocks are evicted before its first ones (vLLM frees "in reverse order
  so that the tail blocks are freed first");
- **automatic prefix caching**: a full block is keyed by the chained hash of every token up to its
  end (:func:`chain_hashes`); a new request uses the longest run of its leading keys that are
  cached (at most its length - 1 tokens: the last prompt token is always computed, for its
  logits), taking those blocks off the free queue. Blocks are keyed when the tokens that fill
  them are scheduled, as V1's ``cache_full_blocks`` does
  (:class:`~sim.engines.api.BlockStored`);
- ``usage`` = blocks in use / all blocks (vLLM's ``kv_cache_usage_perc``: cached blocks no request
  uses count as free).

A block whose key another block already has stays unkeyed (the cache keeps one copy per key).

Blocks that hold generated tokens can be held *anonymously* (:meth:`BlockPool.take_anonymous`):
the pool takes them from the free queue like any other (evicting what they held) and counts them,
and the engine says only how many of them a request gives back, so it need not track per step
which request holds which block id (they carry no key).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from sim.engines.api import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

#: Parent key of a sequence's first block (vLLM's ``NONE_HASH`` plays this role).
ROOT_HASH = 0

_ID_BITS = 24  # block ids per pool: at most 2**24 (a free-queue entry packs a stamp above the id)
_ID_MASK = (1 << _ID_BITS) - 1


def chain_hashes(tokens: Sequence[int], block_size: int, *, start: int = 0,
                 parent: int = ROOT_HASH) -> list[int]:
    """Keys of the full blocks of ``tokens`` from block index ``start`` on: key_i =
    ``hash((key_(i-1), block_i))`` (``block_i`` the tuple of its token ids), ``parent`` being the
    key before block ``start``.

    Python's ``hash`` of an int tuple does not depend on ``PYTHONHASHSEED``, so keys agree across
    processes and runs.
    """
    out: list[int] = []
    prev = parent
    tokens = tuple(tokens)
    for i in range(start, len(tokens) // block_size):
        prev = hash((prev, tokens[i * block_size:(i + 1) * block_size]))
        out.append(prev)
    return out


class BlockPool:
    """``num_blocks`` KV blocks with a free queue and a prefix cache (see the module docstring).

    ``caching``: automatic prefix caching on. ``record_events``: keep KV-cache events for
    :meth:`drain_events`. Block ids are ints 0..num_blocks-1.
    """

    def __init__(self, num_blocks: int, block_size: int, *, caching: bool = True,
                 record_events: bool = False) -> None:
        if not 1 <= num_blocks < 1 << _ID_BITS or block_size < 1:
            raise ValueError(f"num_blocks must be 1-{(1 << _ID_BITS) - 1} and block_size >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        # The free queue: a deque of entries ``stamp << _ID_BITS | block``; an entry is live while the
        # block is unused and ``stamp`` is the block's latest (a block used again, or freed again,
        # leaves its old entry behind: skipped when it reaches the head).
        self._queue: deque[int] = deque(range(num_blocks))
        self._stamp = [0] * num_blocks
        self._num_free = num_blocks
        self._ref = [0] * num_blocks
        self._key: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # key -> block id
        self._events: list[KvEvent] | None = [] if record_events else None
        self._anonymous: list[int] = []  # ids of blocks held anonymously
        self.evicted = 0

    # --- views ----------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks no request uses (cached or not): what an allocation can take."""
        return self._num_free

    @property
    def num_used(self) -> int:
        """Blocks requests use."""
        return self.num_blocks - self._num_free

    @property
    def usage(self) -> float:
        """Blocks in use / all blocks, 0-1."""
        return (self.num_blocks - self._num_free) / self.num_blocks

    @property
    def num_cached(self) -> int:
        """Blocks with a key (in use or not)."""
        return len(self._cached)

    def is_free(self, block: int) -> bool:
        """True when no request uses ``block``."""
        return self._ref[block] == 0

    # --- the prefix cache -----------------------------------------------------------------------

    def hits(self, keys: Sequence[int], max_blocks: int) -> list[int]:
        """Blocks of the longest run of leading ``keys`` (at most ``max_blocks``) that are cached."""
        out: list[int] = []
        if not self.caching:
            return out
        cached = self._cached
        for key in keys[:max_blocks]:
            block = cached.get(key)
            if block is None:
                break
            out.append(block)
        return out

    def store(self, blocks: Sequence[int], keys: Sequence[int], token_ids: Sequence[int],
              parent: int | None, now_s: float) -> None:
        """Key ``blocks`` (full, just scheduled) with ``keys``; ``token_ids``: their tokens,
        ``parent``: the key before the first (None at a sequence's start). One ``BlockStored``."""
        if not self.caching or not blocks:
            return
        stored: list[int] = []
        for block, key in zip(blocks, keys, strict=True):
            if key in self._cached or self._key[block] is not None:
                continue
            self._key[block] = key
            self._cached[key] = block
            stored.append(key)
        if stored and self._events is not None:
            self._events.append(BlockStored(now_s, tuple(stored), parent, tuple(token_ids), self.block_size))

    # --- allocation -----------------------------------------------------------------------------

    def touch(self, blocks: Sequence[int]) -> None:
        """A request starts using ``blocks`` (its prefix-cache hits): off the free queue, one more user."""
        ref = self._ref
        for b in blocks:
            if ref[b] == 0:
                self._num_free -= 1  # its queue entry goes stale
            ref[b] += 1

    def take(self, n: int, now_s: float) -> list[int]:
        """``n`` blocks from the head of the free queue, evicting their keys. Raises ValueError when
        fewer than ``n`` are free (the scheduler checks first)."""
        if n > self._num_free:
            raise ValueError(f"{n} KV blocks asked, {self._num_free} free")
        out: list[int] = []
        evicted: list[int] = []
        queue, stamp, ref, keys = self._queue, self._stamp, self._ref, self._key
        popleft = queue.popleft
        while len(out) < n:
            entry = popleft()
            b = entry & _ID_MASK
            if ref[b] or entry >> _ID_BITS != stamp[b]:
                continue  # stale: the block was used again or freed again since
            key = keys[b]
            if key is not None:
                keys[b] = None
                del self._cached[key]
                evicted.append(key)
            ref[b] = 1
            out.append(b)
        self._num_free -= n
        if evicted:
            self.evicted += len(evicted)
            if self._events is not None:
                self._events.append(BlockRemoved(now_s, tuple(evicted)))
        return out

    def take_anonymous(self, n: int, now_s: float) -> None:
        """Like :meth:`take`, for ``n`` blocks held anonymously (see the module docstring)."""
        if n:
            self._anonymous += self.take(n, now_s)

    def adopt(self, n: int) -> list[int]:
        """Ids of ``n`` anonymously held blocks, now held by name (to key them or give them back)."""
        if n > len(self._anonymous):
            raise ValueError(f"{n} anonymous KV blocks asked, {len(self._anonymous)} held")
        if not n:
            return []
        out = self._anonymous[-n:]
        del self._anonymous[-n:]
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """A request gives ``blocks`` back (tail first): a block no one uses joins the free queue's
        end and keeps its key until taken."""
        ref, stamp, append = self._ref, self._stamp, self._queue.append
        for b in reversed(blocks):
            ref[b] -= 1
            if ref[b] == 0:
                stamp[b] += 1
                append(stamp[b] << _ID_BITS | b)
                self._num_free += 1

    def reset(self, now_s: float) -> bool:
        """Drop every key (vLLM's ``reset_prefix_cache``); refused (False) while a request holds
        blocks. One ``AllBlocksCleared``."""
        if self.num_used:
            return False
        self._cached.clear()
        self._key = [None] * self.num_blocks
        if self._events is not None:
            self._events.append(AllBlocksCleared(now_s))
        return True

    def drain_events(self) -> list[KvEvent]:
        """KV-cache events since the last drain, oldest first (none unless ``record_events``)."""
        if not self._events:
            return []
        out, self._events = self._events, []
        return out
