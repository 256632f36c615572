"""The picker's own keys for an engine's stored blocks, from the token ids its events carry (pure).

vLLM names a block in its KV-cache events by its own hash: sha256 (or a builtin hash) over a
serialization of the parent's hash, the block's token ids and its extra keys, chained from a seed
that is random per start unless ``PYTHONHASHSEED`` is set (``vllm/v1/core/kv_cache_utils.py``). A
router that keys a request by that hash must reproduce all of it. It need not: every
``BlockStored`` also carries the blocks' ``token_ids`` and ``parent_block_hash``
(``vllm/distributed/kv_events.py``), so :class:`OwnKeys` gives each stored block the picker's own
chained key (:func:`ext_proc.engine_keys.chain_keys` of its tokens from its parent's own key) and
remembers, per endpoint, engine hash -> own key, so a ``BlockRemoved`` (hashes only) removes the
right own key. A request is keyed the same way from its token ids
(:func:`ext_proc.engine_keys.vllm_keys`), so the engine's hash function and seed never matter.

- **Parents.** vLLM publishes a ``BlockStored`` for the blocks a request newly caches, in chain order,
  with ``parent_block_hash`` the hash of the block before the first: a block it already held (a
  prefix hit), whose own ``BlockStored`` came earlier, or None at the prompt's start. A parent this
  map does not know (its event lost, published before the picker subscribed, or forgotten by the
  bound) leaves the chain's tokens before the first block unknown, so its own keys cannot be
  computed: the event is dropped, and the index under-counts that chain until vLLM stores it again
  (as :meth:`ext_proc.prefix_events.EventIndex.stored` does for an unknown parent).
- **Blocks the picker cannot key** (a LoRA adapter's, a multimodal input's, a ``cache_salt``'s: their
  hashes cover more than tokens; ``tokens`` None from :func:`ext_proc.kv_events.decode_batch`) get no
  own key, so their descendants are dropped too.
- **Bound.** At most ``capacity`` entries per endpoint (the index's own bound): the engine's removals
  keep it there; past it (removals lost) the longest-held go first, with the ancestors held
  through them.

Not thread-safe (the picker's event loop owns it, as it owns the index).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from ext_proc.engine_keys import chain_keys

__all__ = ["OwnKeys"]


class OwnKeys:
    """Per endpoint, engine block hash -> the picker's own key of that block (see the module docstring).

    Memory: one dictionary entry (two ints) per block an endpoint holds, at most ``capacity`` each,
    and at most as many parents searched in vain (:meth:`resolve`).
    """

    __slots__ = ("_inferred", "_missed", "_own")

    def __init__(self) -> None:
        self._own: dict[str, OrderedDict[int, int]] = {}
        self._inferred: dict[str, dict[int, tuple[int, ...]]] = {}  # parent hash -> ancestors held through it
        self._missed: dict[str, dict[int, int]] = {}  # parent hash -> the sent count when searched in vain

    def stored(self, endpoint: str, hashes: Sequence[int], parent: int | None, tokens: Sequence[int] | None,
               block_size: int, capacity: int) -> tuple[tuple[int, ...], int | None] | None:
        """``endpoint``'s ``BlockStored`` of engine ``hashes`` (chain order; ``parent`` the engine hash
        before the first, None at a prompt's start) holding ``tokens`` (``block_size`` per block): the
        blocks' own keys and the own key of their parent (None at a start), remembered; None when
        they cannot be keyed (an unknown parent, ``tokens`` None, or not ``block_size`` tokens a block),
        and then nothing is remembered."""
        own = self._own.get(endpoint)
        if parent is None:
            start, own_parent = 0, None
        else:
            own_parent = None if own is None else own.get(parent)
            if own_parent is None:
                return None
            start = own_parent
        if tokens is None or block_size < 1 or not hashes or len(tokens) != len(hashes) * block_size:
            return None
        keys = chain_keys(tokens, block_size, start)
        if capacity <= 0:
            return keys, own_parent
        if own is None:
            own = self._own[endpoint] = OrderedDict()
        for engine_hash, key in zip(hashes, keys, strict=True):
            own[engine_hash] = key
            own.move_to_end(engine_hash)
        self._bound(endpoint, own, capacity)
        return keys, own_parent

    def _bound(self, endpoint: str, own: OrderedDict[int, int], capacity: int) -> None:
        inferred = self._inferred.get(endpoint)
        while len(own) > capacity:
            engine_hash, _ = own.popitem(last=False)
            if inferred:
                inferred.pop(engine_hash, None)

    def resolve(self, endpoint: str, parent: int, tokens: Sequence[int] | None, block_size: int,
                recent: Iterable[Sequence[int]], sent: int, capacity: int) -> tuple[int, ...] | None:
        """An unknown ``parent`` (engine hash) of a ``BlockStored`` holding ``tokens`` found among
        ``recent`` prompts' own keys (the newest last; see the module docstring): the own keys of
        the chain up to and including it, the parent's own key remembered and its ancestors held
        through it; None when no prompt has it (nothing remembered). ``sent``: how many prompts the
        picker had sent when ``recent`` was read (:meth:`EventIndex.last_sent`): a parent searched in
        vain is searched again only once another prompt was sent there. Costs a tuple hash per key
        of each recent prompt that does not have it (~0.24 µs each: 1.2 ms for 8 prompts of 450 keys)."""
        if tokens is None or block_size < 1 or len(tokens) < block_size or capacity <= 0:
            return None
        missed = self._missed.get(endpoint)
        if missed is not None and missed.get(parent, -1) >= sent:
            return None
        first = tuple(tokens[:block_size])
        for keys in reversed(list(recent)):
            for i in range(1, len(keys)):
                if hash((keys[i - 1], first)) == keys[i]:
                    chain = tuple(keys[:i])
                    own = self._own.get(endpoint)
                    if own is None:
                        own = self._own[endpoint] = OrderedDict()
                    own[parent] = chain[-1]
                    own.move_to_end(parent)
                    self._inferred.setdefault(endpoint, {})[parent] = chain[:-1]
                    self._bound(endpoint, own, capacity)
                    return chain
        if missed is None or len(missed) >= capacity:  # bounded: forgotten at once, searched again
            missed = self._missed[endpoint] = {}
        missed[parent] = sent
        return None

    def removed(self, endpoint: str, hashes: Iterable[int]) -> list[int]:
        """``endpoint``'s ``BlockRemoved``: the own keys of those of ``hashes`` it knows, and of the
        ancestors held through them (:meth:`resolve`), forgotten."""
        own = self._own.get(endpoint)
        if own is None:
            return []
        inferred = self._inferred.get(endpoint)
        out = []
        for engine_hash in hashes:
            key = own.pop(engine_hash, None)
            if key is not None:
                out.append(key)
                if inferred:
                    out.extend(inferred.pop(engine_hash, ()))
        if not own:
            del self._own[endpoint]
            self._inferred.pop(endpoint, None)
        return out

    def cleared(self, endpoint: str) -> None:
        """``endpoint``'s ``AllBlocksCleared`` (or its publisher's restart): it holds nothing."""
        self._own.pop(endpoint, None)
        self._inferred.pop(endpoint, None)
        self._missed.pop(endpoint, None)

    def retain(self, endpoints: Iterable[str]) -> None:
        """Forget every endpoint not in ``endpoints`` (it left the view)."""
        keep = set(endpoints)
        for table in (self._own, self._inferred, self._missed):
            for e in [e for e in table if e not in keep]:
                del table[e]

    def known(self, endpoint: str) -> int:
        """How many engine hashes of ``endpoint`` have an own key."""
        own = self._own.get(endpoint)
        return 0 if own is None else len(own)
