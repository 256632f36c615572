"""``llm_d``: the llm-d / Gateway API Inference Extension endpoint picker's default scheduling profile.

Source read: llm-d/llm-d-inference-scheduler at commit 520af478 (2026-05-17, after v0.8.0; the
EPP code of the Gateway API Inference Extension now lives there, Go module ``llm-d-router``):

- the default profile (``config/charts/epplib/templates/_config.yaml``, ``default-plugins.yaml``):
  ``queue-scorer`` weight 2, ``kv-cache-utilization-scorer`` weight 2, ``prefix-cache-scorer``
  weight 3, and the ``max-score-picker`` the config loader adds (``pkg/epp/config/loader/defaults.go``);
  no filter; scores are summed with their weights (``pkg/epp/scheduling/scheduler_profile.go``);
- ``approx-prefix-cache-producer`` (``pkg/epp/framework/plugins/requestcontrol/dataproducer/
  approximateprefix``): the prompt's bytes (``json.Marshal`` of the chat messages; a completion's
  text) cut to ``maxPrefixBlocksToMatch`` (256) blocks of ``blockSizeTokens`` x 4 characters
  (``averageCharactersPerToken``; the block size auto-tuned from the engines' ``cache_config_info``:
  16 tokens, so 64 characters); a chain of hashes, the first seeded with the model name, each block
  hashed with the one before, a partial last block included; per endpoint an LRU index of the
  hashes of the requests it was *sent* (``PreRequest``), its capacity the endpoint's number of GPU
  KV blocks (auto-tuned; 31 250 without metrics); the match walks the request's hashes in order,
  counting for each endpoint the hashes it holds, and stops at the first hash no endpoint holds;
- ``prefix-cache-scorer``: matched blocks / the request's blocks;
- ``queue-scorer``: ``(max waiting - waiting) / (max - min)`` over the candidates, 1 when all equal;
- ``kv-cache-utilization-scorer``: ``1 - kv_cache_usage``;
- ``max-score-picker``: the highest total, ties broken by a shuffle;
- the metrics (waiting queue, KV-cache usage, cache config) are scraped from every model server
  every ``refresh-metrics-interval`` (50 ms, ``pkg/epp/server/options.go``);
- admission: the default (legacy) admission sheds only requests of priority < 0; the requests here
  have priority 0, so none is held or refused.

Hashes here are 8-byte BLAKE2b digests, each block hashed with the digest before it (theirs: xxHash64);
the chain and what it covers are theirs.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from itertools import repeat
from operator import or_

import orjson

from bench.lab.policies.proxy import ProxyPolicy
from bench.lab.policy import (
    CACHE_BLOCK_SIZE,
    CACHE_BLOCKS,
    KV_USAGE,
    WAITING,
    Endpoint,
    Message,
    Needs,
    Request,
    Sample,
)

__all__ = ["LlmD", "prompt_hashes"]

#: ``averageCharactersPerToken`` of the approximate prefix producer.
CHARS_PER_TOKEN = 4
#: ``defaultMaxPrefixBlocks``.
MAX_PREFIX_BLOCKS = 256
#: ``defaultLRUCapacityPerServer`` (used while an endpoint's KV block count is unknown).
DEFAULT_LRU_CAPACITY = 31250
#: ``refresh-metrics-interval`` (s).
REFRESH_METRICS_S = 0.05


def _h(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=8).digest()


#: Hashes of recent prompts' leading messages: ``(model, block characters, messages) -> the chain's hashes
#: of the full blocks of the bytes every longer prompt shares`` (the JSON but its closing bracket; a
#: completion's text), the oldest dropped beyond :data:`_PREFIXES_KEPT`.
_PREFIXES: OrderedDict[tuple[bytes, int, tuple[Message, ...]], tuple[bytes, ...]] = OrderedDict()
_PREFIXES_KEPT = 4096


def _remember(prefix: tuple[bytes, int, tuple[Message, ...]], hashes: tuple[bytes, ...]) -> None:
    _PREFIXES[prefix] = hashes
    if len(_PREFIXES) > _PREFIXES_KEPT:
        _PREFIXES.popitem(last=False)


def prompt_hashes(request: Request, block_tokens: int, max_blocks: int = MAX_PREFIX_BLOCKS) -> tuple[bytes, ...]:
    """The approximate prefix producer's block hashes of ``request`` (none for a prompt shorter than
    one block). Chat: the messages as JSON (``[{"role", "content"}, ...]``), completion: its text.

    The chain's hashes of the blocks a recent prompt with the same leading messages covered (a chat's
    previous turn, a group's system message, the same prompt again) are reused: only the rest is hashed."""
    prompt = request.prompt
    messages = prompt.messages
    if prompt.chat:
        data = orjson.dumps([{"role": m.role, "content": m.text} for m in messages])
        shared = len(data) - 1  # a chat with more messages starts with the same bytes but the closing "]"
    else:
        data = prompt.text.encode()
        shared = len(data)
    block = block_tokens * CHARS_PER_TOKEN
    if block <= 0 or len(data) < block:
        return ()
    model = (request.model or "").encode()
    data = data[:max_blocks * block]
    known: tuple[bytes, ...] = ()
    for n in range(len(messages), 0, -1):
        known = _PREFIXES.get((model, block, messages[:n]), ())
        if known:
            known = known[:max_blocks]
            break
    out = list(known)
    prev = known[-1] if known else _h(model)
    for i in range(len(known) * block, len(data), block):
        prev = _h(data[i:i + block] + prev)
        out.append(prev)
    hashes = tuple(out)
    _remember((model, block, messages), hashes[:shared // block])
    if len(messages) > 1 and (model, block, messages[:1]) not in _PREFIXES:
        first = messages[0]
        head = 1 + len(orjson.dumps({"role": first.role, "content": first.text})) if prompt.chat \
            else len(first.text.encode())
        _remember((model, block, messages[:1]), hashes[:head // block])
    return hashes


class _Index:
    """The approximate prefix producer's indexer: per endpoint an LRU of hashes, and per hash the endpoints
    holding it (a bit mask over the endpoints in the order the index first saw them, so adding a
    request's hashes is a few bulk dict operations)."""

    def __init__(self) -> None:
        self.lru: dict[str, OrderedDict[bytes, None]] = {}
        self.capacity: dict[str, int] = {}
        self.bit: dict[str, int] = {}
        self.endpoints: list[str] = []  # by bit
        self.holders: dict[bytes, int] = {}  # hash -> endpoints' bits

    def add(self, hashes: Sequence[bytes], endpoint: str, capacity: int) -> None:
        """``hashes`` were sent to ``endpoint``: each moves to the newest end of its LRU (inserted
        when absent), the oldest going out while the LRU holds more than its capacity."""
        lru = self.lru.get(endpoint)
        if lru is None:
            lru = self.lru[endpoint] = OrderedDict()
            self.capacity[endpoint] = capacity
            self.bit[endpoint] = 1 << len(self.endpoints)
            self.endpoints.append(endpoint)
        cap = self.capacity[endpoint]
        if cap < len(hashes) or len(dict.fromkeys(hashes)) < len(hashes):
            for h in hashes:  # one by one: a hash may go out before its turn comes
                if h in lru:
                    lru.move_to_end(h)
                else:
                    lru[h] = None
                    if len(lru) > cap:
                        self._drop(lru.popitem(last=False)[0], endpoint)
        else:
            # the same result in bulk: the hashes leave and join the newest end in order, then the
            # oldest go (none of them, as the capacity holds them all)
            deque(map(lru.pop, hashes, repeat(None)), maxlen=0)
            lru.update(dict.fromkeys(hashes))
            if len(lru) > cap:
                self._drop_oldest(lru, len(lru) - cap, endpoint)
        holders = self.holders  # each hash's endpoints gain this one, in C
        held = map(or_, map(holders.get, hashes, repeat(0)), repeat(self.bit[endpoint]))
        holders.update(zip(hashes, held, strict=True))

    def _drop(self, h: bytes, endpoint: str) -> None:
        held = self.holders[h] & ~self.bit[endpoint]
        if held:
            self.holders[h] = held
        else:
            del self.holders[h]

    def _drop_oldest(self, lru: OrderedDict[bytes, None], n: int, endpoint: str) -> None:
        """The ``n`` oldest hashes leave ``endpoint``'s LRU, and it leaves their holders."""
        gone = [lru.popitem(last=False)[0] for _ in range(n)]
        holders, keep = self.holders, ~self.bit[endpoint]
        for h, held in zip(gone, map(holders.__getitem__, gone), strict=True):
            held &= keep
            if held:
                holders[h] = held
            else:
                del holders[h]

    def match(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """``{endpoint: hashes it holds}`` walking ``hashes`` until one no endpoint holds."""
        found = list(map(self.holders.get, hashes))  # looked up in C; cut at the first hash no one holds
        if None in found:
            del found[found.index(None):]
        out: dict[str, int] = {}
        for held, n in Counter(found).items():  # a few distinct sets of endpoints
            while held:
                low = held & -held
                endpoint = self.endpoints[low.bit_length() - 1]
                out[endpoint] = out.get(endpoint, 0) + n
                held ^= low
        return out


class LlmD(ProxyPolicy):
    """llm-d's endpoint picker, default profile (see the module docstring for every rule's source).

    Args:
        queue_weight, kv_weight, prefix_weight: the scorers' weights (2, 2, 3).
        block_tokens: the prefix block size in tokens when the engines do not report theirs (16).
        scrape_interval_s: the metrics refresh interval (0.05 s).
    """

    name = "llm_d"

    def __init__(self, queue_weight: float = 2.0, kv_weight: float = 2.0, prefix_weight: float = 3.0,
                 block_tokens: int = 16, scrape_interval_s: float = REFRESH_METRICS_S) -> None:
        super().__init__()
        self.weights = (queue_weight, kv_weight, prefix_weight)
        self.block_tokens = block_tokens
        self.needs = Needs(scrape_interval_s=scrape_interval_s)
        self.waiting: dict[str, float] = {}
        self.kv_usage: dict[str, float] = {}
        self.kv_blocks: dict[str, int] = {}
        self.block_size: int | None = None
        self.index = _Index()

    def on_samples(self, samples: Sequence[Sample]) -> None:
        for s in samples:
            self.waiting[s.endpoint] = s.values.get(WAITING, 0.0)
            self.kv_usage[s.endpoint] = s.values.get(KV_USAGE, 0.0)
            blocks = s.values.get(CACHE_BLOCKS)
            if blocks:
                self.kv_blocks[s.endpoint] = int(blocks)
            size = s.values.get(CACHE_BLOCK_SIZE)
            if size and self.block_size is None:  # auto-tuned from the first endpoint that tells
                self.block_size = int(size)

    def choose(self, request: Request, cluster: str, endpoints: Sequence[Endpoint]) -> Endpoint:
        assert self.ctx is not None
        hashes = prompt_hashes(request, self.block_size or self.block_tokens)
        matched = self.index.match(hashes) if hashes else {}
        queues = [self.waiting.get(e.address, 0.0) for e in endpoints]
        low, high = min(queues), max(queues)
        wq, wk, wp = self.weights
        order = list(range(len(endpoints)))
        self.ctx.rng.shuffle(order)  # the max-score picker's shuffle: ties go to a random one
        best, best_score = order[0], -1.0
        for i in order:
            e = endpoints[i]
            queue = 1.0 if high == low else (high - queues[i]) / (high - low)
            kv = 1.0 - self.kv_usage.get(e.address, 0.0)
            prefix = matched.get(e.address, 0) / len(hashes) if hashes else 0.0
            score = wq * min(max(queue, 0.0), 1.0) + wk * min(max(kv, 0.0), 1.0) + wp * prefix
            if score > best_score:
                best, best_score = i, score
        chosen = endpoints[best]
        if hashes:
            self.index.add(hashes, chosen.address, self.kv_blocks.get(chosen.address, DEFAULT_LRU_CAPACITY))
        return chosen
