"""The picker's hot messages decoded straight from their bytes: Envoy's request headers and request
body (``ProcessingRequest``) and its access-log batches (``StreamAccessLogsMessage``).

:data:`request_headers` is the compiled decoder ``ext_proc._wire`` (``ext_proc/_wire.c``, built
by ``pip install``; optional: without a C compiler the package installs without it), or None when
it is not built: the picker then parses every message with protobuf, once. The compiled one
accepts only the fields Envoy sends with request headers and returns None for anything else (the
caller then parses with protobuf); whatever it accepts, it decodes as :func:`request_headers_py`
(protobuf's parse and :func:`~ext_proc.responses.headers_of`, the picker's own path) does:
``tests/unit/ext_proc/test_wire.py`` compares the two on generated, captured and corrupted
messages. One captured Envoy message: 7.1 µs through protobuf, 1.8 µs compiled (``timeit``,
BENCHMARKS.md, issue 14 second pass).

:data:`request_body` is the compiled decoder of a ``request_body`` message, or None when not built (then
protobuf parses it, :func:`request_body_py`): ``(body, end_of_stream)`` of Envoy's shape (the
``HttpBody``'s ``body`` and ``end_of_stream``, an empty ``metadata_context``, ``observability_mode``,
``protocol_config``); anything else is None (the caller parses with protobuf).
``tests/unit/ext_proc/test_wire.py`` compares it with :func:`request_body_py` on generated and
corrupted messages. A 20 KiB body: 1.4 µs compiled, 5.1 µs through protobuf (timeit best of 7 on a machine at
load 8 from other jobs, 2026-12-07).

:data:`access_log` is the compiled access-log decoder, or None when not built (then
:func:`access_log_py`, protobuf's parse and the reads :func:`~ext_proc.accesslog.record_completions`
made before, is the decoder): per HTTP entry, the flat :data:`Completion` tuple of what the picker
reads. The compiled one checks every field of the message as protobuf does, by a schema built here
from the installed descriptors (:func:`_schema`), returns None for what it does not decode exactly as
protobuf would (the caller then parses with protobuf, which also raises on invalid bytes), and
otherwise returns what :func:`access_log_py` does: ``tests/unit/ext_proc/test_wire_access_log.py``
compares the two on generated, captured and corrupted messages. The field numbers it reads are listed in
``ext_proc/_wire.c`` (``ACCESS_LOG_FIELDS``, checked against the descriptors by the tests). One
captured batch of 16 Envoy entries: 95 µs through :func:`access_log_py`, 14 µs compiled (medians of
5 rounds, BENCHMARKS.md, issue 14 third pass).

:data:`DECODER` names the one in use (the transports log it when they start).
"""

from __future__ import annotations

from functools import partial

from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError

from ext_proc.responses import headers_of

__all__ = ["DECODER", "Completion", "access_log", "access_log_py", "request_body", "request_body_py", "request_headers",
           "request_headers_py"]

Completion = tuple[str | None, str | None, bytes, bool, int, str, int, int | None, int | None, int | None, int | None,
                   int]
"""One HTTP entry of a ``StreamAccessLogsMessage`` (``envoy.data.accesslog.v3.HTTPAccessLogEntry``), flat:
``(cluster, pin, request_id, upstream_failed, attempts, upstream_address, upstream_port,
first_upstream_tx_ns, last_upstream_rx_ns, last_downstream_tx_ns, first_upstream_rx_ns, response_code)``:

- ``cluster``, ``pin``: the logged ``request.request_headers`` values of the cluster and override-host
  headers (None: not logged);
- ``request_id``: ``request.request_id``, UTF-8 (b"" when none);
- ``upstream_failed``: ``common_properties.response_flags`` has ``upstream_connection_failure``,
  ``upstream_remote_reset`` or ``upstream_connection_termination``;
- ``attempts``: ``common_properties.upstream_request_attempt_count`` (0 when not logged);
- ``upstream_address``, ``upstream_port``: ``common_properties.upstream_remote_address.socket_address``
  ``address`` and ``port_value`` ("" and 0 when none);
- the four ``common_properties`` Durations ``time_to_first_upstream_tx_byte``,
  ``time_to_last_upstream_rx_byte``, ``time_to_last_downstream_tx_byte``,
  ``time_to_first_upstream_rx_byte``, in ns from the request's start (None: not logged);
- ``response_code``: ``response.response_code.value`` (0 when none was sent).
"""


def request_headers_py(data: bytes) -> tuple[dict[str, bytes], bool] | None:
    """``(headers as headers_of gives them, HttpHeaders.end_of_stream)`` of a serialized
    ``ProcessingRequest`` whose phase is ``request_headers``; None for another phase or bytes that
    do not decode."""
    try:
        request = pb.ProcessingRequest.FromString(data)
    except DecodeError:
        return None
    if request.WhichOneof("request") != "request_headers":
        return None
    http_headers = request.request_headers
    return headers_of(http_headers), http_headers.end_of_stream


def request_body_py(data: bytes) -> tuple[bytes, bool] | None:
    """``(HttpBody.body, HttpBody.end_of_stream)`` of a serialized ``ProcessingRequest`` whose phase is
    ``request_body``; None for another phase or bytes that do not decode."""
    try:
        request = pb.ProcessingRequest.FromString(data)
    except DecodeError:
        return None
    if request.WhichOneof("request") != "request_body":
        return None
    chunk = request.request_body
    return chunk.body, chunk.end_of_stream


def access_log_py(data: bytes, cluster_header: str, override_host_header: str) -> list[Completion]:
    """The :data:`Completion` of each HTTP entry of a serialized ``StreamAccessLogsMessage``, in order
    (none for TCP entries), the entries' request headers looked up by these lower-case names.

    Raises:
        google.protobuf.message.DecodeError: ``data`` is not a ``StreamAccessLogsMessage``.
    """
    message = als_pb2.StreamAccessLogsMessage.FromString(data)
    out = []
    for entry in message.http_logs.log_entry:
        request, props = entry.request, entry.common_properties
        logged = request.request_headers
        flags = props.response_flags
        upstream = props.upstream_remote_address.socket_address
        out.append((logged.get(cluster_header), logged.get(override_host_header), request.request_id.encode(),
                    bool(flags.upstream_connection_failure or flags.upstream_remote_reset
                         or flags.upstream_connection_termination),
                    props.upstream_request_attempt_count, upstream.address, upstream.port_value,
                    *(getattr(props, name).ToNanoseconds() if props.HasField(name) else None for name in _DURATIONS),
                    entry.response.response_code.value))
    return out


_DURATIONS = ("time_to_first_upstream_tx_byte", "time_to_last_upstream_rx_byte", "time_to_last_downstream_tx_byte",
              "time_to_first_upstream_rx_byte")


def _schema(compiled) -> list[list[tuple[int, int, int]]]:
    """What the compiled access-log decoder (the module ``compiled``) checks each message against, from
    the installed descriptors: the messages it reads itself (``ACCESS_LOG_MESSAGES``, in its order),
    then every message reachable from them; per message, ``(field number, kind, index of the field's
    message or 0)``, kinds as the module names them."""
    kinds = {FieldDescriptor.TYPE_DOUBLE: compiled.K_FIXED64, FieldDescriptor.TYPE_FIXED64: compiled.K_FIXED64,
             FieldDescriptor.TYPE_SFIXED64: compiled.K_FIXED64, FieldDescriptor.TYPE_FLOAT: compiled.K_FIXED32,
             FieldDescriptor.TYPE_FIXED32: compiled.K_FIXED32, FieldDescriptor.TYPE_SFIXED32: compiled.K_FIXED32,
             FieldDescriptor.TYPE_STRING: compiled.K_STRING, FieldDescriptor.TYPE_BYTES: compiled.K_BYTES,
             FieldDescriptor.TYPE_MESSAGE: compiled.K_MESSAGE, FieldDescriptor.TYPE_GROUP: compiled.K_DECLINE}
    pool = descriptor_pool.Default()
    order = [pool.FindMessageTypeByName(name) for name in compiled.ACCESS_LOG_MESSAGES]
    index = {d.full_name: i for i, d in enumerate(order)}
    schema = []
    for d in order:  # grows while walked
        fields = []
        for f in d.fields:
            kind = kinds.get(f.type, compiled.K_VARINT)  # the rest are varints: (s/u)int32/64, bool, enum
            sub = 0
            if kind == compiled.K_MESSAGE:
                sub = index.setdefault(f.message_type.full_name, len(order))
                if sub == len(order):
                    order.append(f.message_type)
            fields.append((f.number, kind, sub))
        schema.append(fields)
    return schema


try:
    from ext_proc import _wire
except ImportError as err:  # not built (no C compiler where the package was installed)
    request_headers = request_body = access_log = None
    DECODER = f"pure Python (ext_proc._wire not built: {err})"
else:
    request_headers = _wire.request_headers
    # None from a build of _wire.c older than its body decoder (rebuild: pip install -e . / scripts/setup.sh).
    request_body = getattr(_wire, "request_body", None)
    access_log = partial(_wire.access_log, _wire.access_log_schema(_schema(_wire)))
    DECODER = "compiled (ext_proc._wire)"
