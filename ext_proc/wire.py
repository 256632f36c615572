"""A request-headers ``ProcessingRequest`` decoded straight from its bytes: the picker's hot decode.

:data:`request_headers` is the compiled decoder ``ext_proc._wire`` (``ext_proc/_wire.c``, built
by ``pip install``; optional: without a C compiler the package installs without it), or None when
it is not built: the picker then parses every message with protobuf, once. The compiled one
accepts only the fields Envoy sends with request headers and returns None for anything else (the
caller then parses with protobuf); whatever it accepts, it decodes as :func:`request_headers_py`
(protobuf's parse and :func:`~ext_proc.responses.headers_of`, the picker's own path) does:
``tests/unit/ext_proc/test_wire.py`` compares the two on generated, captured and corrupted
messages. One captured Envoy message: 7.1 µs through protobuf, 1.8 µs compiled (``timeit``,
BENCHMARKS.md, issue 14 second pass).

:data:`DECODER` names the one in use (the transports log it when they start).
"""

from __future__ import annotations

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.message import DecodeError

from ext_proc.responses import headers_of

__all__ = ["DECODER", "request_headers", "request_headers_py"]


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


try:
    from ext_proc._wire import request_headers
except ImportError as err:  # not built (no C compiler where the package was installed)
    request_headers = None
    DECODER = f"pure Python (ext_proc._wire not built: {err})"
else:
    DECODER = "compiled (ext_proc._wire)"
