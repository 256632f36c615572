"""What one request costs the picker in Python CPU, offline: the fast transport fed Envoy's messages.

No Envoy, no sockets: a picker handler built from the same config as ``inferlb bench picker``'s
(:func:`bench.picker.control_plane_config`'s shape: one service, ``v1``, the default profile and
body routing, the shared load view on) and ``endpoints`` healthy endpoints, behind the fast
transport's sans-I/O HTTP/2 :class:`~ext_proc.transport.h2.conn.Connection`. Each request is what
Envoy sends on one ext_proc stream (``inferlb bench picker``'s traffic: a POST with a JSON body,
half of them with an ``x-session-id`` of 64):

1. the stream's HEADERS (HPACK-encoded by a client encoder, as Envoy's are: the same block every
   stream once the dynamic table holds it) and a DATA frame with the request-headers
   ``ProcessingRequest`` (9 headers in ``raw_value``, as Envoy 1.40 sends them); the picker holds
   the request for its body;
2. DATA frames (at most 16 KiB each, the default ``MAX_FRAME_SIZE``) carrying the request-body
   ``ProcessingRequest`` (the OpenAI chat body of ``body_kb`` KiB of :func:`bench.picker.body_json`,
   with ``end_of_stream``), then the stream's END_STREAM once answered;
3. per batch, one access-log message with an entry per request of the batch (the cluster and
   override-host headers the picker set, a 200 and its timings), as Envoy's completion log sends.

``batch`` streams share each read (Envoy multiplexes its requests on one HTTP/2 connection: at 16
connections one read carries several). Only :meth:`Connection.receive` is timed, with
:func:`time.process_time` (this process's CPU: other jobs on a shared machine inflate wall time,
not CPU time); building the frames and reading the answers are not. Printed: µs of CPU per request,
the fastest of ``rounds`` rounds (the least disturbed), with ``--profile`` a cProfile table of one
more round instead.

Only public parts of ``ext_proc``, ``inferlb`` and ``xds_server`` are used, so one copy of this file
times two checkouts (run it with each checkout's interpreter, interleaved, to compare them)::

    python3 bench/request_cost.py [--body-kb 20] [--endpoints 1] [--requests 4000] [--rounds 5] [--profile]

Raises SystemExit (through :mod:`argparse`) on bad arguments; an answer that is not a decision
(no override-host header) raises RuntimeError: the harness would time something else.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import struct
import sys
import time
from typing import Any

import hpack
import yaml
from envoy.config.core.v3 import address_pb2, base_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import duration_pb2

from bench.picker import body_json
from ext_proc.engine_keys import engine_keys
from ext_proc.handler import PickerHandler
from ext_proc.prefix_events import EventIndex
from ext_proc.transport.h2.conn import Connection, Limits
from ext_proc.view import ViewHolder
from inferlb.picker_config import picker_settings, routing_table
from xds_server.config.load import parse_config

PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
ACCESS_LOG = "/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs"
_FRAME = struct.Struct(">BHBBI")
DATA, HEADERS, WINDOW_UPDATE = 0, 1, 8
END_STREAM, END_HEADERS = 0x1, 0x4
MAX_FRAME = 16384
SESSIONS = 64


def _config(endpoints: int, prefix_source: str = "routing") -> str:
    return yaml.safe_dump({
        "listen": {"xds": "127.0.0.1:1", "ext_proc": "127.0.0.1:0", "admin": "127.0.0.1:2"},
        "picker": {"admission": False, "prefix_source": prefix_source},
        "services": [{"name": "bench", "versions": [
            {"name": "v1", "endpoints": [{"address": f"127.0.0.{1 + i}:8000"} for i in range(endpoints)]}]}],
    })


def handler_for(endpoints: int, prefix_source: str = "routing") -> tuple[PickerHandler, str]:
    """The picker's handler (settings and routing from the config, as ``inferlb ext-proc --xds`` gets
    them) with ``endpoints`` healthy endpoints of weight 100; and the cluster's name. ``prefix_source``:
    the config's ``picker.prefix_source`` (``kv_events``: the prompt keyed as the engine keys it, the
    precise index with no events, as before a subscription's first batch)."""
    cfg = parse_config(_config(endpoints, prefix_source))
    routing = routing_table(cfg)
    cluster = routing.services[0].clusters["v1"]
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=cluster)
    locality = cla.endpoints.add()
    for i in range(endpoints):
        lb = locality.lb_endpoints.add(health_status=health_check_pb2.HEALTHY)
        lb.endpoint.address.socket_address.address = f"127.0.0.{1 + i}"
        lb.endpoint.address.socket_address.port_value = 8000
        lb.load_balancing_weight.value = 100
    holder = ViewHolder()
    holder.update({cluster: cla}, routing)
    handler = PickerHandler.from_settings(holder, picker_settings(cfg))
    handler.control.share_load()
    return handler, cluster


def _frame(type_: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _FRAME.pack(n >> 16, n & 0xFFFF, type_, flags, stream_id) + payload


def _grpc(message: bytes) -> bytes:
    return struct.pack(">BI", 0, len(message)) + message


def _data_frames(stream_id: int, data: bytes, end: bool = False) -> bytes:
    out = [_frame(DATA, 0, stream_id, data[i: i + MAX_FRAME]) for i in range(0, len(data), MAX_FRAME)]
    if end:
        out.append(_frame(DATA, END_STREAM, stream_id))
    return b"".join(out)


def headers_message(i: int, body_bytes: int) -> bytes:
    """The request-headers ``ProcessingRequest`` of request ``i`` (a session on every other one): a
    POST with a JSON body of ``body_bytes``, or a GET (``end_of_stream``) when 0."""
    values = [(":authority", "127.0.0.1:10000"), (":path", "/"), (":method", "POST" if body_bytes else "GET"),
              (":scheme", "http"), ("model-version", "v1")]
    if body_bytes:
        values += [("content-type", "application/json"), ("content-length", str(body_bytes))]
    if i % 2 == 0:
        values.append(("x-session-id", f"bench-session-{i % SESSIONS}"))
    values += [("x-forwarded-proto", "http"), ("x-request-id", f"req-{i:032d}")]
    header_map = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values])
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=header_map, end_of_stream=not body_bytes),
                                metadata_context={},
                                protocol_config=pb.ProtocolConfiguration()).SerializeToString()


def body_message(body: bytes) -> bytes:
    """The buffered request-body ``ProcessingRequest``."""
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True),
                                metadata_context={}).SerializeToString()


def _answers(out: bytes) -> dict[int, list[bytes]]:
    """``{stream id: gRPC messages}`` of the server's output (DATA frames only)."""
    data: dict[int, bytearray] = {}
    pos = 0
    while pos < len(out):
        hi, lo, type_, _, sid = _FRAME.unpack_from(out, pos)
        n = hi << 16 | lo
        if type_ == DATA and n:
            data.setdefault(sid, bytearray()).extend(out[pos + 9: pos + 9 + n])
        pos += 9 + n
    messages: dict[int, list[bytes]] = {}
    for sid, buf in data.items():
        while buf:
            _, n = struct.unpack_from(">BI", buf)
            messages.setdefault(sid, []).append(bytes(buf[5: 5 + n]))
            del buf[: 5 + n]
    return messages


def _pin(answer: bytes, header: str) -> str:
    response = pb.ProcessingResponse.FromString(answer)
    phase = response.WhichOneof("response")
    for option in getattr(response, phase).response.header_mutation.set_headers:
        if option.header.key == header:
            return (option.header.raw_value or option.header.value.encode()).decode()
    raise RuntimeError(f"an answer without {header}: {response}")


def _duration(ns: int) -> duration_pb2.Duration:
    return duration_pb2.Duration(seconds=ns // 1_000_000_000, nanos=ns % 1_000_000_000)


def _access_log(done: list[tuple[str, str]], cluster: str, cluster_header: str, pin_header: str,
                first: bool) -> bytes:
    """A ``StreamAccessLogsMessage`` with one completed entry per ``(request id, pin)`` of ``cluster``
    (the first of a stream carries Envoy's identifier)."""
    message = als_pb2.StreamAccessLogsMessage()
    if first:
        message.identifier.log_name = "inferlb_completions"
        message.identifier.node.id = "bench"
    for rid, pin in done:
        e = message.http_logs.log_entry.add()
        e.request.request_id = rid
        e.request.request_headers[cluster_header] = cluster
        e.request.request_headers[pin_header] = pin
        host, _, port = pin.rpartition(":")
        props = e.common_properties
        props.upstream_remote_address.socket_address.CopyFrom(address_pb2.SocketAddress(address=host,
                                                                                        port_value=int(port)))
        props.upstream_request_attempt_count = 1
        props.time_to_first_upstream_tx_byte.CopyFrom(_duration(400_000))
        props.time_to_last_upstream_rx_byte.CopyFrom(_duration(900_000))
        props.time_to_first_upstream_rx_byte.CopyFrom(_duration(800_000))
        props.time_to_last_downstream_tx_byte.CopyFrom(_duration(1_000_000))
        e.response.response_code.value = 200
    return message.SerializeToString()


class Client:
    """Envoy's side of one HTTP/2 connection to the picker: frames in, answers read (untimed)."""

    def __init__(self, handler: PickerHandler, cluster: str, body_kb: int) -> None:
        self.conn = Connection(handler, Limits(), self._late, self._no_timer)
        self.cluster = cluster
        routing = handler.holder.current.routing
        self.cluster_header, self.pin_header = routing.cluster_header, routing.override_host_header
        self.encoder = hpack.Encoder()
        self.next_id = 1
        body = body_json(body_kb).encode() if body_kb else b""
        self.body = body_message(body) if body_kb else None
        self.body_bytes = len(body)
        self.cpu = 0.0
        self.requests = 0
        self.sent = 0
        preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0)
        self._receive(preface + _frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1 << 24)))
        self.log_id, self.log_headers = self._open(ACCESS_LOG)
        self.log_sent = False

    @staticmethod
    def _late(data: bytes) -> None:
        raise RuntimeError("an answer came outside receive(): admission is off, none should")

    @staticmethod
    def _no_timer(delay: float, callback: Any) -> Any:
        raise RuntimeError("no timer expected: no answer waits")

    def _open(self, path: str) -> tuple[int, bytes]:
        """A new stream of ``path``: its id and its HEADERS frame (ext_proc's with the filter's timeout)."""
        sid = self.next_id
        self.next_id += 2
        return sid, _frame(HEADERS, END_HEADERS, sid, self.encoder.encode([
            (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "ext_proc"),
            ("te", "trailers"), ("content-type", "application/grpc"),
            *([("grpc-timeout", "250m")] if path == PROCESS else [])]))

    def _receive(self, data: bytes) -> bytes:
        start = time.process_time()
        out = self.conn.receive(data)
        self.cpu += time.process_time() - start
        self.sent += len(out)
        return out

    def batch(self, first: int, n: int) -> None:
        """Requests ``first .. first + n - 1``, each stream's messages in one read per phase."""
        opened = [self._open(PROCESS) for _ in range(n)]
        sids = [sid for sid, _ in opened]
        wire = [self.log_headers] if not self.log_sent else []
        for i, (sid, block) in zip(range(first, first + n), opened, strict=True):
            wire.append(block)
            wire.append(_data_frames(sid, _grpc(headers_message(i, self.body_bytes)), end=self.body is None))
        answers = _answers(self._receive(b"".join(wire)))
        done = []
        if self.body is not None:
            held = _grpc(self.body)
            answers = _answers(self._receive(b"".join(_data_frames(sid, held, end=True) for sid in sids)))
        for i, sid in zip(range(first, first + n), sids, strict=True):
            (answer,) = answers[sid]
            done.append((f"req-{i:032d}", _pin(answer, self.pin_header)))
        log = _access_log(done, self.cluster, self.cluster_header, self.pin_header, not self.log_sent)
        self.log_sent = True
        self._receive(_data_frames(self.log_id, _grpc(log)))
        if self.sent > (1 << 20):  # keep the connection's send window open, as Envoy's WINDOW_UPDATEs do
            sent, self.sent = self.sent, 0
            self._receive(_frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", sent)))
        self.requests += n


def one_round(client: Client, requests: int, batch: int) -> float:
    """µs of CPU per request over ``requests`` more requests of ``client``."""
    cpu, count = client.cpu, client.requests
    while client.requests - count < requests:
        client.batch(client.requests, batch)
    return (client.cpu - cpu) / (client.requests - count) * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--body-kb", type=int, default=20, help="KiB of JSON body (0: a GET, no body)")
    ap.add_argument("--endpoints", type=int, default=1, help="healthy endpoints of the cluster")
    ap.add_argument("--batch", type=int, default=4, help="streams per read")
    ap.add_argument("--requests", type=int, default=4000, help="requests per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (the fastest is printed)")
    ap.add_argument("--profile", action="store_true", help="print a cProfile table of one round instead")
    ap.add_argument("--prefix-source", choices=("routing", "kv_events"), default="routing",
                    help="picker.prefix_source (kv_events: the engine's block keys and the precise index)")
    ap.add_argument("--events-held", action="store_true",
                    help="with kv_events: every endpoint's events said it holds the prompt's blocks (a shared "
                         "prompt's steady state; without it no event ever came and each pick pends every key)")
    args = ap.parse_args(argv)
    handler, cluster = handler_for(args.endpoints, args.prefix_source)
    if args.events_held and isinstance(handler.control.prefixes, EventIndex) and args.body_kb:
        keys = engine_keys(json.loads(body_json(args.body_kb)), handler.holder.current.routing.engine_block_size)
        for endpoint in handler.holder.current.clusters[cluster].endpoints:
            handler.control.prefixes.stored(endpoint, keys, None, handler.holder.current.routing.prefix_blocks)
    client = Client(handler, cluster, args.body_kb)
    one_round(client, args.requests, args.batch)  # warm: sessions pinned, caches filled
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        one_round(client, args.requests, args.batch)
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(30)
        return
    times = [one_round(client, args.requests, args.batch) for _ in range(args.rounds)]
    print(json.dumps({"body_kb": args.body_kb, "endpoints": args.endpoints, "batch": args.batch,
                      "prefix_source": args.prefix_source, "events_held": args.events_held,
                      "us_per_request": round(min(times), 2), "rounds": [round(t, 2) for t in times]}))


if __name__ == "__main__":
    main()
