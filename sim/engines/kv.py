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
which request holds which block id (they carry no key). Unkeyed free blocks are interchangeable, so
the free queue holds a run of them as one entry and gives them ids only when they are taken by name.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from functools import partial
from itertools import islice, repeat, takewhile
from operator import is_not

from sim.engines.api import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

#: Parent key of a sequence's first block (vLLM's ``NONE_HASH`` plays this role).
ROOT_HASH = 0

_FOUND = partial(is_not, None)  # a cache lookup that found a block


def chain_hashes(tokens: Sequence[int], block_size: int, *, start: int = 0,
                 parent: int = ROOT_HASH) -> list[int]:
    """Keys of the full blocks of ``tokens`` from block index ``start`` on: key_i =
    ``hash((key_(i-1), block_i))`` (``block_i`` the tuple of its token ids), ``parent`` being the
    key before block ``start``.

    Python's ``hash`` of an int tuple does not depend on ``PYTHONHASHSEED``, so keys agree across
    processes and runs.
    """
    out: list[int] = []
    append = out.append
    prev = parent
    tokens = tuple(tokens)
    blocks = iter(tokens[start * block_size:len(tokens) // block_size * block_size])
    for block in zip(*[blocks] * block_size, strict=False):  # the blocks' tuples, cut in C (the tail is whole)
        prev = hash((prev, block))
        append(prev)
    return out


class BlockPool:
    """``num_blocks`` KV blocks with a free queue and a prefix cache (see the module docstring).

    ``caching``: automatic prefix caching on. ``record_events``: keep KV-cache events for
    :meth:`drain_events`. Block ids are ints 0..num_blocks-1.
    """

    def __init__(self, num_blocks: int, block_size: int, *, caching: bool = True,
                 record_events: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        # The free queue: a deque of entries. ``block`` (>= 0): one keyed block, live while the block is
        # unused and this is its last entry (a block used again, or freed again, leaves its old entry
        # behind: skipped when it reaches the head); ``-k``: a run of k unkeyed free blocks, which have
        # no id until taken by name (ids not in use wait in ``_spare``).
        self._queue: deque[int] = deque([-num_blocks])
        self._spare = list(range(num_blocks - 1, -1, -1))
        self._entries = [0] * num_blocks  # each block's entries in the queue (its last one may be live)
        self._num_free = num_blocks
        self._ref = [0] * num_blocks
        self._key: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # key -> block id
        self._events: list[KvEvent] | None = [] if record_events else None
        self._anonymous = 0  # blocks held anonymously
        self.evicted = 0
        self._idle_cached = 0  # blocks with a key that no request uses (cached, evictable)
        #: Grows whenever the prefix cache or a block's users change (what :meth:`hits` and
        #: :meth:`count_free` answer): a caller may keep their answers while it stays the same.
        self.version = 0

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
    def num_idle_cached(self) -> int:
        """Blocks with a key that no request uses: free, but taking them evicts a cached block."""
        return self._idle_cached

    @property
    def num_cached(self) -> int:
        """Blocks with a key (in use or not)."""
        return len(self._cached)

    # --- the prefix cache -----------------------------------------------------------------------

    def hits(self, keys: Sequence[int], max_blocks: int) -> list[int]:
        """Blocks of the longest run of leading ``keys`` (at most ``max_blocks``) that are cached."""
        cached = self._cached
        if not self.caching or max_blocks <= 0 or not keys or keys[0] not in cached:
            return []
        return list(takewhile(_FOUND, map(cached.get, islice(keys, max_blocks))))  # in C, up to the first miss

    def count_free(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` no request uses."""
        return self.users(blocks).count(0)

    def users(self, blocks: Sequence[int]) -> list[int]:
        """How many requests use each of ``blocks``."""
        return list(map(self._ref.__getitem__, blocks))

    def store(self, blocks: Sequence[int], keys: Sequence[int], token_ids: Sequence[int],
              parent: int | None, now_s: float) -> None:
        """Key ``blocks`` (full, just scheduled) with ``keys``; ``token_ids``: their tokens,
        ``parent``: the key before the first (None at a sequence's start). One ``BlockStored``."""
        if not self.caching or not blocks:
            return
        cached, block_key = self._cached, self._key
        before = len(cached)
        unkeyed = list(map(block_key.__getitem__, blocks)).count(None) == len(blocks)
        if unkeyed and cached.keys().isdisjoint(keys):  # the usual case, in C: fresh blocks, keys not cached yet
            cached.update(zip(keys, blocks, strict=True))
            if len(cached) - before < len(keys):  # a key twice: undone, the loop below keys the first block
                deque(map(cached.pop, keys, repeat(None)), maxlen=0)
        if len(cached) - before == len(keys):
            for block, key in zip(blocks, keys, strict=True):
                block_key[block] = key
            stored: Sequence[int] = keys
        else:
            fresh = []
            for block, key in zip(blocks, keys, strict=True):
                if key in cached or block_key[block] is not None:
                    continue
                block_key[block] = key
                cached[key] = block
                fresh.append(key)
            stored = fresh
        if stored:
            self.version += 1
        if stored and self._events is not None:
            self._events.append(BlockStored(now_s, tuple(stored), parent, tuple(token_ids), self.block_size))

    # --- allocation -----------------------------------------------------------------------------

    def touch(self, blocks: Sequence[int]) -> None:
        """A request starts using ``blocks`` (its prefix-cache hits): off the free queue, one more user."""
        self.version += 1
        ref = self._ref
        was_free = 0
        for b in blocks:
            r = ref[b]
            if not r:
                was_free += 1  # its queue entry goes stale
            ref[b] = r + 1
        self._num_free -= was_free
        self._idle_cached -= was_free  # hits are keyed

    def take(self, n: int, now_s: float) -> list[int]:
        """``n`` blocks from the head of the free queue, evicting their keys. Raises ValueError when
        fewer than ``n`` are free (the scheduler checks first)."""
        out: list[int] = []
        self._pop(n, out, now_s)
        return out

    def take_anonymous(self, n: int, now_s: float) -> None:
        """Like :meth:`take`, for ``n`` blocks held anonymously (see the module docstring)."""
        if n:
            self._pop(n, None, now_s)
            self._anonymous += n

    def _pop(self, n: int, out: list[int] | None, now_s: float) -> None:
        """Take ``n`` blocks from the queue's head: by id into ``out``, or anonymously (None)."""
        if n > self._num_free:
            raise ValueError(f"{n} KV blocks asked, {self._num_free} free")
        self.version += 1
        evicted: list[int] = []
        queue, entries, ref, keys, spare, cached = \
            self._queue, self._entries, self._ref, self._key, self._spare, self._cached
        need = n
        while need:
            b = queue.popleft()
            if b < 0:  # a run of -b unkeyed blocks
                m = min(-b, need)
                if m < -b:
                    queue.appendleft(b + m)
                need -= m
                if out is not None:
                    ids = spare[-m:]
                    del spare[-m:]
                    for i in ids:
                        ref[i] = 1
                    out += ids
                continue
            left = entries[b] - 1
            entries[b] = left
            if left or ref[b]:
                continue  # stale: the block was used again or freed again since
            key = keys[b]
            if key is not None:
                keys[b] = None
                del cached[key]
                evicted.append(key)
                self._idle_cached -= 1
            need -= 1
            if out is None:
                spare.append(b)
            else:
                ref[b] = 1
                out.append(b)
        self._num_free -= n
        if evicted:
            self.evicted += len(evicted)
            if self._events is not None:
                self._events.append(BlockRemoved(now_s, tuple(evicted)))

    def adopt(self, n: int) -> list[int]:
        """Ids for ``n`` anonymously held blocks, now held by name (to key them or give them back)."""
        if n > self._anonymous:
            raise ValueError(f"{n} anonymous KV blocks asked, {self._anonymous} held")
        if not n:
            return []
        self.version += 1
        self._anonymous -= n
        out = self._spare[-n:]
        del self._spare[-n:]
        for b in out:
            self._ref[b] = 1
        return out

    def release_anonymous(self, n: int) -> None:
        """A request gives ``n`` anonymously held blocks back: unkeyed, at the free queue's end."""
        if n > self._anonymous:
            raise ValueError(f"{n} anonymous KV blocks given back, {self._anonymous} held")
        if n:
            self._anonymous -= n
            self._append_run(n)

    def _append_run(self, n: int) -> None:
        queue = self._queue
        if queue and queue[-1] < 0:
            queue[-1] -= n
        else:
            queue.append(-n)
        self._num_free += n

    def release(self, blocks: Sequence[int]) -> None:
        """A request gives ``blocks`` back (tail first): a block no one uses joins the free queue's
        end and keeps its key until taken (an unkeyed one joins as part of a run, without its id)."""
        self.version += 1
        ref, entries, keys, queue, spare = self._ref, self._entries, self._key, self._queue, self._spare
        run = 0  # unkeyed blocks freed since the last keyed one: they join as one run
        keyed = 0
        for b in reversed(blocks):
            r = ref[b] - 1
            ref[b] = r
            if r:
                continue
            if keys[b] is None:
                spare.append(b)
                run += 1
            else:
                if run:
                    self._append_run(run)
                    run = 0
                queue.append(b)
                entries[b] += 1
                keyed += 1
        if run:
            self._append_run(run)
        self._num_free += keyed
        self._idle_cached += keyed

    def reset(self, now_s: float) -> bool:
        """Drop every key (vLLM's ``reset_prefix_cache``); refused (False) while a request holds
        blocks. One ``AllBlocksCleared``."""
        if self.num_used:
            return False
        self.version += 1
        self._idle_cached = 0
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
