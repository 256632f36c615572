"""The fast transport under hostile input (hypothesis), against grpcio (differential), and over TLS."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
import struct
import threading
from collections.abc import Iterator

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ext_proc.handler import PickerHandler
from ext_proc.transport.base import StreamState, TlsFiles, ssl_context
from ext_proc.transport.grpcio import start_ext_proc_server
from ext_proc.transport.h2 import conn as h2conn
from ext_proc.transport.h2.conn import PREFACE, Connection, Limits, frame
from ext_proc.transport.h2.server import start_fast_server
from tests.unit.ext_proc.test_ext_proc_server import headers_request
from tests.unit.ext_proc.test_fast_transport import PROCESS_METHOD, Peer, direct, holder

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def frames_of(out: bytes) -> list[tuple[int, int, int, bytes]]:
    """Parse our output strictly: it must be whole, well-formed frames."""
    frames, pos = [], 0
    while pos < len(out):
        assert len(out) - pos >= 9, "truncated frame header"
        hi, lo, type_, flags, sid = struct.unpack_from(">BHBBI", out, pos)
        length = hi << 16 | lo
        assert length <= 16384 and pos + 9 + length <= len(out) and not sid >> 31
        frames.append((type_, flags, sid, out[pos + 9: pos + 9 + length]))
        pos += 9 + length
    return frames


def fresh() -> Connection:
    conn = Connection(PickerHandler(holder()), Limits(max_message=4096), lambda b: None, lambda d, c: None)
    frames_of(conn.start())
    assert frames_of(conn.receive(PREFACE + frame(h2conn.SETTINGS, 0, 0)))
    return conn


frame_strategy = st.builds(
    frame,
    st.integers(0, 11),
    st.integers(0, 255),
    st.sampled_from([0, 1, 2, 3, 5, 7, 9, 0x7FFFFFFF]),
    st.binary(max_size=80),
)


@FUZZ
@given(st.lists(frame_strategy, max_size=25), st.integers(1, 64))
def test_random_frames_never_crash_and_answers_are_well_formed(frames, chunk):
    conn = fresh()
    data = b"".join(frames)
    for i in range(0, len(data), chunk):
        out = conn.receive(data[i: i + chunk])
        parsed = frames_of(out)
        if conn.done and parsed and parsed[-1][0] == h2conn.GOAWAY:
            assert conn.receive(b"anything") == b""
    conn.lost()


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_never_crash(data):
    conn = Connection(PickerHandler(holder()), Limits(), lambda b: None, lambda d, c: None)
    frames_of(conn.start())
    frames_of(conn.receive(data))
    frames_of(conn.receive(PREFACE + data))
    conn.lost()


header_values = st.one_of(st.none(), st.sampled_from(["v1", "v2", "v9", "", "x" * 300]),
                          st.binary(max_size=12))
session_values = st.one_of(st.none(), st.text(max_size=12), st.binary(max_size=12))


def build_request(version, session, authority) -> pb.ProcessingRequest:
    headers = {}
    if version is not None:
        headers["model_version"] = version
    if session is not None:
        headers["x_session_id"] = session if isinstance(session, bytes) else session.encode()
    request = headers_request(**headers)
    if authority is not None:
        request.request_headers.headers.headers[0].raw_value = authority
    return request


requests_strategy = st.lists(
    st.builds(build_request, header_values, session_values, st.one_of(st.none(), st.binary(max_size=20))),
    min_size=1, max_size=12,
)


@settings(max_examples=80, deadline=None)
@given(requests_strategy, st.integers(1, 200), st.lists(st.binary(max_size=30), max_size=3))
def test_streams_split_at_random_byte_boundaries_get_the_handlers_answers(requests, chunk, garbage):
    """Many streams on one connection, the byte stream cut anywhere: each stream is answered as
    a handler fed the same requests in the same order answers it directly (the picker counts its
    own picks as load, so answers depend on the order); garbage messages end only their own stream."""
    peer = Peer()
    reference = PickerHandler(holder())
    sids = {peer.call([r.SerializeToString()]): r for r in requests}
    bad = [peer.call([g]) for g in garbage]
    data = peer.client.data_to_send()
    out = b""
    for i in range(0, len(data), chunk):
        out += peer.server.receive(data[i: i + chunk])
    peer.feed_client(out)
    for sid, request in sids.items():
        messages, trailers = peer.result(sid)
        expected, _ = reference.process(StreamState(), request.SerializeToString())
        assert trailers[b"grpc-status"] == b"0" and messages == [expected]
    for sid in bad:
        assert peer.ended(sid)


# --- differential: the same calls through grpcio and through the fast transport ------------------


class Servers:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.grpcio, self.grpcio_port = self.run(start_ext_proc_server(PickerHandler(holder()), "127.0.0.1:0"))
        self.fast, self.fast_port = self.run(start_fast_server(PickerHandler(holder()), "127.0.0.1:0"))

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def close(self) -> None:
        self.run(self.grpcio.stop(None))
        self.run(self.fast.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    s = Servers()
    yield s
    s.close()


def call(channel: grpc.Channel, messages: list[bytes]) -> tuple[list[bytes], grpc.StatusCode]:
    process = channel.stream_stream(PROCESS_METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    stream = process(iter(messages), timeout=5)
    try:
        return list(stream), stream.code()
    except grpc.RpcError as err:
        return [], err.code()


@settings(max_examples=60, deadline=None)
@given(requests_strategy, st.lists(st.binary(max_size=20), max_size=2))
def test_grpcio_and_fast_transports_answer_identically(servers, requests, garbage):
    with grpc.insecure_channel(f"127.0.0.1:{servers.grpcio_port}") as a, \
            grpc.insecure_channel(f"127.0.0.1:{servers.fast_port}") as b:
        for r in requests:
            assert call(a, [r.SerializeToString()]) == call(b, [r.SerializeToString()])
        for g in garbage:
            assert call(a, [g])[1] == call(b, [g])[1]
        # Several phases on one stream: no-change answers, then the decision.
        body = pb.ProcessingRequest(request_body=pb.HttpBody(body=b"{}")).SerializeToString()
        multi = [body, requests[0].SerializeToString()]
        assert call(a, multi) == call(b, multi)


# --- TLS ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "picker.test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("picker.test"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    folder = tmp_path_factory.mktemp("tls")
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                       serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    return str(folder / "cert.pem"), str(folder / "key.pem")


async def test_tls_with_alpn_h2(certificate):
    cert, key = certificate
    server, port = await start_fast_server(PickerHandler(holder()), "127.0.0.1:0",
                                           ssl_context=ssl_context(TlsFiles(cert, key)))
    try:
        creds = grpc.ssl_channel_credentials(open(cert, "rb").read())
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds,
                                           options=[("grpc.ssl_target_name_override", "picker.test")]) as channel:
            process = channel.stream_stream(PROCESS_METHOD, request_serializer=lambda b: b,
                                            response_deserializer=lambda b: b)
            request = headers_request(x_session_id="tls").SerializeToString()
            answers = [a async for a in process(iter([request]), timeout=5)]
        assert answers == [direct(headers_request(x_session_id="tls"))]
        # A TLS client that does not offer h2 is dropped.
        client = ssl.create_default_context(cafile=cert)
        client.set_alpn_protocols(["http/1.1"])
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client, server_hostname="picker.test")
        writer.write(PREFACE + frame(h2conn.SETTINGS, 0, 0))
        assert await asyncio.wait_for(reader.read(100), 5) == b""
        writer.close()
    finally:
        await server.stop(0)


async def test_graceful_stop_lets_a_connection_finish(certificate):
    server, port = await start_fast_server(PickerHandler(holder()), "127.0.0.1:0")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        process = channel.stream_stream(PROCESS_METHOD, request_serializer=lambda b: b,
                                        response_deserializer=lambda b: b)
        request = headers_request().SerializeToString()
        assert len([a async for a in process(iter([request]), timeout=5)]) == 1
        await server.stop(1.0)
        assert not server.protocols
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)


def test_serves_on_uvloop():
    """The production loop (``inferlb ext-proc`` runs on uvloop)."""
    import uvloop

    async def main() -> list[bytes]:
        server, port = await start_fast_server(PickerHandler(holder()), "127.0.0.1:0")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                process = channel.stream_stream(PROCESS_METHOD, request_serializer=lambda b: b,
                                                response_deserializer=lambda b: b)
                request = headers_request(x_session_id="uv").SerializeToString()
                return [a async for a in process(iter([request]), timeout=5)]
        finally:
            await server.stop(0.5)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(main()) == [direct(headers_request(x_session_id="uv"))]
