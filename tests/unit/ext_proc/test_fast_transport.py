"""The fast transport's HTTP/2 connection, driven by the `h2` library as a conformant client.

No sockets here (the connection is sans-I/O): bytes from an h2 client go in, and what comes out
is parsed by the same h2 client, which would reject any protocol violation.
"""

from __future__ import annotations

import asyncio
import struct

import h2.config
import h2.connection
import h2.events
import h2.settings
import hpack
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from ext_proc.admission import Admission
from ext_proc.handler import PickerHandler, StreamState
from ext_proc.transport.h2 import conn as h2conn
from ext_proc.transport.h2.conn import PROCESS_METHOD, Connection, Limits, frame, parse_grpc_timeout
from ext_proc.view import RoutingTable, ServiceRoute, ViewHolder
from tests.unit.ext_proc.test_admission import limited
from tests.unit.ext_proc.test_ext_proc_server import assignment, headers_request

ROUTING = RoutingTable(services=(ServiceRoute("llm", ("*",), "v1", {"v1": "llm-v1", "v2": "llm-v2"}, affinity="soft"),))
ACCESS_LOG = "/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs"


def holder() -> ViewHolder:
    h = ViewHolder()
    h.update({"llm-v1": assignment("llm-v1"), "llm-v2": assignment("llm-v2")}, ROUTING)
    return h


def no_timers(delay, callback):  # sync tests never send grpc-timeout
    raise AssertionError("no timer expected")


class Peer:
    """An h2 client wired to a server Connection."""

    def __init__(self, handler: PickerHandler | None = None, limits: Limits | None = None,
                 call_later=no_timers, window: int | None = None) -> None:
        self.handler = handler or PickerHandler(holder())
        self.written: list[bytes] = []
        self.server = Connection(self.handler, limits or Limits(), self.written.append, call_later)
        self.client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.client.initiate_connection()
        if window is not None:
            self.client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        self.events: list = []
        self.feed_client(self.server.start())
        self.pump()

    def feed_client(self, data: bytes) -> None:
        if data:
            self.events += self.client.receive_data(data)

    def pump(self, extra: bytes = b"") -> bytes:
        """Send what the client has queued (plus raw ``extra``) and hand the answer back to it."""
        out = self.server.receive(self.client.data_to_send() + extra)
        self.feed_client(out)
        for late in self.written:
            self.feed_client(late)
        self.written.clear()
        return out

    def call(self, messages: list[bytes], path: str = PROCESS_METHOD, end: bool = True,
             extra_headers: list[tuple[str, str]] | None = None) -> int:
        sid = self.client.get_next_available_stream_id()
        self.client.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":path", path),
                                       (":authority", "picker"), ("content-type", "application/grpc"),
                                       ("te", "trailers"), *(extra_headers or [])])
        body = b"".join(struct.pack(">BI", 0, len(m)) + m for m in messages)
        self.client.send_data(sid, body, end_stream=end)
        return sid

    def result(self, sid: int) -> tuple[list[bytes], dict[bytes, bytes]]:
        """(gRPC messages, trailers) the client received on stream ``sid``."""
        data = b"".join(e.data for e in self.events if isinstance(e, h2.events.DataReceived) and e.stream_id == sid)
        for e in self.events:
            if isinstance(e, h2.events.DataReceived) and e.stream_id == sid:
                self.client.acknowledge_received_data(e.flow_controlled_length, sid)
        trailers: dict[bytes, bytes] = {}
        for e in self.events:
            if isinstance(e, (h2.events.TrailersReceived, h2.events.ResponseReceived)) and e.stream_id == sid:
                trailers.update(dict(e.headers))
        messages = []
        while data:
            _, n = struct.unpack(">BI", data[:5])
            messages.append(data[5: 5 + n])
            data = data[5 + n:]
        return messages, trailers

    def ended(self, sid: int) -> bool:
        return any(isinstance(e, h2.events.StreamEnded) and e.stream_id == sid for e in self.events)


def direct(request: pb.ProcessingRequest) -> bytes:
    """What the handler answers without any transport."""
    answer, _ = PickerHandler(holder()).process(StreamState(), request.SerializeToString())
    return answer


def test_one_call_answers_like_the_handler_and_ends_ok():
    peer = Peer()
    request = headers_request(model_version="v2", x_session_id="alice")
    sid = peer.call([request.SerializeToString()])
    peer.pump()
    messages, trailers = peer.result(sid)
    assert messages == [direct(request)]
    assert trailers[b":status"] == b"200" and trailers[b"grpc-status"] == b"0"
    assert peer.ended(sid)


def test_many_streams_in_one_read_are_answered_in_one_write():
    peer = Peer()
    sids = [peer.call([headers_request(x_session_id=f"s{i}").SerializeToString()]) for i in range(50)]
    out = peer.pump()
    assert out and not peer.written
    assert all(peer.ended(sid) and peer.result(sid)[1][b"grpc-status"] == b"0" for sid in sids)
    # Identical header blocks after the first: served from the block cache, still right.
    assert len(peer.server._block_cache) >= 1


def test_hpack_cache_follows_dynamic_table_changes():
    """Alternate known and unknown paths, with changing custom headers that h2 indexes."""
    peer = Peer()
    expected = {}
    for i in range(30):
        path = PROCESS_METHOD if i % 3 else "/nope.Service/Method"
        sid = peer.call([headers_request().SerializeToString()], path=path,
                        extra_headers=[("x-trace", f"t{i % 4}")])
        expected[sid] = b"0" if i % 3 else b"12"
        peer.pump()
    assert {sid: peer.result(sid)[1][b"grpc-status"] for sid in expected} == expected


def test_ping_is_echoed():
    peer = Peer()
    peer.client.ping(b"12345678")
    peer.pump()
    assert any(isinstance(e, h2.events.PingAckReceived) and e.ping_data == b"12345678" for e in peer.events)


def test_answers_wait_for_the_clients_flow_control_window():
    peer = Peer(window=16)
    request = headers_request(model_version="v2", x_session_id="alice")
    sid = peer.call([request.SerializeToString()])
    peer.pump()
    got = [e for e in peer.events if isinstance(e, h2.events.DataReceived)]
    assert sum(len(e.data) for e in got) == 16 and not peer.ended(sid)
    for _ in range(20):
        for e in [e for e in peer.events if isinstance(e, h2.events.DataReceived)]:
            peer.client.acknowledge_received_data(e.flow_controlled_length, sid)
        peer.events = [e for e in peer.events if not isinstance(e, h2.events.DataReceived)] + got
        peer.client.increment_flow_control_window(64, sid)
        peer.client.increment_flow_control_window(64)
        before = len(peer.events)
        peer.pump()
        got += [e for e in peer.events[before:] if isinstance(e, h2.events.DataReceived)]
        if peer.ended(sid):
            break
    data = b"".join(e.data for e in got)
    assert data[5:] == direct(request) and peer.ended(sid)


def test_receive_windows_are_refilled():
    """30 KB of access log through 4 KiB stream / 8 KiB connection windows: the client may only
    send what our WINDOW_UPDATEs allow, and we keep allowing."""
    peer = Peer(limits=Limits(stream_window=4096, connection_window=8192))
    sid = peer.call([], path=ACCESS_LOG, end=False)
    body = b"".join(struct.pack(">BI", 0, 3000) + b"x" * 3000 for _ in range(10))
    sent = 0
    for _ in range(100):
        room = min(peer.client.local_flow_control_window(sid), len(body) - sent)
        if room:
            peer.client.send_data(sid, body[sent: sent + room])
            sent += room
        peer.pump()
        if sent == len(body):
            break
    assert sent == len(body)
    peer.client.end_stream(sid)
    peer.pump()
    assert peer.ended(sid) and peer.result(sid)[1][b"grpc-status"] == b"0"


def test_a_header_block_split_into_continuation_frames():
    peer = Peer(limits=Limits(max_header_block=64 << 10))
    big = [(f"x-big-{i}", "v" * 4000) for i in range(6)]  # ~24 KB: HEADERS + CONTINUATION
    sid = peer.call([headers_request().SerializeToString()], extra_headers=big)
    peer.pump()
    assert peer.result(sid)[1][b"grpc-status"] == b"0"


def test_a_header_block_over_the_limit_ends_the_connection():
    peer = Peer(limits=Limits(max_header_block=8 << 10))
    peer.call([b""], extra_headers=[(f"x-big-{i}", "v" * 4000) for i in range(4)])
    peer.pump()
    [goaway] = [e for e in peer.events if isinstance(e, h2.events.ConnectionTerminated)]
    assert goaway.error_code == h2conn.ENHANCE_YOUR_CALM and peer.server.done


def test_unknown_method_oversized_and_compressed_messages():
    peer = Peer(limits=Limits(max_message=100))
    unknown = peer.call([b""], path="/a.B/C")
    big = peer.call([b"x" * 101])
    sid = peer.client.get_next_available_stream_id()
    peer.client.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":path", PROCESS_METHOD),
                                   (":authority", "p"), ("content-type", "application/grpc")])
    peer.client.send_data(sid, struct.pack(">BI", 1, 3) + b"abc", end_stream=True)
    peer.pump()
    assert peer.result(unknown)[1][b"grpc-status"] == b"12"
    assert peer.result(big)[1][b"grpc-status"] == b"8"
    assert peer.result(sid)[1][b"grpc-status"] == b"12"


def test_undecodable_message_is_invalid_argument():
    peer = Peer()
    sid = peer.call([b"\xff\xff\xff"])
    peer.pump()
    _, trailers = peer.result(sid)
    assert trailers[b"grpc-status"] == b"3" and b"undecodable" in trailers[b"grpc-message"]


def test_access_log_stream_counts_completions_and_open_streams():
    handler = PickerHandler(holder())
    handler.control.inflight.picked("llm-v1", "10.0.0.1:8000")
    peer = Peer(handler)
    from tests.unit.ext_proc.test_inflight import log_message
    sid = peer.call([log_message(("llm-v1", "10.0.0.1:8000"))], path=ACCESS_LOG, end=False)
    peer.pump()
    assert handler.control.inflight.streams == 1 and handler.control.inflight.endpoints == {}
    peer.client.end_stream(sid)
    peer.pump()
    assert peer.result(sid)[1][b"grpc-status"] == b"0" and handler.control.inflight.streams == 0
    again = peer.call([], path=ACCESS_LOG, end=False)
    peer.pump()
    assert handler.control.inflight.streams == 1 and again
    peer.server.lost()
    assert handler.control.inflight.streams == 0


def test_client_goaway_and_server_drain():
    peer = Peer()
    sid = peer.call([headers_request().SerializeToString()])
    peer.pump()
    drain = peer.server.drain()
    peer.feed_client(drain)
    [goaway] = [e for e in peer.events if isinstance(e, h2.events.ConnectionTerminated)]
    assert goaway.error_code == 0 and goaway.last_stream_id == sid
    # The stream Envoy half-closed is done: nothing is left, the transport may close.
    assert peer.server.done


def test_client_goaway_closes_once_streams_are_done():
    peer = Peer()
    sid = peer.call([headers_request().SerializeToString()], end=False)
    peer.pump()
    peer.client.close_connection()
    peer.pump()
    assert peer.server.closing and not peer.server.done  # the stream is still open (remote side)
    peer.server.receive(frame(h2conn.RST_STREAM, 0, sid, struct.pack(">I", 8)))
    assert peer.server.done


@pytest.mark.parametrize(("raw", "code"), [
    (frame(h2conn.DATA, 0, 0, b"x"), h2conn.PROTOCOL_ERROR),  # DATA on stream 0
    (frame(h2conn.HEADERS, 4, 2, b"\x82"), h2conn.PROTOCOL_ERROR),  # even stream id
    (frame(h2conn.PUSH_PROMISE, 4, 1, b"\0\0\0\2"), h2conn.PROTOCOL_ERROR),
    (frame(h2conn.WINDOW_UPDATE, 0, 0, b"\0\0\0\0"), h2conn.PROTOCOL_ERROR),
    (frame(h2conn.WINDOW_UPDATE, 0, 0, b"\x7f\xff\xff\xff"), h2conn.FLOW_CONTROL_ERROR),
    (frame(h2conn.PING, 0, 0, b"short"), h2conn.FRAME_SIZE_ERROR),
    (frame(h2conn.SETTINGS, 0, 0, b"\0\4\x80\0\0\0"), h2conn.FLOW_CONTROL_ERROR),
    (frame(h2conn.SETTINGS, 0, 0, b"\0\5\0\0\0\1"), h2conn.PROTOCOL_ERROR),
    (frame(h2conn.CONTINUATION, 4, 1, b"\x82"), h2conn.PROTOCOL_ERROR),
    (frame(h2conn.HEADERS, 4, 1, b"\xff\xff\xff\xff\x0f"), h2conn.COMPRESSION_ERROR),
    (frame(h2conn.RST_STREAM, 0, 9, b"\0\0\0\0"), h2conn.PROTOCOL_ERROR),  # idle stream
    (b"\0\x40\x01" + bytes(6), h2conn.FRAME_SIZE_ERROR),  # a 16 KiB + 1 frame
])
def test_protocol_errors_end_the_connection_with_goaway(raw, code):
    peer = Peer()
    out = peer.server.receive(raw)
    assert out[3] == h2conn.GOAWAY and struct.unpack(">I", out[13:17])[0] == code
    assert peer.server.done and peer.server.receive(b"more") == b""


def test_bad_preface_and_missing_settings():
    conn = Connection(PickerHandler(holder()), Limits(), lambda b: None, no_timers)
    assert conn.receive(b"GET / HTTP/1.1\r\n\r\n")[3] == h2conn.GOAWAY and conn.done
    conn = Connection(PickerHandler(holder()), Limits(), lambda b: None, no_timers)
    assert conn.receive(h2conn.PREFACE + frame(h2conn.PING, 0, 0, bytes(8)))[3] == h2conn.GOAWAY


def test_stream_limit_refuses_extra_streams():
    peer = Peer(limits=Limits(max_streams=2))
    encoder = hpack.Encoder()
    raw = b"".join(frame(h2conn.HEADERS, h2conn.END_HEADERS, sid, encoder.encode(
        [(":method", "POST"), (":path", PROCESS_METHOD), ("content-type", "application/grpc")]))
        for sid in (1, 3, 5))
    out = peer.server.receive(raw)
    assert out == frame(h2conn.RST_STREAM, 0, 5, struct.pack(">I", h2conn.REFUSED_STREAM))
    assert peer.server.active_streams == 2


@pytest.mark.parametrize(("value", "seconds"), [
    (b"100m", 0.1), (b"2S", 2.0), (b"1H", 3600.0), (b"5u", 5e-6), (b"123456789S", None), (b"10x", None),
    (b"m", None), (b"", None),
])
def test_grpc_timeout_parsing(value, seconds):
    assert parse_grpc_timeout(value) == (pytest.approx(seconds) if seconds else None)


def admission_handler(max_queue: int = 4) -> PickerHandler:
    h = ViewHolder()
    h.update({"llm-v1": limited([1])}, ROUTING)
    handler = PickerHandler(h, admission=Admission(max_queue, timeout_s=5.0, retry_after_s=1))
    handler.control.inflight.streams = 1
    handler.control.inflight.picked("llm-v1", None)  # the cluster is full
    return handler


async def test_a_waiting_answer_is_written_when_admitted():
    handler = admission_handler()
    peer = Peer(handler, call_later=asyncio.get_running_loop().call_later)
    sid = peer.call([headers_request(x_session_id="w").SerializeToString()])
    peer.pump()
    assert not peer.ended(sid) and handler.control.admission.queued("llm-v1") == 1
    from tests.unit.ext_proc.test_inflight import log_message
    handler.access_log(log_message(("llm-v1", None)))  # a slot frees: the answer goes out
    await asyncio.sleep(0)  # the future's callbacks run on the loop
    peer.pump()
    assert peer.ended(sid) and peer.result(sid)[1][b"grpc-status"] == b"0"


async def test_grpc_timeout_ends_a_waiting_stream_with_deadline_exceeded():
    handler = admission_handler()
    peer = Peer(handler, call_later=asyncio.get_running_loop().call_later)
    sid = peer.call([headers_request(x_session_id="w").SerializeToString()], extra_headers=[("grpc-timeout", "20m")])
    peer.pump()
    await asyncio.sleep(0.05)
    peer.pump()
    assert peer.result(sid)[1][b"grpc-status"] == b"4"
    assert handler.control.admission.release(lambda c: True) == 0  # the waiter was cancelled


async def test_a_reset_stream_drops_its_waiting_answer():
    handler = admission_handler()
    peer = Peer(handler, call_later=asyncio.get_running_loop().call_later)
    sid = peer.call([headers_request(x_session_id="w").SerializeToString()])
    peer.pump()
    peer.client.reset_stream(sid)
    peer.pump()
    assert peer.server.active_streams == 0
    assert handler.control.admission.release(lambda c: True) == 0


def test_an_answer_given_at_once_arms_no_deadline_timer():
    """grpc-timeout only matters for an answer that waits: the common stream costs no timer."""
    peer = Peer()  # no_timers: any call_later fails the test
    request = headers_request(x_session_id="t")
    sid = peer.call([request.SerializeToString()], extra_headers=[("grpc-timeout", "250m")])
    peer.pump()
    assert peer.result(sid) == ([direct(request)], {b":status": b"200", b"content-type": b"application/grpc",
                                                     b"grpc-status": b"0"})


async def test_a_deadline_counts_from_the_stream_start_not_from_the_wait():
    handler = admission_handler()
    delays: list[float] = []
    loop = asyncio.get_running_loop()

    def call_later(delay, callback):
        delays.append(delay)
        return loop.call_later(delay, callback)

    peer = Peer(handler, call_later=call_later)
    peer.call([headers_request(x_session_id="w").SerializeToString()], extra_headers=[("grpc-timeout", "10S")])
    peer.pump()
    assert len(delays) == 1 and 9.0 < delays[0] <= 10.0


@pytest.mark.parametrize("window", [5, 40, 65535])
def test_answers_under_a_small_peer_window_match_the_one_buffer_path(window):
    """The one-buffer answer (headers, message, trailers) and the flow-controlled path send the same."""
    request = headers_request(model_version="v2", x_session_id="w")
    peer = Peer(window=window)
    sid = peer.call([request.SerializeToString()])
    for _ in range(20):
        peer.pump()
        messages, trailers = peer.result(sid)
        if peer.ended(sid):
            break
    assert messages == [direct(request)] and trailers[b"grpc-status"] == b"0"


def test_a_connection_preface_split_over_reads_is_kept():
    """Reads of 7 bytes: a partial preface, partial frames, all kept until they are whole."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()
    sid = client.get_next_available_stream_id()
    client.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":path", PROCESS_METHOD),
                              (":authority", "picker"), ("content-type", "application/grpc")])
    message = headers_request(x_session_id="p").SerializeToString()
    client.send_data(sid, struct.pack(">BI", 0, len(message)) + message, end_stream=True)
    wire = client.data_to_send()
    server = Connection(PickerHandler(holder()), Limits(), lambda b: None, no_timers)
    out = b"".join(server.receive(wire[i: i + 7]) for i in range(0, len(wire), 7))
    events = client.receive_data(server.start() + out)
    assert any(isinstance(e, h2.events.StreamEnded) and e.stream_id == sid for e in events)


class _FullDuplex:
    """A service that answers its first message later (a future) and every other one at once, as the
    endpoint-picker protocol's picker does in FULL_DUPLEX_STREAMED mode (ext_proc.gateway)."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []
        self.first: asyncio.Future | None = None

    def process(self, stream, data):
        self.seen.append(data)
        if self.first is None:
            self.first = asyncio.get_running_loop().create_future()
            return self.first, False
        return [b"echo:" + data], False


async def test_messages_that_come_while_an_answer_waits_are_answered_after_it_in_order():
    service = _FullDuplex()
    peer = Peer(service, call_later=asyncio.get_running_loop().call_later)  # type: ignore[arg-type]
    sid = peer.call([b"headers", b"chunk-1", b"chunk-2"], end=False)
    peer.pump()
    assert service.seen == [b"headers"] and peer.result(sid)[0] == []   # the rest waits behind the answer
    service.first.set_result([b"headers-answer", b"body-1"])            # several answers to one message
    await asyncio.sleep(0)
    peer.pump()
    assert service.seen == [b"headers", b"chunk-1", b"chunk-2"]
    assert peer.result(sid)[0] == [b"headers-answer", b"body-1", b"echo:chunk-1", b"echo:chunk-2"]
    assert not peer.ended(sid)
    peer.client.end_stream(sid)   # Envoy is done with the request: the stream ends OK
    peer.pump()
    assert peer.ended(sid) and peer.result(sid)[1][b"grpc-status"] == b"0"


class _Recorder:
    """A service that records each message it is given and answers none of them (the stream stays open)."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []

    def process(self, stream, data):
        self.seen.append(data)
        return None, False


@pytest.mark.parametrize("read", [None, 1000])
@pytest.mark.parametrize("sizes, cuts", [
    ([20_480], [16_384]),                   # a 20 KiB body in two frames, as Envoy sends it
    ([20_480, 3, 0, 40_000], [5, 16_000, 20_486, 20_490, 36_000, 52_000]),   # the next message in the last frame
    ([1, 70_000, 2], [3, 4, 7, 8, 9, 16_393, 32_777, 49_161, 65_545, 70_010]),  # a prefix cut, one-byte frames
])
def test_a_message_spanning_frames_is_given_whole_and_in_order(sizes, cuts, read):
    """Messages cut into DATA frames anywhere (inside the prefix, across frames, the next one starting in
    the last frame of the one before), in one read or many: the service gets each whole, in order."""
    service = _Recorder()
    peer = Peer(service)  # type: ignore[arg-type]
    messages = [bytes([i + 1]) * n for i, n in enumerate(sizes)]
    wire = b"".join(struct.pack(">BI", 0, len(m)) + m for m in messages)
    sid = peer.client.get_next_available_stream_id()
    peer.client.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":path", PROCESS_METHOD),
                                   (":authority", "picker"), ("content-type", "application/grpc")])
    for start, end in zip([0, *cuts], [*cuts, len(wire)], strict=True):
        peer.client.send_data(sid, wire[start:end])
    data = peer.client.data_to_send()
    step = read or len(data)
    for i in range(0, len(data), step):
        peer.server.receive(data[i: i + step])
    assert service.seen == messages


def test_a_stream_ending_inside_a_message_spanning_frames_is_an_internal_error():
    peer = Peer(_Recorder())  # type: ignore[arg-type]
    sid = peer.client.get_next_available_stream_id()
    peer.client.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":path", PROCESS_METHOD),
                                   (":authority", "picker"), ("content-type", "application/grpc")])
    peer.client.send_data(sid, struct.pack(">BI", 0, 20_000) + b"x" * 16_000)
    peer.client.send_data(sid, b"x" * 100, end_stream=True)
    peer.pump()
    assert peer.result(sid)[1][b"grpc-status"] == b"13"
