"""The ``null`` ext_proc server: the smallest correct answer to Envoy's ext_proc, for ``bench picker``.

It measures Envoy's own ext_proc ceiling on a machine: the same Envoy filter config as the picker,
a server that does no work. Built on the picker's own HTTP/2 transport
(:mod:`ext_proc.transport.h2`: valid HTTP/2 and gRPC framing, HPACK, flow control) with a trivial
:class:`~ext_proc.transport.base.Service` that answers every ``Process`` message with a fixed,
pre-serialized no-change ``ProcessingResponse`` of the message's phase, and drops access-log
messages. So the null figure includes our framing layer's cost: the ratio picker / null is the
cost of the picker's decision path (handler, picker, scheduler, responses), not of the transport.

Run: ``python -m bench.null_ext_proc --listen 127.0.0.1:PORT`` (uvloop, one process).
"""

from __future__ import annotations

import argparse
import asyncio

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from ext_proc.responses import EMPTY_ANSWERS
from ext_proc.transport.base import StreamState

__all__ = ["NullService", "main"]

# The first byte of a ProcessingRequest is the tag of its phase field (protobuf writes fields in
# field-number order and the phases are fields 2..7, before every other field): wire type 2.
def _tag(phase: str) -> int:
    return (pb.ProcessingRequest.DESCRIPTOR.fields_by_name[phase].number << 3) | 2


_BY_TAG = {_tag(name): (answer, False) for name, answer in EMPTY_ANSWERS.items()}
_HEADERS_ANSWER = EMPTY_ANSWERS["request_headers"]
_HOLD_FOR_BODY = pb.ProcessingResponse(request_headers=pb.HeadersResponse(),
                                       mode_override={"request_body_mode": "BUFFERED"}).SerializeToString()


def routed_answer(name: str, value: str, clear_route_cache: bool = True) -> bytes:
    """A fixed request-headers answer in the picker's shape: set header ``name`` to ``value``
    (``raw_value``, OVERWRITE_IF_EXISTS_OR_ADD) with ``clear_route_cache`` (unless told not to:
    the bench's measure of what re-routing costs Envoy)."""
    option = base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=name, raw_value=value.encode()),
                                        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=[option]),
                               clear_route_cache=clear_route_cache)
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common)).SerializeToString()


class NullService:
    """A :class:`~ext_proc.transport.base.Service` that changes nothing and decides nothing.

    ``process`` answers each message with the no-change answer of its phase (read from the first
    byte; a message that does not start with a phase tag is parsed with protobuf); ``access_log``
    drops the message. Like the picker, it ends the stream with its answer to the last message
    Envoy sends (the request headers; with ``hold_body`` the request body), so answer and
    trailers leave in one write. With ``hold_body`` the request-headers answer also asks Envoy
    for the buffered body (``mode_override``, as the picker does with body routing on). With
    ``headers_answer`` (e.g. :func:`routed_answer`) that fixed answer replaces the no-change one
    for request headers (without ``hold_body``) or for the body (with it).
    """

    def __init__(self, hold_body: bool = False, headers_answer: bytes | None = None) -> None:
        self._by_tag = dict(_BY_TAG)
        if hold_body:
            self._by_tag[_tag("request_headers")] = (_HOLD_FOR_BODY, False)
            self._by_tag[_tag("request_body")] = (_as_body(headers_answer) or EMPTY_ANSWERS["request_body"], True)
        else:
            self._by_tag[_tag("request_headers")] = (headers_answer or _HEADERS_ANSWER, True)

    def process(self, stream: StreamState, data: bytes) -> tuple[bytes, bool]:
        """``(fixed answer bytes, whether the stream ends)`` for one serialized ``ProcessingRequest``."""
        answer = self._by_tag.get(data[0]) if data else None
        if answer is None:
            phase = pb.ProcessingRequest.FromString(data).WhichOneof("request") or "request_headers"
            answer = self._by_tag[_tag(phase)]
        return answer

    def access_log(self, data: bytes) -> None:
        """Drop one access-log message."""

    def access_log_opened(self) -> None:
        """Nothing to track."""

    def access_log_closed(self) -> None:
        """Nothing to track."""


def _as_body(headers_answer: bytes | None) -> bytes | None:
    """The same mutation as a request-body answer."""
    if headers_answer is None:
        return None
    common = pb.ProcessingResponse.FromString(headers_answer).request_headers.response
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common)).SerializeToString()


async def _serve(listen: str, reuse_port: bool, hold_body: bool, set_header: str | None,
                 clear_route_cache: bool = True) -> None:
    from ext_proc.transport.h2.server import start_fast_server

    answer = None
    if set_header:
        name, sep, value = set_header.partition("=")
        if not sep or not name:
            raise SystemExit(f"--set-header wants NAME=VALUE, got {set_header!r}")
        answer = routed_answer(name, value, clear_route_cache)
    await start_fast_server(NullService(hold_body, answer), listen, reuse_port=reuse_port)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    """``python -m bench.null_ext_proc --listen HOST:PORT``: serve until killed."""
    import uvloop

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT")
    parser.add_argument("--reuse-port", action="store_true", help="SO_REUSEPORT (several processes, one port)")
    parser.add_argument("--hold-body", action="store_true", help="ask Envoy for the buffered request body")
    parser.add_argument("--set-header", metavar="NAME=VALUE",
                        help="answer with this header mutation and clear_route_cache (the picker's answer shape)")
    parser.add_argument("--no-clear-route-cache", action="store_true",
                        help="with --set-header: leave clear_route_cache off (Envoy keeps the route it had)")
    args = parser.parse_args(argv)
    uvloop.run(_serve(args.listen, args.reuse_port, args.hold_body, args.set_header, not args.no_clear_route_cache))


if __name__ == "__main__":
    main()
