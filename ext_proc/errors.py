"""The body of every error the picker answers to a client: an OpenAI error object.

``{"error": {"message": str, "type": str, "param": str | null, "code": str}}``, the shape OpenAI's
API answers and its clients parse (openai-python raises ``BadRequestError`` for a 400,
``NotFoundError`` for a 404, ``RateLimitError`` for a 429 and ``InternalServerError`` for a 5xx, with
``.code``, ``.param`` and ``.type`` read from this object; vLLM's and SGLang's OpenAI servers answer
the same shape). ``code`` is a stable label of the cause (the decision's reason with underscores:
``unknown_version``, ``overloaded``, ...), for programs and alerts; ``message`` is for people and may
change. Envoy's own local replies get the same shape from the listener's ``local_reply_config``
(``xds_server/resources/local_reply.py``).

Pure: no I/O.
"""

from __future__ import annotations

import json

__all__ = ["error_body", "error_type"]


def error_type(status: int) -> str:
    """The OpenAI error ``type`` of an HTTP ``status``: ``rate_limit_error`` (429), ``server_error``
    (5xx), else ``invalid_request_error`` (OpenAI's type for 4xx request problems)."""
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, code: str, message: str, param: str | None = None) -> bytes:
    """The JSON error object (UTF-8 bytes) of a ``status`` answer: ``code`` the stable cause label
    (dashes become underscores), ``message`` the text for people, ``param`` the request field or header
    at fault (None: none)."""
    return json.dumps({"error": {"message": message, "type": error_type(status), "param": param,
                                 "code": code.replace("-", "_")}}).encode()
