"""Errors the data path answers without a backend, in OpenAI's error shape (pure).

Clients of an OpenAI-compatible API parse ``{"error": {"message", "type", "param", "code"}}``
(:mod:`xds_server.errors`; the picker's answers: ``ext_proc/errors.py``; vLLM's and SGLang's
servers). Envoy's own local replies get that shape from the listener's ``local_reply_config``
(:func:`local_reply_config`): each mapper matches one cause by Envoy's response flag or by a status
the picker never answers, and rewrites the body with ``body_format_override`` (the message is
``%LOCAL_REPLY_BODY%``, Envoy's own text, or where Envoy has none :data:`MESSAGES`'; ``code`` is
stable). The picker's immediate responses are local replies too (ext_proc sends them with
``sendLocalReply``): they carry no response flag and their statuses (400, 404, 429, 503) are matched
only together with a flag, so they keep their own body.

Response flags: https://www.envoyproxy.io/docs/envoy/latest/configuration/observability/access_log/usage
(``%RESPONSE_FLAGS%``); the mapper fields: ``envoy.extensions.filters.network.http_connection_manager.v3
.LocalReplyConfig`` (Envoy 1.40); command operators such as ``%REQ(:AUTHORITY)%`` in a JSON format:
https://www.envoyproxy.io/docs/envoy/latest/configuration/observability/access_log/usage
"""

from __future__ import annotations

from xds_server.errors import error_type

__all__ = ["LOCAL_REPLIES", "MESSAGES", "local_reply_config"]

#: ``(code, status, match)`` of every Envoy local reply given the OpenAI shape, in match order:
#: ``match`` is Envoy response flags (short names) or an HTTP status the picker never answers.
LOCAL_REPLIES: tuple[tuple[str, int, tuple[str, ...] | int], ...] = (
    ("no_healthy_upstream", 503, ("UH",)),            # no healthy endpoint (a whole cluster drained)
    ("upstream_overflow", 503, ("UO",)),              # a circuit breaker's limit
    ("upstream_connect_failure", 503, ("UF", "UC", "URX", "LR", "UR")),
    ("upstream_timeout", 504, ("UT",)),
    ("no_route", 404, ("NR",)),
    ("request_headers_too_large", 431, 431),
    ("request_body_too_large", 413, 413),
    ("request_timeout", 408, 408),
    ("invalid_http_request", 400, ("DPE",)),           # a request Envoy's codec refused
)

#: ``{code: message}`` for the replies whose Envoy text is empty (the route table's 404 has none), as
#: Envoy's format string: ``%REQ(:AUTHORITY)%`` is the request's host. Every virtual host ends with a
#: catch-all route (:mod:`xds_server.resources.routes`), so only a host no service lists finds no
#: route; while the picker runs it answers that first (``unknown_service``), so Envoy's own 404 is
#: seen when the picker failed open (``failure_mode_allow``).
MESSAGES: dict[str, str] = {
    "no_route": "no route for host '%REQ(:AUTHORITY)%': it matches none of the services' hosts",
}


def local_reply_config() -> dict:
    """The HCM's ``local_reply_config`` (JSON form): one mapper per :data:`LOCAL_REPLIES` entry."""
    mappers = []
    for code, status, match in LOCAL_REPLIES:
        if isinstance(match, int):
            when = {"status_code_filter": {"comparison": {"op": "EQ", "value": {
                "default_value": match, "runtime_key": f"inferlb.local_reply.{code}"}}}}
        else:
            when = {"response_flag_filter": {"flags": list(match)}}
        mappers.append({"filter": when, "body_format_override": {
            "json_format": {"error": {"message": MESSAGES.get(code, "%LOCAL_REPLY_BODY%"),
                                      "type": error_type(status), "param": None,
                                      "code": code}},
            "content_type": "application/json"}})
    return {"mappers": mappers}
