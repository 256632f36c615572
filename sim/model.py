"""Pure simulation model of one GPU inference node: no I/O, no asyncio, no clocks.

Covers the GPU classes, the tokenizer, the time model (prefill and decode), GPU memory and the
vLLM-style automatic prefix cache (KV blocks keyed by the hash of every token up to them), and GPU
utilisation. Everything here is deterministic given its inputs.

Time model (A100 class, ``time_scale`` 1; other classes multiply every time by their
``latency_factor``):

- prefill: :data:`PREFILL_MS_PER_TOKEN` ms per *uncached* prompt token (10 000 tokens/s, the order
  of a 7B model on one A100); the first token comes out at the end of the prefill, so
  TTFT = queueing + prefill;
- decode: every further token takes one step of :func:`decode_step_ms` (batch) ms, the batch being
  the requests running at that moment. The step is set so that the *reference short request*
  (:data:`REF_PROMPT_TOKENS` uncached prompt tokens, :data:`REF_OUTPUT_TOKENS` output tokens) takes
  exactly :func:`base_latency_ms` end to end: 50 ms alone, 95 ms with 2 running, 220 ms with 4.
"""

from __future__ import annotations

import random
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: Memory held by the weights of a 7B model in fp16, MiB.
DEFAULT_WEIGHTS_MIB = 14336.0

#: KV cache of one token of a 7B Llama-2-class model in fp16: 2 (K, V) x 32 layers x 4096 x 2 bytes, MiB.
DEFAULT_KV_MIB_PER_TOKEN = 0.5

#: Field figures for a short request of a 7B model on one A100: (requests in flight, end-to-end latency ms).
LATENCY_TABLE_MS: tuple[tuple[int, float], ...] = ((1, 50.0), (2, 95.0), (4, 220.0))

#: Multiplier of a long-tail request's latency.
LONG_TAIL_FACTOR = 10.0

#: A100 prefill cost per uncached prompt token, ms (10 000 tokens/s).
PREFILL_MS_PER_TOKEN = 0.1

#: The reference short request whose end-to-end latency is :data:`LATENCY_TABLE_MS`.
REF_PROMPT_TOKENS = 16
REF_OUTPUT_TOKENS = 16

#: Tokens per KV block (vLLM's default ``--block-size``).
BLOCK_SIZE = 16

#: Bytes of rendered prompt per token, and the vocabulary the token ids fall in (see :func:`tokenize`).
BYTES_PER_TOKEN = 4
VOCAB_SIZE = 32000


@dataclass(frozen=True)
class GpuClass:
    """One GPU model: ``latency_factor`` multiplies A100 latency; ``memory_mib`` is total memory."""

    key: str
    dcgm_model_name: str
    latency_factor: float
    memory_mib: int


GPU_CLASSES: dict[str, GpuClass] = {
    "a100": GpuClass("a100", "NVIDIA A100-SXM4-80GB", 1.0, 81920),
    "a10": GpuClass("a10", "NVIDIA A10", 2.5, 24576),
    "h100": GpuClass("h100", "NVIDIA H100 80GB HBM3", 0.6, 81920),
}


# --- tokens ----------------------------------------------------------------------------------------

_encode: Callable[[str], list[int]] | None = None


def use_tokenizer(encode: Callable[[str], list[int]] | None) -> None:
    """Count and identify prompt tokens with ``encode`` (text -> token ids: a Hugging Face tokenizer,
    :func:`sim.tokenizer.load`) from now on in this process; None: the built-in rule of :func:`tokenize`."""
    global _encode
    _encode = encode


def tokenize(text: str) -> list[int]:
    """Token ids of ``text``: with a tokenizer set (:func:`use_tokenizer`), its ids; else every
    :data:`BYTES_PER_TOKEN` bytes of its UTF-8 form are one token, whose id is the CRC-32 of those
    bytes modulo :data:`VOCAB_SIZE` (the last token may be shorter).

    Deterministic and prefix-preserving: a text that starts with another has the other's tokens
    first (except the other's last, partial token), so a resent conversation hits the prefix cache.
    The empty text has no tokens. Lone surrogates (a JSON ``"\\ud800"``, a header that is not
    UTF-8) are encoded as they are (``surrogatepass``), never an error.
    """
    if _encode is not None:
        return _encode(text)
    raw = text.encode("utf-8", "surrogatepass")  # JSON and headers may carry lone surrogates
    return [zlib.crc32(raw[i:i + BYTES_PER_TOKEN]) % VOCAB_SIZE for i in range(0, len(raw), BYTES_PER_TOKEN)]


def estimate_tokens(text: str) -> int:
    """Token count of ``text`` under :func:`tokenize` (at least 1)."""
    if _encode is not None:
        return max(1, len(_encode(text)))
    return max(1, (len(text.encode("utf-8", "surrogatepass")) + BYTES_PER_TOKEN - 1) // BYTES_PER_TOKEN)


def session_tokens(key: str, n: int) -> list[int]:
    """``n`` token ids that stand for the conversation history of session ``key`` (a client that
    sends a session header but not its history: the session-keyed cache as a special case of the
    prefix cache). Deterministic; different keys give different first blocks."""
    if n <= 0:
        return []
    ids: list[int] = []
    seed = zlib.crc32(key.encode("utf-8", "surrogatepass"))
    while len(ids) < n:
        seed = zlib.crc32(seed.to_bytes(4, "little"), len(ids))
        ids.append(seed % VOCAB_SIZE)
    return ids


def block_hashes(tokens: Sequence[int], block_size: int = BLOCK_SIZE) -> list[int]:
    """One key per *full* block of ``tokens``: the hash of every token up to the end of that block
    (chained: key_i = hash(key_(i-1), block_i)), as vLLM's automatic prefix caching keys its blocks.

    A trailing partial block has no key (it is never shared). Python's hash of an int tuple does
    not depend on ``PYTHONHASHSEED``, so keys agree across processes.
    """
    out: list[int] = []
    prev = 0
    for i in range(len(tokens) // block_size):
        prev = hash((prev, *tokens[i * block_size:(i + 1) * block_size]))
        out.append(prev)
    return out


# --- time ------------------------------------------------------------------------------------------

def base_latency_ms(in_flight: int) -> float:
    """A100 end-to-end latency in ms of the reference short request when ``in_flight`` requests
    run (itself included).

    Piecewise-linear through :data:`LATENCY_TABLE_MS`; beyond the last point it extrapolates
    with the slope of the last segment (62.5 ms per extra request). ``in_flight < 1`` counts as 1.
    """
    n = max(1, in_flight)
    points = LATENCY_TABLE_MS
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if n <= x1:
            return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return y1 + (y1 - y0) / (x1 - x0) * (n - x1)


def prefill_ms(uncached_tokens: int, scale: float = 1.0) -> float:
    """Prefill time of ``uncached_tokens`` prompt tokens, ms (``scale`` = class factor x time scale
    x faults)."""
    return max(0, uncached_tokens) * PREFILL_MS_PER_TOKEN * scale


def decode_step_ms(batch: int, scale: float = 1.0) -> float:
    """Time of one decode step (one more token for each running request) with ``batch`` requests
    running, ms. Chosen so that the reference short request takes :func:`base_latency_ms` (batch):
    ``prefill(REF_PROMPT) + (REF_OUTPUT - 1) x step = base``."""
    ref_prefill = REF_PROMPT_TOKENS * PREFILL_MS_PER_TOKEN
    return (base_latency_ms(batch) - ref_prefill) / (REF_OUTPUT_TOKENS - 1) * scale


def request_latency_ms(uncached_tokens: int, output_tokens: int, batch: int, scale: float = 1.0) -> float:
    """End-to-end running time of a request at a constant ``batch``: prefill + (output - 1) steps, ms."""
    return prefill_ms(uncached_tokens, scale) + max(0, output_tokens - 1) * decode_step_ms(batch, scale)


def time_factor(gpu: GpuClass, *, time_scale: float = 1.0, slow_factor: float = 1.0,
                long_tail: bool = False) -> float:
    """Multiplier of every time of one request: class factor x time scale x slow factor (x 10 long tail)."""
    return gpu.latency_factor * time_scale * slow_factor * (LONG_TAIL_FACTOR if long_tail else 1.0)


def draw_long_tail(rng: random.Random, probability: float) -> bool:
    """True with ``probability`` (0-1); draws exactly one number from ``rng`` so runs stay seeded."""
    return rng.random() < probability


def output_length(rng: random.Random, max_tokens: int | None, default_max: int) -> int:
    """Tokens a request generates: ``max_tokens`` when given (finish reason ``length``), else a
    seeded draw, uniform in 1..``default_max``."""
    if max_tokens is not None:
        return max_tokens
    return rng.randint(1, default_max)


# --- memory and the prefix cache -------------------------------------------------------------------

class PrefixCache:
    """KV blocks by key (see :func:`block_hashes`), with a reference count each.

    A block in use by a running request has a count > 0; a block whose requests have finished
    stays cached (count 0) and is the first to go, least recently used first, when memory is
    needed (vLLM's free-block queue). Sizes are in blocks.
    """

    def __init__(self) -> None:
        self._refs: dict[int, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict()  # count-0 blocks, LRU first

    def __len__(self) -> int:
        return len(self._refs)

    def __contains__(self, key: object) -> bool:
        return key in self._refs

    @property
    def free_blocks(self) -> int:
        """Cached blocks no running request uses (evictable)."""
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        """Blocks held by running requests."""
        return len(self._refs) - len(self._free)

    def match(self, keys: Sequence[int]) -> int:
        """How many leading ``keys`` are cached (a prefix match stops at the first miss)."""
        n = 0
        for k in keys:
            if k not in self._refs:
                break
            n += 1
        return n

    def acquire(self, keys: Sequence[int]) -> None:
        """Use ``keys``: cached ones gain a reference, missing ones are added with one. The caller
        has made room for the missing ones."""
        for k in keys:
            count = self._refs.get(k, 0)
            if count == 0:
                self._free.pop(k, None)
            self._refs[k] = count + 1

    def release(self, keys: Sequence[int], keep: bool = True) -> None:
        """Drop one reference of each of ``keys``; a block left unused stays cached, most recently
        used (``keep=False``: it is dropped, e.g. a block whose prefill never finished)."""
        for k in keys:
            count = self._refs.get(k)
            if count is None:
                continue
            if count <= 1:
                if keep:
                    self._refs[k] = 0
                    self._free[k] = None
                    self._free.move_to_end(k)
                else:
                    del self._refs[k]
                    self._free.pop(k, None)
            else:
                self._refs[k] = count - 1

    def evict(self, n: int) -> int:
        """Evict up to ``n`` unused blocks, least recently used first; returns how many went."""
        gone = 0
        while gone < n and self._free:
            k, _ = self._free.popitem(last=False)
            del self._refs[k]
            gone += 1
        return gone


class KvMemory:
    """GPU memory in MiB: fixed weights, explicit per-request reservations, tokens of running
    requests (prompt tails, generated tokens) and the prefix cache's blocks.

    In use = reservations + held tokens + blocks used by running requests; the cached blocks no
    request uses are *evictable* and count as free (as vLLM's ``kv_cache_usage_perc`` counts them).
    """

    def __init__(self, total_mib: float, weights_mib: float, kv_mib_per_token: float = DEFAULT_KV_MIB_PER_TOKEN,
                 block_size: int = BLOCK_SIZE) -> None:
        if total_mib <= weights_mib:
            raise ValueError("total memory must exceed the weights")
        if kv_mib_per_token < 0 or block_size < 1:
            raise ValueError("kv_mib_per_token must be >= 0 and block_size >= 1")
        self.total_mib = float(total_mib)
        self.weights_mib = float(weights_mib)
        self.kv_mib_per_token = float(kv_mib_per_token)
        self.block_size = block_size
        self.reserved_mib = 0.0
        self.held_tokens = 0
        self.cache = PrefixCache()
        self.evicted_blocks = 0

    @property
    def block_mib(self) -> float:
        """Memory of one KV block, MiB."""
        return self.block_size * self.kv_mib_per_token

    @property
    def kv_capacity_mib(self) -> float:
        """Memory available to requests and the cache (total - weights), MiB."""
        return self.total_mib - self.weights_mib

    @property
    def held_mib(self) -> float:
        """Memory in use by requests (reservations, tokens, blocks they use), MiB."""
        return (self.reserved_mib + self.held_tokens * self.kv_mib_per_token
                + self.cache.used_blocks * self.block_mib)

    @property
    def cached_free_mib(self) -> float:
        """Cached blocks no running request uses (evictable), MiB."""
        return self.cache.free_blocks * self.block_mib

    @property
    def used_mib(self) -> float:
        """Weights plus memory in use, MiB (evictable cache not counted)."""
        return self.weights_mib + self.held_mib

    @property
    def free_mib(self) -> float:
        """Total minus used, MiB (evictable cache counted as free)."""
        return self.total_mib - self.used_mib

    @property
    def kv_usage(self) -> float:
        """Memory in use / (total - weights), 0-1."""
        return min(1.0, self.held_mib / self.kv_capacity_mib)

    def make_room(self, mib: float) -> bool:
        """Make ``mib`` MiB unallocated, evicting unused cached blocks LRU first if needed. False
        (and nothing evicted) when even evicting everything unused would not do."""
        if mib < 0:
            raise ValueError("cannot make room for negative memory")
        if mib > self.free_mib + 1e-9:
            return False
        short = mib - (self.free_mib - self.cached_free_mib)
        if short > 1e-9 and self.block_mib > 0:
            n = int(-(-short // self.block_mib))
            self.evicted_blocks += self.cache.evict(n)
        return True

    def try_reserve(self, mib: float) -> bool:
        """Reserve ``mib`` MiB (an explicit per-request size) if it fits; False (no change) if not."""
        if not self.make_room(mib):
            return False
        self.reserved_mib += mib
        return True

    def release(self, mib: float) -> None:
        """Give back a reservation of ``mib`` MiB."""
        self.reserved_mib = max(0.0, self.reserved_mib - mib)
        if self.reserved_mib < 1e-9:
            self.reserved_mib = 0.0

    def blocks_mib(self, new_blocks: int, tokens: int) -> float:
        """Memory of ``new_blocks`` new blocks plus ``tokens`` loose tokens, MiB."""
        return new_blocks * self.block_mib + tokens * self.kv_mib_per_token


def gpu_util_percent(running: int, max_concurrency: int) -> float:
    """DCGM-style GPU utilisation, percent 0-100: proportional to running / max_concurrency."""
    if running <= 0:
        return 0.0
    return min(100.0, 100.0 * running / max_concurrency)
