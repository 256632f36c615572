"""OpenAI-style request parsing and response bodies (pure: no I/O).

Only the fields the simulator uses are read: ``max_tokens`` (default 128), ``user``, ``model``,
and ``messages`` (chat) / ``prompt`` (completions) to estimate prompt tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from sim.model import estimate_tokens

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
    """A validated inference request. ``memory_mib`` is the explicit header value or None."""

    kind: Kind
    max_tokens: int
    prompt_tokens: int
    model: str | None
    user: str | None
    session_key: str | None
    memory_mib: float | None


def _prompt_text(kind: Kind, body: Mapping[str, Any]) -> str:
    """Text whose length estimates the prompt size; raises RequestError on a malformed field."""
    if kind == "chat":
        messages = body.get("messages", [])
        if not isinstance(messages, list):
            raise RequestError("messages", "'messages' must be a list of {role, content} objects")
        parts = []
        for msg in messages:
            if not isinstance(msg, dict):
                raise RequestError("messages", "each entry of 'messages' must be an object")
            content = msg.get("content", "")
            parts.append(content if isinstance(content, str) else json.dumps(content))
        return "\n".join(parts)
    prompt = body.get("prompt", "")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return json.dumps(prompt)
    raise RequestError("prompt", "'prompt' must be a string or a list")


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


def parse_request(kind: Kind, raw: bytes, headers: Mapping[str, str]) -> InferenceRequest:
    """Validate a raw JSON body plus headers into an :class:`InferenceRequest` (or RequestError)."""
    if not raw or not raw.strip():
        raise RequestError("body", "request body is missing; expected a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise RequestError("body", "request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise RequestError("body", "request body must be a JSON object")
    max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if (
        isinstance(max_tokens, bool)
        or not isinstance(max_tokens, int)
        or not 1 <= max_tokens <= MAX_MAX_TOKENS
    ):
        raise RequestError("max_tokens", f"'max_tokens' must be an integer in 1-{MAX_MAX_TOKENS}")
    model = _optional_str(body, "model")
    user = _optional_str(body, "user")
    prompt_tokens = estimate_tokens(_prompt_text(kind, body))
    return InferenceRequest(
        kind=kind,
        max_tokens=max_tokens,
        prompt_tokens=prompt_tokens,
        model=model,
        user=user,
        session_key=resolve_session_key(headers, user),
        memory_mib=parse_memory_header(headers.get(MEMORY_HEADER)),
    )


def error_body(message: str, err_type: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI-style error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": None}}


def completion_body(
    req: InferenceRequest,
    *,
    request_id: str,
    model_name: str,
    text: str,
    created: int,
    finish_reason: str = "length",
) -> dict[str, Any]:
    """OpenAI-style success body for ``req`` (chat.completion or text_completion)."""
    usage = {
        "prompt_tokens": req.prompt_tokens,
        "completion_tokens": req.max_tokens,
        "total_tokens": req.prompt_tokens + req.max_tokens,
    }
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
