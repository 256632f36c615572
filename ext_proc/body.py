"""OpenAI request bodies: what the picker reads from one (pure).

A request's JSON body (chat or completion) gives what its headers may not: the version (``model``),
the session (``user``, ``prompt_cache_key``), its size (the prompt's tokens, ``max_tokens``: its
memory and its work), the prefix key of its opening and the chained keys of its prompt's blocks
(the prefix-cache index's). :func:`body_fields` reads a whole body, :func:`partial_fields` the first
bytes of a streamed one; :func:`wants_body` says whether a request's headers leave anything for its
body to tell. The result is one :class:`BodyFields`; the handler (:mod:`ext_proc.handler`) holds
the stream, the request control (:mod:`ext_proc.requestcontrol`) and the picker (:mod:`ext_proc.picker`)
decide on the fields.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import orjson

from ext_proc.engine_keys import engine_keys
from ext_proc.prefix_index import BLOCK_BYTES, MAX_BLOCKS, message_text, prompt_keys
from ext_proc.ring import key_hash
from ext_proc.view import RoutingTable

__all__ = ["BODY_TOO_LARGE", "MAX_JSON_DEPTH", "NO_BODY", "BodyFields", "JsonTooDeep", "body_fields",
           "content_length", "partial_fields", "prefix_hash", "read_json", "unread", "wants_body"]

_FIELD = re.compile(rb'"(model|user|prompt_cache_key|max_tokens|max_completion_tokens)"\s*:\s*'
                    rb'("(?:[^"\\]|\\.){0,1024}"|[0-9]{1,9})')
_MESSAGES = re.compile(rb'"messages"\s*:\s*\[')
_PROMPT = re.compile(rb'"prompt"\s*:\s*"')
_DECODER = json.JSONDecoder()


class BodyFields(NamedTuple):
    """What the picker reads from an OpenAI-style JSON request body (a named tuple, built per read body:
    1.1 µs, where a frozen dataclass of 8 fields cost 2.2 µs, timeit on a machine at load 8 from other jobs;
    :meth:`_replace` for a copy with other fields).

    Attributes:
        model: the ``model`` field (a version, mix or model name), raw UTF-8 bytes, or None.
        user: the ``user`` field (a session key), raw bytes, or None.
        prompt_cache_key: OpenAI's ``prompt_cache_key`` (a session key), raw bytes, or None.
        prefix: the prefix key's 64-bit hash (:func:`prefix_hash`), or None (also
            when the request has a session key, which places it instead: not computed then).
        prompt_tokens: the prompt's estimated tokens, None when the body has no prompt.
        max_tokens: ``max_tokens`` (or ``max_completion_tokens``), None when absent.
        subset: the endpoints (``HOST:PORT``) the request may go to, from outside the body: a
            gateway's subset hint (:mod:`ext_proc.gateway`); None: any endpoint.
        blocks: the prompt's chained block keys (:func:`ext_proc.prefix_index.block_hashes`), empty
            when the prefix index is off or the body has no prompt of a block.
        continued: for a chat body the approximate prefix index follows as a conversation (its
            ``prefix`` key whole, not cut at ``prefix_max_bytes``): the share of its prompt's
            characters before its newest message (0-1; 0 for a first turn of one or two messages),
            what the engine that served its previous turn holds. None: not followed.
        too_large: the body was above ``body_max_bytes`` and not read (:data:`BODY_TOO_LARGE`): a
            request whose version its ``model`` would choose is refused (:func:`ext_proc.picker.body_too_large`).
    """

    model: bytes | None = None
    user: bytes | None = None
    prompt_cache_key: bytes | None = None
    prefix: int | None = None
    prompt_tokens: float | None = None
    max_tokens: int | None = None
    subset: frozenset[str] | None = None
    blocks: tuple[int, ...] = ()
    continued: float | None = None
    too_large: bool = False


NO_BODY = BodyFields()
#: A body above ``body_max_bytes``: nothing read from it.
BODY_TOO_LARGE = BodyFields(too_large=True)


def prefix_hash(doc: dict, messages: int, max_bytes: int) -> int | None:
    """The prefix key of an OpenAI body: a 64-bit hash of its leading prompt blocks, or None.

    Chat: the role and text of the first ``messages`` messages (the system prompt and first turns),
    at most ``max_bytes`` bytes of them; completions: the first ``max_bytes`` bytes of ``prompt``.
    Requests that share that prefix (the same system prompt and opening) get the same key, hence
    the same preferred endpoint, whose prefix cache then holds it. BLAKE2b over canonical bytes:
    the same key in every picker process and replica. None when there is no prompt or
    ``messages`` is 0.
    """
    if messages <= 0:
        return None
    parts: list[bytes] = []
    size = 0
    chat = doc.get("messages")
    if isinstance(chat, list):
        for message in chat[:messages]:
            if not isinstance(message, dict):
                continue
            text = message_text(message.get("content"))
            role = message.get("role")
            part = f"{role if isinstance(role, str) else ''}\x1f{text}\x1e".encode("utf-8", "surrogatepass")
            parts.append(part)
            size += len(part)
            if size >= max_bytes:
                break
    else:
        prompt = doc.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            parts.append(prompt.encode("utf-8", "surrogatepass")[:max_bytes])
    if not parts:
        return None
    return key_hash(b"".join(parts)[:max_bytes])


MAX_JSON_DEPTH = 1024
"""The deepest nesting of arrays and objects a request body may have (levels): orjson's limit (since
orjson 3.9.15, CVE-2024-27454: a parser without one can be made to recurse until the process dies).
A body nested deeper is answered 400 ``body_too_deep`` (:func:`ext_proc.picker.too_deep`): the
picker cannot read its routing fields, and forwarded unread it would reach a backend that parses
it with its own limit (Python's ``json`` stops at its recursion limit, ~1 000 levels)."""


class JsonTooDeep(ValueError):
    """A JSON document nested deeper than :data:`MAX_JSON_DEPTH` (or than ``json`` can read)."""


def read_json(data: bytes) -> Any:
    """``data`` parsed as JSON at orjson's speed (a 20 KiB chat body: 27 µs against ``json``'s 65 µs,
    timed alone); what orjson refuses and ``json`` reads (``NaN``, ``Infinity``, a lone surrogate
    escape) is handed to ``json``. One difference from :func:`json.loads` remains, and it changes no
    field the picker reads (:func:`body_fields`; a differential test checks it): an integer beyond
    64 bits comes back as a float.

    Raises:
        JsonTooDeep: nested deeper than :data:`MAX_JSON_DEPTH` levels (orjson's limit), or, for a
            body orjson refuses for another reason, deeper than ``json``'s recursion limit allows.
        ValueError: not JSON (or not UTF-8).
    """
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(data)
    except RecursionError:
        raise JsonTooDeep(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None


def body_fields(data: bytes, routing: RoutingTable, keyed: bool = False) -> BodyFields | None:
    """The fields the picker uses from a JSON object body up to ``body_max_bytes``; None when unreadable.

    ``keyed``: the request's headers give its session key (:func:`ext_proc.picker.header_session_key`),
    so, as when the body names one (``user``, ``prompt_cache_key``), the prefix key would place
    nothing and is not computed (``prefix`` None; a BLAKE2b of up to ``prefix_max_bytes``: 5 µs for
    4 KiB).

    Raises:
        JsonTooDeep: see :func:`read_json`.
    """
    if len(data) > routing.body_max_bytes:
        return None
    try:
        doc = read_json(data)
    except JsonTooDeep:
        raise
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    model, user, cache_key = doc.get("model"), doc.get("user"), doc.get("prompt_cache_key")
    max_tokens = doc.get("max_tokens", doc.get("max_completion_tokens"))
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 0 < max_tokens < 10_000_000:
        max_tokens = None
    user = _utf8(user) if isinstance(user, str) else None
    cache_key = _utf8(cache_key) if isinstance(cache_key, str) and cache_key else None
    # The index's keys of the prompt's canonical bytes, unless it is off or keyed as the engine keys it.
    own_keys = routing.prefix_cache_tokens and not routing.engine_block_size
    keys, lead, chars = prompt_keys(doc, routing.prefix_messages, routing.prefix_max_bytes, BLOCK_BYTES,
                                    MAX_BLOCKS if own_keys else 0)
    prefix = key_hash(lead) if lead is not None and not (keyed or user or cache_key) else None
    return BodyFields(
        _utf8(model) if isinstance(model, str) else None,
        user,
        cache_key,
        prefix,
        chars / routing.chars_per_token if chars is not None else None,
        max_tokens,
        blocks=keys if own_keys else () if not routing.prefix_cache_tokens
        else engine_keys(doc, routing.engine_block_size, routing.engine_tokenizer, routing.engine_keys),
        continued=_continued(doc, chars) if own_keys and prefix is not None and len(lead) < routing.prefix_max_bytes
        else None,
    )


def unread(body: bytes, routing: RoutingTable) -> BodyFields:
    """What a body :func:`body_fields` could not read stands for: :data:`BODY_TOO_LARGE` above
    ``body_max_bytes`` (a chunked body, whose size Envoy learns only once it has it all), else (not a
    JSON object) :data:`NO_BODY`: routed by the headers, as the backend's own 400 answers the body."""
    return BODY_TOO_LARGE if len(body) > routing.body_max_bytes else NO_BODY


def _utf8(text: str) -> bytes:
    """A JSON string field's UTF-8 bytes. JSON may carry a lone surrogate (``"\\ud800"``), which strict
    UTF-8 cannot encode: it is kept as its surrogate's three bytes (``surrogatepass``), not valid UTF-8,
    so a ``model`` with one is refused as an invalid version string (400, param ``model``) and a ``user``
    or ``prompt_cache_key`` with one still hashes. Before, the strict encode raised inside the pick, and
    the request went to the default version (Envoy's fallback)."""
    return text.encode("utf-8", "surrogatepass")


def _continued(doc: dict, chars: int | None) -> float | None:
    """The share of a chat prompt's ``chars`` characters before its newest message (0-1; 0 for one
    or two messages: a conversation's first turn); None for a body without chat messages."""
    messages = doc.get("messages")
    if not isinstance(messages, list) or not chars:
        return None
    if len(messages) < 3:
        return 0.0
    newest = messages[-1]
    return max(0.0, 1.0 - len(message_text(newest.get("content"))) / chars) if isinstance(newest, dict) else 0.0


def content_length(headers: dict[str, bytes]) -> int | None:
    """The request's ``content-length`` (bytes); None when absent (chunked) or not a number."""
    length = headers.get("content-length", b"")
    return int(length) if length.isdigit() else None


def partial_fields(chunk: bytes, content_length: int | None, routing: RoutingTable) -> BodyFields:
    """What the first bytes of a longer JSON body tell (streamed body mode), never raising.

    ``model``, ``user``, ``prompt_cache_key`` and ``max_tokens``: the first occurrence of each key
    with a string (number) value in the chunk. The prefix key: the first ``prefix_messages`` chat
    messages that are complete in the chunk, hashed exactly as :func:`prefix_hash` hashes them in a
    whole body (so a request gets the same key whether its body came in one chunk or several);
    a completion's ``prompt``: its first bytes. The prompt's tokens: the body's ``content-length``
    (bytes) / ``chars_per_token``.

    Raises:
        JsonTooDeep: one of those first messages nests deeper than ``json`` reads.
    """
    found: dict[bytes, bytes] = {}
    for m in _FIELD.finditer(chunk):
        found.setdefault(m.group(1), m.group(2))

    def text(key: bytes) -> bytes | None:
        raw = found.get(key)
        if raw is None or not raw.startswith(b'"'):
            return None
        try:
            value = json.loads(raw)
        except ValueError:
            return None
        return _utf8(value) if isinstance(value, str) and value else None

    number = found.get(b"max_tokens") or found.get(b"max_completion_tokens")
    max_tokens = int(number) if number is not None and number.isdigit() and int(number) > 0 else None
    prefix = None
    if routing.prefix_messages > 0:
        m = _MESSAGES.search(chunk)
        if m is not None:
            text_ = chunk.decode("utf-8", "ignore")
            pos = len(chunk[:m.end()].decode("utf-8", "ignore"))
            messages: list = []
            while len(messages) < routing.prefix_messages:
                while pos < len(text_) and text_[pos] in " \t\r\n,":
                    pos += 1
                try:
                    message, pos = _DECODER.raw_decode(text_, pos)
                except RecursionError:
                    raise JsonTooDeep(f"a chat message nested deeper than {MAX_JSON_DEPTH} levels") from None
                except ValueError:
                    break
                messages.append(message)
            if messages:
                prefix = prefix_hash({"messages": messages}, routing.prefix_messages, routing.prefix_max_bytes)
        else:
            m = _PROMPT.search(chunk)
            if m is not None:
                prefix = key_hash(chunk[m.end(): m.end() + routing.prefix_max_bytes])
    tokens = content_length / routing.chars_per_token if content_length else None
    return BodyFields(text(b"model"), text(b"user"), text(b"prompt_cache_key"), prefix, tokens, max_tokens)


def wants_body(headers: Mapping[str, bytes], routing: RoutingTable) -> bool:
    """A JSON body may tell what the headers do not: the version, the session, or the request's
    size (prompt and ``max_tokens``: its memory, its work and its prefix key). A body is read as
    the OpenAI-compatible servers read it (vLLM's and SGLang's, on FastAPI): with a JSON media type,
    in any case (RFC 9110 8.3.1: ``Application/JSON``, ``application/vnd.x+json``), or with no
    ``content-type`` at all (FastAPI parses it as JSON); another media type is not JSON to them
    either (FastAPI answers 422). Source: FastAPI's ``fastapi/routing.py``, its request handler's
    body parsing (no ``content-type``, or ``application/json`` / ``application/*+json``: JSON)."""
    kind = headers.get("content-type", b"")
    if kind and b"json" not in kind and b"json" not in kind.lower():
        return False
    if not headers.get(routing.version_header):
        return True
    for name in routing.session_headers:  # a loop, not any() over a generator: 0.3 µs less a request
        if headers.get(name):
            break
    else:
        return True
    sized = headers.get(routing.request_class_header) or (
        routing.request_memory_header is not None and headers.get(routing.request_memory_header))
    return not sized
