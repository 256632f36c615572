"""The approximate prefix-cache index: which leading blocks of a prompt each endpoint was sent (pure).

An engine with a prefix cache (vLLM's automatic prefix caching, SGLang's radix cache) keeps the KV
blocks of the prompts it served and reuses the leading ones a new prompt shares; what it does not
hold it must prefill. The picker cannot see those caches, but it chose where every prompt went, so
it keeps, per endpoint, the chained hashes of the prompt blocks it sent there, bounded like the
engine's cache: the approximate index of llm-d's ``approx-prefix-cache-producer`` (a per-endpoint
LRU of the block hashes it routed, capacity the endpoint's KV blocks) and of SGLang's router (an
approximate radix tree per worker, fed by its own routing).

- **Blocks.** A prompt is its canonical bytes (:func:`prompt_bytes`: chat messages as role and text,
  or a completion's prompt) cut into :data:`BLOCK_BYTES`-byte blocks; a partial last block is left
  out (engines cache full blocks only) and at most :data:`MAX_BLOCKS` are kept.
- **Chained hashes.** Block ``i``'s key covers blocks ``0..i``: two prompts share key ``i`` only if
  their first ``i + 1`` blocks are equal, so a key stands for a whole prefix, as the engine's block
  hashes do. The key is 64 bits: a CRC-32 and an Adler-32 of the whole prefix, each continued block
  by block (zlib's, so the same key in every process and replica; not Python's ``hash()``). Both
  are checksums, not cryptographic hashes, like the xxHash64 llm-d uses: a client that crafts a
  collision only steers its own request's preference.
- **Bound and eviction.** Each endpoint holds at most ``capacity`` keys (what its KV cache can
  hold, in these blocks) and forgets the least recently sent first. A prompt's keys are refreshed
  last block first, so a block's predecessor is always more recent than the block itself and is
  evicted after it: an endpoint's keys are *prefix-closed* (it holds block ``i`` only if it holds
  ``0..i-1``), as vLLM frees a finished request's blocks tail first so its prefix outlives its
  tail. That is what makes the longest match a binary search.
- **Score.** :meth:`PrefixIndex.matched` gives each endpoint's longest cached prefix (blocks);
  matched / the prompt's blocks is the share of the prompt already cached there (0-1): the part the
  engine will not prefill again.
- **Conversations.** The blocks are those of the prompts the picker sent, not of the replies the
  engines generated and cached beside them, and a prompt shorter than a block has none. So the index
  also remembers, per conversation (its prefix key: the first messages, :func:`prompt_of`), the
  endpoint its latest turn went to (:meth:`PrefixIndex.sent_turn`, an LRU of
  :data:`MAX_CONVERSATIONS`): that engine holds the whole conversation but its newest message
  (:func:`ext_proc.prefix_choice.choose_cached`'s ``continued``).

Approximate: the index learns only from the picker's own routing, so it does not see an engine's
own evictions (KV pressure, a restart) nor the requests other gateways sent; the LRU bound keeps
it from believing an endpoint holds more than its cache can. Deterministic: the same inserts give
the same state and answers in every process.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence

__all__ = ["BLOCK_BYTES", "MAX_BLOCKS", "MAX_CONVERSATIONS", "PrefixIndex", "block_hashes", "block_hashes_py",
           "capacity_blocks", "message_text", "prompt_bytes", "prompt_keys", "prompt_keys_py", "prompt_of"]

#: Bytes of prompt text per block: about 128 tokens at 4 characters a token (vLLM's KV blocks are
#: 16 tokens; llm-d's approximate producer hashes 64-character blocks). Larger blocks cost fewer
#: hash steps per request (a 6 000-token prompt is ~47 blocks) at the price of up to one block of
#: match left uncounted at the end of a shared prefix.
BLOCK_BYTES = 512
#: Blocks hashed per prompt at most (128 KiB of text, ~32 000 tokens): llm-d's producer caps at 256 too.
MAX_BLOCKS = 256
#: Conversations whose latest turn's endpoint the index remembers (least recently sent forgotten
#: first; 124 bytes each, 8.1 MB when full: tracemalloc, 16 endpoints). Several minutes of a
#: picker's conversations: the lab's sharegpt_chat at 96 QPS starts ~9 a second (10.2 turns each).
MAX_CONVERSATIONS = 65_536

_crc32 = zlib.crc32
_adler32 = zlib.adler32


def message_text(content: object) -> str:
    """The text of a chat message's ``content`` (a string, or a list of ``{"type": "text", "text"}`` parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def prompt_bytes(doc: Mapping[str, object]) -> bytes:
    """The canonical bytes of an OpenAI body's prompt; ``b""`` when it has none (the reference of
    :func:`prompt_of`'s first value, which the picker uses).

    Chat (``messages``): each message's role and text, ``role \\x1f text \\x1e``, in order (what a
    chat template feeds the engine, without the template: the same messages give the same bytes
    whatever the JSON's spacing or key order). Completions (``prompt``): the prompt string (the first
    of a list of strings). UTF-8, lone surrogates kept.

    >>> prompt_bytes({"messages": [{"role": "system", "content": "Hi"}]})
    b'system\\x1fHi\\x1e'
    >>> prompt_bytes({"prompt": ["abc", "def"]}), prompt_bytes({})
    (b'abc', b'')
    """
    chat = doc.get("messages")
    if isinstance(chat, list):
        parts = []
        for m in chat:
            if isinstance(m, dict):
                role = m.get("role")
                parts.append(f"{role if isinstance(role, str) else ''}\x1f{message_text(m.get('content'))}\x1e")
        return "".join(parts).encode("utf-8", "surrogatepass")
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt.encode("utf-8", "surrogatepass")
    return b""


def prompt_of(doc: Mapping[str, object], prefix_messages: int, prefix_max_bytes: int
              ) -> tuple[bytes, bytes | None, int | None]:
    """An OpenAI body's prompt read once: ``(canonical bytes, prefix bytes, characters)``.

    - canonical bytes: what :func:`prompt_bytes` gives;
    - prefix bytes: what the prefix key hashes (``ext_proc.body.prefix_hash``): the canonical
      bytes of the first ``prefix_messages`` chat messages, or a completion's prompt, at most
      ``prefix_max_bytes`` of them; None when there is no prefix key (``prefix_messages`` <= 0, no
      chat message among the first ones, no prompt string);
    - characters: the chat messages' texts, or every string of a completion's ``prompt`` (a list
      counts them all); None when the body has neither ``messages`` nor ``prompt``.

    Each message's text is read and encoded once (the three used to be read apart: 3 texts and 2
    encodings of a 20 KiB prompt). ``tests/unit/ext_proc/test_prefix_index.py`` checks it against
    the three functions it replaces on random bodies.

    >>> prompt_of({"messages": [{"role": "system", "content": "Hi"}, {"role": "user", "content": "yo"}]}, 1, 4096)
    (b'system\\x1fHi\\x1euser\\x1fyo\\x1e', b'system\\x1fHi\\x1e', 4)
    >>> prompt_of({"prompt": ["abc", "de"]}, 2, 2), prompt_of({}, 2, 4096)
    ((b'abc', b'ab', 5), (b'', None, None))
    """
    chat = doc.get("messages")
    if isinstance(chat, list):
        parts = []
        chars = lead = 0
        leading = False  # a chat message among the first prefix_messages
        for i, m in enumerate(chat):
            if isinstance(m, dict):
                role = m.get("role")
                text = message_text(m.get("content"))
                chars += len(text)
                part = f"{role if isinstance(role, str) else ''}\x1f{text}\x1e"
                parts.append(part)
                if i < prefix_messages:
                    lead += len(part)
                    leading = True
        whole = "".join(parts)
        data = whole.encode("utf-8", "surrogatepass")
        if not leading:
            return data, None, chars
        cut = min(lead, prefix_max_bytes)  # a character is at least one byte
        if whole.isascii():  # one byte each: the prefix is the data's first bytes
            return data, data[:cut], chars
        return data, whole[:cut].encode("utf-8", "surrogatepass")[:prefix_max_bytes], chars
    prompt = doc.get("prompt")
    chars_of: int | None = None
    if isinstance(prompt, str):
        chars_of = len(prompt)
    elif isinstance(prompt, list):
        chars_of = sum(len(p) for p in prompt if isinstance(p, str))
        prompt = prompt[0] if prompt and isinstance(prompt[0], str) else None
    if not isinstance(prompt, str):
        return b"", None, chars_of
    data = prompt.encode("utf-8", "surrogatepass")
    return data, data[:prefix_max_bytes] if prefix_messages > 0 else None, chars_of


def block_hashes_py(data: bytes, block_bytes: int = BLOCK_BYTES, max_blocks: int = MAX_BLOCKS) -> tuple[int, ...]:
    """The chained 64-bit keys of ``data``'s full blocks (at most ``max_blocks``): key ``i`` covers
    blocks ``0..i`` (see the module docstring); ``()`` for data shorter than one block. The reference
    of :func:`block_hashes`, in Python over :mod:`zlib`.

    Raises:
        ValueError: ``block_bytes`` < 1.

    >>> a, b = block_hashes(b"x" * 1100), block_hashes(b"x" * 1024 + b"y" * 512)
    >>> len(a), a == b[:2], a[1] == b[1], len(b)
    (2, True, True, 3)
    """
    if block_bytes < 1:
        raise ValueError(f"block_bytes must be >= 1, got {block_bytes}")
    end = min(len(data) // block_bytes, max_blocks) * block_bytes
    out = []
    c, a = 0, 1
    for i in range(block_bytes, end + 1, block_bytes):
        block = data[i - block_bytes:i]
        c = _crc32(block, c)
        a = _adler32(block, a)
        out.append(c << 32 | a)
    return tuple(out)


def _compiled_block_hashes(data: bytes, block_bytes: int = BLOCK_BYTES, max_blocks: int = MAX_BLOCKS
                           ) -> tuple[int, ...]:
    """:func:`block_hashes_py` in one call of the compiled ``ext_proc._wire.block_keys`` (a 20 KiB
    prompt: 2.8 µs against 24.6 µs; CRC-32 and Adler-32 by vector instructions where the CPU has them).

    Raises:
        ValueError: ``block_bytes`` < 1 (or ``max_blocks`` < 0).
    """
    return _block_keys(data, block_bytes, max(0, max_blocks))


def prompt_keys_py(doc: Mapping[str, object], prefix_messages: int, prefix_max_bytes: int,
                   block_bytes: int = BLOCK_BYTES, max_blocks: int = MAX_BLOCKS
                   ) -> tuple[tuple[int, ...], bytes | None, int | None]:
    """What the picker reads of an OpenAI body's prompt: ``(block keys, prefix bytes, characters)``,
    :func:`prompt_of`'s prefix bytes and characters with the :func:`block_hashes` of its canonical
    bytes (``max_blocks`` 0: no keys). The reference of :func:`prompt_keys`.

    Raises:
        ValueError: ``block_bytes`` < 1.

    >>> keys, lead, chars = prompt_keys_py({"messages": [{"role": "user", "content": "x" * 600}]}, 1, 8, 512)
    >>> len(keys), lead, chars
    (1, b'user\\x1fxxx', 600)
    """
    data, lead, chars = prompt_of(doc, prefix_messages, prefix_max_bytes)
    return block_hashes(data, block_bytes, max_blocks), lead, chars


def _compiled_prompt_keys(doc: Mapping[str, object], prefix_messages: int, prefix_max_bytes: int,
                          block_bytes: int = BLOCK_BYTES, max_blocks: int = MAX_BLOCKS
                          ) -> tuple[tuple[int, ...], bytes | None, int | None]:
    """:func:`prompt_keys_py` of a chat body in one call of the compiled ``ext_proc._wire.prompt_keys``,
    which reads the messages' strings in place (their UTF-8) and hashes the canonical bytes without
    building them in Python (``inferlb bench picker``'s 20 KiB chat body: 10.7 µs against 16.4 µs, timeit best
    of 7 on a machine at load 8 from other jobs, 2026-12-07). What it declines
    (a body without a ``messages`` list, a completion's ``prompt``, a lone surrogate, a subclass of a
    JSON type, ``prefix_max_bytes`` < 0) is read by :func:`prompt_keys_py`;
    ``tests/unit/ext_proc/test_prefix_index.py`` checks the two agree on random bodies.

    Raises:
        ValueError: ``block_bytes`` < 1 (or ``max_blocks`` < 0).
    """
    read = _prompt_keys(doc, prefix_messages, prefix_max_bytes, block_bytes, max(0, max_blocks))
    return prompt_keys_py(doc, prefix_messages, prefix_max_bytes, block_bytes, max_blocks) if read is None else read


try:
    from ext_proc._wire import block_keys as _block_keys
except ImportError:  # not built (no C compiler where the package was installed)
    block_hashes = block_hashes_py
else:
    block_hashes = _compiled_block_hashes
try:
    from ext_proc._wire import prompt_keys as _prompt_keys
except ImportError:  # not built, or built from a _wire.c older than prompt_keys (rebuild: pip install -e .)
    prompt_keys = prompt_keys_py
else:
    prompt_keys = _compiled_prompt_keys


def capacity_blocks(kv_tokens: int, chars_per_token: float, block_bytes: int = BLOCK_BYTES) -> int:
    """How many index blocks an endpoint whose KV cache holds ``kv_tokens`` tokens can hold (>= 1 for
    a positive cache): a block is ``block_bytes`` of text, ``block_bytes / chars_per_token`` tokens.

    >>> capacity_blocks(500_000, 4.0), capacity_blocks(1, 4.0), capacity_blocks(0, 4.0)
    (3906, 1, 0)
    """
    if kv_tokens <= 0:
        return 0
    return max(1, int(kv_tokens * chars_per_token // block_bytes))


class PrefixIndex:
    """Per endpoint, an LRU set of the chained block keys the picker sent there (see the module
    docstring), and when it was last sent a prompt (counted in prompts recorded, not in time).

    Not thread-safe: the picker's single event loop owns it. Memory: one dictionary entry per held
    key, at most the sum of the endpoints' capacities, and one per remembered conversation (at most
    :data:`MAX_CONVERSATIONS`).
    """

    __slots__ = ("_held", "_last", "_seq", "_turn_endpoints", "_turns")

    def __init__(self) -> None:
        self._held: dict[str, OrderedDict[int, None]] = {}
        self._last: dict[str, int] = {}
        self._seq = 0
        self._turns: OrderedDict[int, str] = OrderedDict()  # conversation's prefix key -> latest turn's endpoint
        self._turn_endpoints: set[str] = set()  # every endpoint in _turns (and some no longer there)

    def insert(self, endpoint: str, blocks: Sequence[int], capacity: int) -> None:
        """Record that ``endpoint`` was sent a prompt of keys ``blocks``: they become its most recently
        used (last block first, so the prefix is the freshest), then its least recently used keys go
        until it holds at most ``capacity`` (``capacity`` <= 0: nothing is kept for it)."""
        self._seq += 1
        self._last[endpoint] = self._seq
        held = self._held.get(endpoint)
        if held is None:
            if capacity <= 0 or not blocks:
                return
            held = self._held[endpoint] = OrderedDict()
        move = held.move_to_end
        keys = reversed(blocks)
        if blocks and blocks[-1] in held:  # prefix-closed: it holds them all (a prompt sent there again), moved in C
            try:
                deque(map(move, keys), 0)
            except KeyError as missing:  # a key it lacks after all (a collision): the loop takes over
                held[missing.args[0]] = None
        for key in keys:
            if key in held:
                move(key)
            else:
                held[key] = None
        while len(held) > capacity:
            held.popitem(last=False)
        if not held:
            del self._held[endpoint]

    def matched(self, blocks: Sequence[int], endpoints: Iterable[str]) -> dict[str, int]:
        """``{endpoint: leading blocks of blocks it holds}`` for those of ``endpoints`` that hold at
        least the first (missing: 0). A binary search per endpoint (its keys are prefix-closed):
        ``O(log len(blocks))`` dictionary reads for each endpoint holding the first block, one for
        the others."""
        out: dict[str, int] = {}
        if not blocks:
            return out
        first = blocks[0]
        last = len(blocks) - 1
        held_by = self._held
        for e in endpoints:
            held = held_by.get(e)
            if held is None or first not in held:
                continue
            if blocks[last] in held:
                out[e] = last + 1
                continue
            lo, hi = 0, last  # blocks[lo] held, blocks[hi] not
            while hi - lo > 1:
                mid = (lo + hi) >> 1
                if blocks[mid] in held:
                    lo = mid
                else:
                    hi = mid
            out[e] = lo + 1
        return out

    def sent_turn(self, conversation: int, endpoint: str) -> None:
        """Record that the latest turn of ``conversation`` (its prefix key's 64-bit hash) went to
        ``endpoint``; past :data:`MAX_CONVERSATIONS`, the least recently sent is forgotten."""
        turns = self._turns
        turns[conversation] = endpoint
        turns.move_to_end(conversation)
        self._turn_endpoints.add(endpoint)
        if len(turns) > MAX_CONVERSATIONS:
            turns.popitem(last=False)

    def turn_endpoint(self, conversation: int) -> str | None:
        """Where the latest turn of ``conversation`` went (None: not remembered)."""
        return self._turns.get(conversation)

    def last_sent(self, endpoint: str) -> int:
        """The insert count when ``endpoint`` was last sent a prompt (0: never)."""
        return self._last.get(endpoint, 0)

    def held(self, endpoint: str) -> int:
        """How many keys ``endpoint`` holds."""
        held = self._held.get(endpoint)
        return 0 if held is None else len(held)

    def keys(self, endpoint: str) -> tuple[int, ...]:
        """``endpoint``'s keys, least recently used first (for tests and the admin API)."""
        return tuple(self._held.get(endpoint, ()))

    def retain(self, endpoints: Iterable[str]) -> None:
        """Forget every endpoint not in ``endpoints`` (it left the view): its keys and the
        conversations whose latest turn went there."""
        keep = set(endpoints)
        for e in [e for e in self._held if e not in keep]:
            del self._held[e]
        if not self._turn_endpoints <= keep:  # rare (an endpoint left): its conversations start anew
            turns = self._turns
            for c in [c for c, e in turns.items() if e not in keep]:
                del turns[c]
            self._turn_endpoints &= keep

    def __len__(self) -> int:
        """Endpoints with at least one key."""
        return len(self._held)
