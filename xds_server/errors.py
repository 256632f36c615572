"""The error object every error the control plane answers carries: OpenAI's shape.

``{"error": {"message": str, "type": str, "param": str | null, "code": str}}``, as the picker answers
(``ext_proc/errors.py``; the two libraries may not import each other, a unit test holds the two
builders equal) and OpenAI-compatible servers and clients use: the route's 503 for a version with no
endpoints, Envoy's own local replies (``resources/local_reply.py``) and the admin API's errors.
``code`` is a stable label of the cause; ``message`` is for people.

Pure: no I/O.
"""

from __future__ import annotations

import json

__all__ = ["error_document", "error_json", "error_type"]


def error_type(status: int) -> str:
    """OpenAI's error ``type`` of ``status``: ``rate_limit_error`` (429), ``server_error`` (5xx), else
    ``invalid_request_error``."""
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def error_document(status: int, code: str, message: str, param: str | None = None) -> dict:
    """The error object of a ``status`` answer (``param``: the parameter, header or field at fault)."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def error_json(status: int, code: str, message: str, param: str | None = None) -> str:
    """:func:`error_document` as JSON text."""
    return json.dumps(error_document(status, code, message, param))
