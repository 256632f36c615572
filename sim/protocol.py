"""OpenAI-style request parsing and response bodies (pure: no I/O).

Only the fields the simulator uses are read: ``max_tokens`` (or ``max_completion_tokens``; absent =
a seeded length), ``user``, ``model``, ``stream``, ``stream_options.include_usage``, and
``messages`` (chat) / ``prompt`` (completions), which :func:`render_prompt` turns into the text the
tokenizer (:func:`sim.tokens.tokenize`) reads. Streaming answers are Server-Sent Events as the
OpenAI API sends them: ``data: {chunk}`` lines, then ``data: [DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from sim.tokens import tokenize

DEFAULT_MAX_TOKENS = 128
MAX_MAX_TOKENS = 1_000_000

SESSION_HEADER = "x-session-id"
USER_HEADER = "x-user-id"
MEMORY_HEADER = "x-sim-memory-mib"

Kind = Literal["chat", "completion"]


class RequestError(ValueError):
    """A client error (HTTP 400); ``field`` names the offending field or header."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class InferenceRequest:
    """A validated inference request. ``memory_mib`` is the explicit header value or None.

    ``max_tokens``: the body's (or :data:`DEFAULT_MAX_TOKENS` when ``max_tokens_given`` is False:
    then the node draws the output length). ``tokens``: the prompt's token ids (``prompt_tokens``
    of them). ``stream`` / ``include_usage``: SSE answer, with a final usage chunk.
    """

    kind: Kind
    max_tokens: int
    prompt_tokens: int
    model: str | None
    user: str | None
    session_key: str | None
    memory_mib: float | None
    tokens: tuple[int, ...] = ()
    stream: bool = False
    include_usage: bool = False
    max_tokens_given: bool = True


_chat_template: Callable[[list[dict[str, Any]]], str] | None = None


def use_chat_template(render: Callable[[list[dict[str, Any]]], str] | None) -> None:
    """Render chat prompts with ``render`` (a model's chat template: messages -> text, the generation
    prompt added; :func:`sim.tokenizer.load_chat_template`) from now on in this process; None: the
    built-in rule of :func:`render_prompt`."""
    global _chat_template
    _chat_template = render


def render_prompt(kind: Kind, body: Mapping[str, Any]) -> str:
    """The prompt text the tokenizer reads; raises RequestError on a malformed field.

    Chat: every message as ``<|ROLE|>\\nCONTENT\\n`` (content given as parts: the text of its text
    parts, as a chat template renders them; other content as JSON), then
    ``<|assistant|>\\n`` (the generation prompt of a chat template), so a client that resends
    the whole conversation sends a longer text that starts with the previous one; with a chat
    template set (:func:`use_chat_template`), the messages through it, a message's text parts
    joined by a newline (as vLLM's server passes them to a template that takes a string).
    Completions: the ``prompt`` string (a list as JSON).
    """
    if kind == "chat":
        messages = body.get("messages", [])
        if not isinstance(messages, list):
            raise RequestError("messages", "'messages' must be a list of {role, content} objects")
        if _chat_template is not None:
            return _templated(_chat_template, messages)
        parts = []
        for msg in messages:
            if not isinstance(msg, dict):
                raise RequestError("messages", "each entry of 'messages' must be an object")
            content = msg.get("content", "")
            role = msg.get("role", "user")
            if isinstance(content, list) and content and all(
                    isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                    for p in content):
                content = "".join(p["text"] for p in content)   # OpenAI content parts, text only
            parts.append(f"<|{role if isinstance(role, str) else 'user'}|>\n"
                         f"{content if isinstance(content, str) else json.dumps(content)}\n")
        return "".join(parts) + "<|assistant|>\n"
    prompt = body.get("prompt", "")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return json.dumps(prompt)
    raise RequestError("prompt", "'prompt' must be a string or a list")


def _templated(render: Callable[[list[dict[str, Any]]], str], messages: list[Any]) -> str:
    """``messages`` through a chat template (see :func:`render_prompt`); RequestError where the
    template refuses them."""
    conversation = []
    for msg in messages:
        if not isinstance(msg, dict):
            raise RequestError("messages", "each entry of 'messages' must be an object")
        content = msg.get("content", "")
        if isinstance(content, list) and all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            content = "\n".join(p["text"] for p in content)
        conversation.append({**msg, "content": content if isinstance(content, str) else json.dumps(content)})
    try:
        return render(conversation)
    except Exception as exc:  # the template's own raise_exception (roles out of order, ...): a client error
        raise RequestError("messages", f"the chat template refused the messages: {exc}") from None


def _optional_str(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise RequestError(key, f"'{key}' must be a string")
    return value


def parse_memory_header(value: str | None) -> float | None:
    """Parse ``x-sim-memory-mib`` (MiB, a non-negative number) or None when absent."""
    if value is None:
        return None
    try:
        mib = float(value)
    except ValueError:
        raise RequestError(MEMORY_HEADER, f"header '{MEMORY_HEADER}' must be a number of MiB") from None
    if not mib >= 0 or mib == float("inf"):
        raise RequestError(MEMORY_HEADER, f"header '{MEMORY_HEADER}' must be a finite number >= 0")
    return mib


def resolve_session_key(headers: Mapping[str, str], body_user: str | None) -> str | None:
    """Session key: header ``x-session-id``, else header ``x-user-id``, else body ``user``."""
    for name in (SESSION_HEADER, USER_HEADER):
        value = headers.get(name)
        if value:
            return value
    return body_user or None


def load_json(raw: bytes, field: str = "body") -> Any:
    """Parse a JSON request body; raises RequestError naming ``field`` when it is not valid JSON or
    nests deeper than the parser can follow (Python's JSON parser raises RecursionError there, a few
    hundred to a few thousand levels deep, which is a client error, not a server one)."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise RequestError(field, f"request {field} is not valid JSON") from None
    except RecursionError:
        raise RequestError(field, f"request {field} is nested too deeply") from None


def parse_request(kind: Kind, raw: bytes, headers: Mapping[str, str]) -> InferenceRequest:
    """Validate a raw JSON body plus headers into an :class:`InferenceRequest` (or RequestError)."""
    if not raw or not raw.strip():
        raise RequestError("body", "request body is missing; expected a JSON object")
    body = load_json(raw)
    if not isinstance(body, dict):
        raise RequestError("body", "request body must be a JSON object")
    key = "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens"
    max_tokens = body.get(key)
    given = max_tokens is not None
    if not given:
        max_tokens = DEFAULT_MAX_TOKENS
    if (
        isinstance(max_tokens, bool)
        or not isinstance(max_tokens, int)
        or not 1 <= max_tokens <= MAX_MAX_TOKENS
    ):
        raise RequestError(key, f"'{key}' must be an integer in 1-{MAX_MAX_TOKENS}")
    model = _optional_str(body, "model")
    user = _optional_str(body, "user")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError("stream", "'stream' must be true or false")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise RequestError("stream_options", "'stream_options' must be an object")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise RequestError("stream_options", "'stream_options.include_usage' must be true or false")
    tokens = tuple(tokenize(render_prompt(kind, body))) or (0,)
    return InferenceRequest(
        kind=kind,
        max_tokens=max_tokens,
        prompt_tokens=len(tokens),
        model=model,
        user=user,
        session_key=resolve_session_key(headers, user),
        memory_mib=parse_memory_header(headers.get(MEMORY_HEADER)),
        tokens=tokens,
        stream=stream,
        include_usage=include_usage,
        max_tokens_given=given,
    )


def error_body(message: str, err_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI-style error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def model_body(model_name: str, created: int) -> dict[str, Any]:
    """One entry of ``GET /v1/models``: an OpenAI ``model`` object (``created``: Unix seconds)."""
    return {"id": model_name, "object": "model", "created": created, "owned_by": "inferlb-sim"}


def model_list_body(model_name: str, created: int) -> dict[str, Any]:
    """``GET /v1/models``: the OpenAI list of the models served, here the one model of a node."""
    return {"object": "list", "data": [model_body(model_name, created)]}


def completion_body(
    req: InferenceRequest,
    *,
    request_id: str,
    model_name: str,
    text: str,
    created: int,
    finish_reason: str = "length",
    completion_tokens: int | None = None,
    cached_tokens: int = 0,
) -> dict[str, Any]:
    """OpenAI-style success body for ``req`` (chat.completion or text_completion), with ``usage``
    (``completion_tokens`` default: ``req.max_tokens``)."""
    usage = usage_body(req.prompt_tokens, req.max_tokens if completion_tokens is None else completion_tokens,
                       cached_tokens)
    if req.kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {
        "id": request_id,
        "object": obj,
        "created": created,
        "model": model_name,
        "choices": [choice],
        "usage": usage,
    }


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI ``usage``: prompt, completion and total tokens, and the prompt tokens served from the
    prefix cache (``prompt_tokens_details.cached_tokens``, as vLLM reports it)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chunk_body(req: InferenceRequest, *, request_id: str, model_name: str, created: int, text: str | None = None,
               role: bool = False, finish_reason: str | None = None) -> dict[str, Any]:
    """One streamed chunk: ``chat.completion.chunk`` (``delta`` with the role first, then content) or
    ``text_completion`` (``text``); ``finish_reason`` on the last one. ``usage`` is null on these, as
    the OpenAI API sends it when ``include_usage`` is asked for."""
    if req.kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    out: dict[str, Any] = {"id": request_id, "object": obj, "created": created, "model": model_name,
                           "choices": [choice]}
    if req.include_usage:
        out["usage"] = None
    return out


def usage_chunk(req: InferenceRequest, *, request_id: str, model_name: str, created: int,
                usage: dict[str, Any]) -> dict[str, Any]:
    """The last chunk when ``stream_options.include_usage`` is set: no choices, the usage."""
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": model_name, "choices": [],
            "usage": usage}


def sse(data: dict[str, Any] | str) -> bytes:
    """One Server-Sent Event: ``data: JSON`` (or the literal string) and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
