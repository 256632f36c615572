"""The compiled access-log decoder (``ext_proc._wire.access_log``) against its reference (protobuf's
parse and the reads of :func:`ext_proc.wire.access_log_py`): differential tests on generated, captured
and corrupted ``StreamAccessLogsMessage`` bytes. Whatever protobuf rejects the compiled decoder
declines (None: the caller then parses with protobuf, which raises); whatever it accepts, it decodes
exactly as the reference."""

from __future__ import annotations

from envoy.config.core.v3 import address_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2
from google.protobuf import descriptor_pool, duration_pb2, message_factory, wrappers_pb2
from google.protobuf.message import DecodeError
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ext_proc import _wire, wire  # _wire: built by pip install / scripts/setup.sh
from ext_proc.accesslog import record_completions
from ext_proc.inflight import InFlight
from tests.support.corruption import corrupt

CLUSTER, PIN = "x-inferlb-cluster", "x-gateway-destination-endpoint"

# One batch as Envoy 1.40 sent it in tests/integration/test_picker_envoy.py (captured in the picker's
# access_log): a 400 without the picker's headers (version unknown), then a chat-v1 request the picker
# pinned, answered 400 by the backend.
ENVOY_BATCH = bytes.fromhex(
    "1298060ab5020a930112110a0f12093132372e302e302e31188280021a110a0f12093132372e302e302e3118d989032a0c08a9b4bdd806"
    "10c08189df02320410edb40b5a0410f7e76762041095fb68a201110a0f12093132372e302e302e3118828002ba010410da9b69d2012430"
    "323237376335632d626230392d343530302d623337352d373933626664346661323637e801f401f0018a0288020610021a750803120468"
    "7474701a0f3132372e302e302e313a35303339332a142f76312f636861742f636f6d706c6574696f6e733216707974686f6e2d72657175"
    "657374732f322e33342e324a2430323237376335632d626230392d343530302d623337352d37393362666434666132363758fe01603078"
    "ad0122240a030890031071185d3217696e6665726c625f756e6b6e6f776e5f76657273696f6e407b0add030aec0112110a0f1209313237"
    "2e302e302e31189280021a110a0f12093132372e302e302e3118d989032a0c08a9b4bdd8061088f4d2e102320410dfbd083a0510d9ad8f"
    "0142051089d48f014a0510e6b8d001520510c4e8d7015a05108b85d701620510c3a7d8016a110a0f12093132372e302e302e3118cfd502"
    "72110a0f12093132372e302e302e3118c4cd027a07636861742d7631a201110a0f12093132372e302e302e3118928002ba010510b1c0d8"
    "01c00101d2012466383535376634362d623166632d346164642d393862332d376162616366323334393231e801e302f001e201f8018b03"
    "8002d60288020610021ac90108031204687474701a0f3132372e302e302e313a35303339332a142f76312f636861742f636f6d706c6574"
    "696f6e733216707974686f6e2d72657175657374732f322e33342e324a2466383535376634362d623166632d346164642d393862332d37"
    "616261636632333439323158e50260096a310a1e782d676174657761792d64657374696e6174696f6e2d656e64706f696e74120f313237"
    "2e302e302e313a34333732376a1c0a11782d696e6665726c622d636c75737465721207636861742d763170dc0278ac01221e0a03089003"
    "10bd011878320c7669615f757073747265616d38bc0140cf01")


def compiled(data: bytes):
    return wire.access_log(data, CLUSTER, PIN)


def reference(data: bytes):
    """The reference's answer, or DecodeError (the class) when protobuf rejects the bytes."""
    try:
        return wire.access_log_py(data, CLUSTER, PIN)
    except DecodeError:
        return DecodeError


def agree(data: bytes):
    """The compiled answer, checked: None (declined) or the reference's; None whenever protobuf rejects."""
    got, want = compiled(data), reference(data)
    assert got is None or got == want, data.hex()
    return got


def test_envoys_batch_is_decoded_by_the_compiled_decoder():
    got = compiled(ENVOY_BATCH)
    assert got == reference(ENVOY_BATCH)
    unknown, pinned = got
    assert unknown[:2] == (None, None) and unknown[-1] == 400
    cluster, pin, rid, upstream_failed, attempts, address, port, *durations, status = pinned
    assert (cluster, pin, upstream_failed, attempts, address, status) == ("chat-v1", "127.0.0.1:43727", False, 1,
                                                                          "127.0.0.1", 400)
    assert f"{address}:{port}" == pin and rid == b"f8557f46-b1fc-4add-98b3-7abacf234921"
    assert all(isinstance(ns, int) and ns > 0 for ns in durations)


def test_the_picker_uses_the_compiled_decoder_here():
    """scripts/setup.sh (pip install) builds it on this kind of machine."""
    assert wire.access_log is not None and wire.access_log.func is _wire.access_log


def test_the_field_numbers_read_are_the_descriptors():
    """The numbers the C decoder reads (ACCESS_LOG_FIELDS) are the installed protos' own."""
    pool = descriptor_pool.Default()
    assert len(_wire.ACCESS_LOG_FIELDS) == 30
    for name, number in _wire.ACCESS_LOG_FIELDS.items():
        message, field = name.rsplit(".", 1)
        assert pool.FindMessageTypeByName(message).fields_by_name[field].number == number, name


# -- generated messages ------------------------------------------------------------------------

texts = st.text(max_size=6)
envoy_seconds = st.integers(0, 10**6)  # Duration seconds as Envoy logs them (the decoder declines beyond 9e9)
header_names = st.sampled_from([CLUSTER, PIN, "x-request-id", "X-Inferlb-Cluster", "", "é"])


def _duration(ns: int) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(ns)
    return d


@st.composite
def entries(draw, seconds=envoy_seconds, http=True):
    """An HTTPAccessLogEntry (or TCPAccessLogEntry) with any of the fields read, and some of the others."""
    props = accesslog_pb2.AccessLogCommon()
    for name in ("time_to_first_upstream_tx_byte", "time_to_last_upstream_rx_byte", "time_to_last_downstream_tx_byte",
                 "time_to_first_upstream_rx_byte", "time_to_last_rx_byte", "duration"):
        if draw(st.booleans()):
            getattr(props, name).CopyFrom(duration_pb2.Duration(seconds=draw(seconds),
                                                                nanos=draw(st.integers(-999_999_999, 999_999_999))))
    for name in ("upstream_remote_address", "downstream_remote_address"):
        how = draw(st.sampled_from(["none", "socket", "named", "pipe", "empty"]))
        address = getattr(props, name)
        if how == "socket":
            address.socket_address.CopyFrom(address_pb2.SocketAddress(address=draw(texts),
                                                                      port_value=draw(st.integers(0, 2**32 - 1))))
        elif how == "named":
            address.socket_address.CopyFrom(address_pb2.SocketAddress(address=draw(texts), named_port=draw(texts)))
        elif how == "pipe":
            address.pipe.CopyFrom(address_pb2.Pipe(path=draw(texts), mode=draw(st.integers(0, 511))))
        elif how == "empty":
            address.SetInParent()
    if draw(st.booleans()):
        flags = accesslog_pb2.ResponseFlags()
        for name in ("upstream_connection_failure", "upstream_remote_reset", "upstream_connection_termination",
                     "no_healthy_upstream", "upstream_request_timeout"):
            setattr(flags, name, draw(st.booleans()))
        if draw(st.booleans()):
            flags.unauthorized_details.reason = 1
        props.response_flags.CopyFrom(flags)
    props.upstream_request_attempt_count = draw(st.integers(0, 2**32 - 1))
    props.upstream_cluster = draw(texts)
    props.sample_rate = draw(st.floats(0, 1))
    props.downstream_wire_bytes_sent = draw(st.integers(0, 2**64 - 1))
    if draw(st.booleans()):
        props.metadata.filter_metadata["f"].update({"k": draw(texts), "n": [1.5, {"deep": True}]})
    if draw(st.booleans()):
        props.filter_state_objects["s"].Pack(wrappers_pb2.StringValue(value=draw(texts)))
        props.custom_tags[draw(texts)] = draw(texts)
    if draw(st.booleans()):
        props.tls_properties.tls_sni_hostname = draw(texts)
        props.tls_properties.peer_certificate_properties.subject_alt_name.add(uri=draw(texts))
    if not http:
        entry = accesslog_pb2.TCPAccessLogEntry(common_properties=props)
        entry.connection_properties.received_bytes = draw(st.integers(0, 100))
        return entry
    entry = accesslog_pb2.HTTPAccessLogEntry(common_properties=props,
                                             protocol_version=draw(st.integers(0, 3)))
    for name, value in draw(st.lists(st.tuples(header_names, texts), max_size=4)):
        entry.request.request_headers[name] = value
    entry.request.request_id = draw(texts)
    entry.request.path = draw(texts)
    entry.request.port.value = draw(st.integers(0, 10))
    if draw(st.booleans()):
        entry.response.response_code.value = draw(st.integers(0, 2**32 - 1))
    entry.response.response_headers["a"] = draw(texts)
    entry.response.response_code_details = draw(texts)
    if draw(st.booleans()):
        entry.ClearField("common_properties")
    if draw(st.booleans()):
        entry.ClearField("request")
    return entry


@st.composite
def messages(draw, seconds=envoy_seconds):
    message = als_pb2.StreamAccessLogsMessage()
    if draw(st.booleans()):
        node = message.identifier.node
        node.id, node.cluster = draw(texts), "inferlb"
        node.user_agent_build_version.version.major_number = 1
        node.user_agent_build_version.metadata.update({"revision.sha": draw(texts)})
        node.extensions.add(name=draw(texts), category="envoy.filters.http", type_urls=[draw(texts)])
        message.identifier.log_name = draw(texts)
    if draw(st.booleans()):
        message.http_logs.log_entry.extend(draw(st.lists(entries(seconds), max_size=4)))
    elif draw(st.booleans()):
        message.tcp_logs.log_entry.extend(draw(st.lists(entries(seconds, http=False), max_size=2)))
    return message


@settings(max_examples=500, deadline=None)
@given(messages())
def test_envoys_shape_is_decoded_as_the_reference(message):
    """Any of the fields read present or absent, the others Envoy sends, several entries, TCP
    entries, an identifier with its Node: the compiled decoder takes it and decodes it as protobuf."""
    data = message.SerializeToString()
    assert agree(data) is not None
    assert len(compiled(data)) == len(message.http_logs.log_entry)


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    """One field on the wire: its tag, then (length-delimited) its length, then ``payload``."""
    out = _varint(number << 3 | wire_type)
    return out + (_varint(len(payload)) if wire_type == 2 else b"") + payload


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        out.append(v & 0x7F | (0x80 if v > 0x7F else 0))
        v >>= 7
        if not v:
            return bytes(out)


unknown_fields = st.lists(st.one_of(
    st.builds(lambda n, v: _field(n, 0, _varint(v)), st.integers(34, 2**29 - 1), st.integers(0, 2**64 - 1)),
    st.builds(lambda n, b: _field(n, 2, b), st.integers(34, 1000), st.binary(max_size=6)),
    st.builds(lambda n, b: _field(n, 1, b), st.integers(34, 1000), st.binary(min_size=8, max_size=8)),
    st.builds(lambda n, b: _field(n, 5, b), st.integers(34, 1000), st.binary(min_size=4, max_size=4)),
), max_size=2).map(b"".join)
empty_group = st.builds(lambda n: _field(n, 3, b"") + _field(n, 4, b""), st.integers(34, 1000))


def _with_unknown(draw, message) -> bytes:
    """``message`` serialized with unknown fields added to it and to each of its message fields, recursively
    (map entries keep their shape: the compiled decoder declines unknown fields there)."""
    out = bytearray()
    for field, value in message.ListFields():
        values = value if field.is_repeated else [value]
        for v in values:
            if field.message_type is None:
                out += message.__class__(**{field.name: [v] if field.is_repeated else v}).SerializeToString()
            elif field.message_type.GetOptions().map_entry:
                entry = message_factory.GetMessageClass(field.message_type)(key=v, value=value[v])
                out += _field(field.number, 2, entry.SerializeToString())
            else:
                out += _field(field.number, 2, _with_unknown(draw, v))
    return bytes(out + draw(unknown_fields))


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_unknown_fields_are_skipped_as_protobuf_skips_them(data):
    """Unknown varint, fixed and length-delimited fields at every level: taken, as protobuf takes them."""
    message = data.draw(messages())
    assert agree(_with_unknown(data.draw, message)) is not None


@settings(max_examples=200, deadline=None)
@given(messages(), empty_group, st.booleans())
def test_unknown_groups_are_left_to_protobuf(message, group, nested):
    """An unknown group (wire types 3-4, which proto3 never writes), in the message or in an entry's
    common_properties: declined, protobuf decides."""
    extra = _field(2, 2, _field(1, 2, _field(1, 2, group))) if nested else group
    assert agree(message.SerializeToString() + extra) is None


@settings(max_examples=400, deadline=None)
@given(messages(seconds=st.integers(-2**63, 2**63 - 1)), messages(), st.sampled_from(["twice", "then", "mixed"]))
def test_repeated_and_merged_parts_are_declined_or_decoded_as_the_reference(first, second, how):
    """Two messages back to back (protobuf merges them: entries add up, a TCP batch drops the HTTP
    entries before it, parts read twice merge), any Duration seconds: declined or as the reference."""
    a, b = first.SerializeToString(), second.SerializeToString()
    agree({"twice": a + a, "then": a + b, "mixed": b + a}[how])
    agree(a)


def test_fields_in_another_wire_type_or_out_of_range_are_declined_or_as_the_reference():
    base = als_pb2.StreamAccessLogsMessage()
    e = base.http_logs.log_entry.add()
    e.request.request_headers[CLUSTER] = "c"
    cases = [
        _field(2, 2, _field(1, 2, _field(1, 2, _field(24, 0, _varint(2**40))))),  # attempt count > 2^32
        _field(2, 2, _field(1, 2, _field(1, 2, _field(16, 2, _field(6, 0, _varint(2)))))),  # bool 2
        _field(2, 2, _field(1, 2, _field(1, 2, _field(15, 0, _varint(1))))),  # a string as a varint
        _field(2, 2, _field(1, 2, _field(1, 2, _field(7, 2, _field(2, 0, _varint(2**40)))))),  # nanos > int32
        _field(2, 2, _field(1, 2, _field(1, 2, _field(7, 2, _field(1, 0, _varint(10**10)))))),  # 1e10 s
        _field(2, 2, _field(1, 2, _field(3, 2, _field(13, 2, _field(1, 2, b"k") + _field(3, 0, b"\x01"))))),
        _field(2, 2, _field(1, 2, _field(3, 2, _field(9, 2, b"\xff")))),  # request_id not UTF-8
        _field(2, 2, _field(1, 2, _field(1, 2, _field(19, 2, b"\xed\xa0\x80")))),  # a surrogate, route_name
        _field(2, 2, _field(1, 2, _field(4, 2, _field(1, 2, _field(1, 0, _varint(2**33)))))),  # status > 2^32
        _field(1, 2, _field(1, 2, _field(2, 0, b"\x01"))),  # Node.cluster as a varint
        _field(2, 2, _field(1, 2, _field(2, 1, b"\x00" * 8))),  # protocol_version as fixed64
    ]
    for case in cases:
        assert agree(base.SerializeToString() + case) is None, case.hex()




@settings(max_examples=2000, deadline=None)
@given(st.data())
@example(None)
def test_corrupted_bytes_are_declined_or_decoded_as_the_reference(data):
    """Byte edits, truncations and insertions into the captured batch and generated ones: the
    compiled decoder never accepts what protobuf rejects, and never decodes differently."""
    if data is None:
        candidates = [ENVOY_BATCH[:n] for n in range(len(ENVOY_BATCH))]
    else:
        base = data.draw(st.one_of(st.just(ENVOY_BATCH), messages().map(lambda m: m.SerializeToString())))
        candidates = [corrupt(data, base)]
    for candidate in candidates:
        agree(candidate)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_are_declined_or_decoded_as_the_reference(data):
    agree(data)


def test_deep_nesting_is_left_to_protobuf():
    """A Struct nested past MAX_DEPTH in the entry's metadata: declined, protobuf decides."""
    value = {"v": 1.0}
    for _ in range(20):  # 3 levels each (Struct, its map entry, Value): past 64, within protobuf's 100
        value = {"v": value}
    message = als_pb2.StreamAccessLogsMessage()
    message.http_logs.log_entry.add().common_properties.metadata.filter_metadata["f"].update(value)
    data = message.SerializeToString()
    assert compiled(data) is None and len(reference(data)) == 1


# -- the consumer, on either path -----------------------------------------------------------------

def _batch(n: int) -> bytes:
    """n entries: pinned and unpinned, flagged, retried elsewhere, with and without timings."""
    message = als_pb2.StreamAccessLogsMessage()
    for i in range(n):
        e = message.http_logs.log_entry.add()
        e.request.request_id = f"r{i}"
        if i % 5:
            e.request.request_headers[CLUSTER] = "c"
        if i % 3:
            e.request.request_headers[PIN] = f"10.0.0.{i % 4}:80"
        props = e.common_properties
        props.upstream_remote_address.socket_address.CopyFrom(
            address_pb2.SocketAddress(address=f"10.0.0.{i % 2}", port_value=80))
        props.upstream_request_attempt_count = 1 + i % 2
        if i % 7 == 0:
            props.response_flags.upstream_connection_failure = True
        if i % 4:
            props.time_to_last_downstream_tx_byte.CopyFrom(_duration(10_000_000 + i))
            props.time_to_first_upstream_rx_byte.CopyFrom(_duration(2_000_000))
        if i % 6:
            props.time_to_first_upstream_tx_byte.CopyFrom(_duration(1_000_000))
            props.time_to_last_upstream_rx_byte.CopyFrom(_duration(9_000_000 + i))
        e.response.response_code.value = 200 if i % 8 else 503
    return message.SerializeToString()


class Record(list):
    def record(self, *args):
        self.append(("view", *args))

    def observe(self, *args):
        self.append(("cost", *args))


def _completions(monkeypatch=None) -> tuple:
    inflight = InFlight(expiry_s=1e9, clock=lambda: 1.0)
    for i in range(40):
        pin = f"10.0.0.{i % 4}:80" if i % 3 else None
        inflight.picked("c", pin, prompt_tokens=100.0, output_tokens=8.0, gpu_class="a100",
                        request_id=f"r{i}".encode())
    out = Record()
    counts = [record_completions(_batch(40), inflight, CLUSTER, PIN, out, out, lambda e, c: out.append((e, c)))
              for _ in range(2)]
    return counts, out, inflight.endpoints, inflight.clusters, inflight.requests


def test_without_the_compiled_decoder_completions_are_counted_the_same(monkeypatch):
    """record_completions on the fallback (no ``ext_proc._wire``) counts, records, costs and flags
    exactly what it does on the compiled decoder."""
    from ext_proc import accesslog

    with_c = _completions()
    assert with_c[0][0] == 40 and any(r[0] == "cost" for r in with_c[1]) and any(r[1] is True for r in with_c[1])
    monkeypatch.setattr(accesslog, "access_log", None)
    assert _completions() == with_c


def test_bytes_protobuf_rejects_are_counted_and_logged_by_the_handler(caplog):
    """Through the picker's handler: a corrupted batch is an ``access-log-decode`` error, not a crash,
    and the next good batch is counted."""
    from ext_proc.handler import PickerHandler
    from ext_proc.telemetry import ERRORS
    from ext_proc.view import ViewHolder
    from tests.unit.ext_proc.test_scheduler import view

    handler = PickerHandler(ViewHolder(view()))
    handler.control.inflight.picked("c", None, request_id=b"r1")
    bad = ENVOY_BATCH[:-3]
    assert compiled(bad) is None and reference(bad) is DecodeError
    before = ERRORS.labels("access-log-decode")._value.get()
    handler.access_log(bad)
    assert ERRORS.labels("access-log-decode")._value.get() == before + 1
    assert "StreamAccessLogsMessage could not be decoded" in caplog.text
    message = als_pb2.StreamAccessLogsMessage()
    message.http_logs.log_entry.add().request.request_headers[handler.holder.current.routing.cluster_header] = "c"
    handler.access_log(message.SerializeToString())
    assert handler.control.inflight.clusters == {}
