"""inferlb's own gRPC APIs, compiled from the ``.proto`` files in this folder at import time.

Build choice: no generated code is kept in git. ``grpc.protos_and_services`` (grpcio-tools, a
dependency) compiles ``inferlb/v1/*.proto`` in memory the first time this package is imported, so
the generated classes can never drift from the ``.proto`` source. Import the modules from here::

    from protos import node_status_pb2, node_status_pb2_grpc
    from protos import load_view_pb2, load_view_pb2_grpc

The proto package is ``inferlb.v1``; the generated modules are registered as
``protos.inferlb.v1.<name>_pb2`` in ``sys.modules`` (compiled from the folder that holds this
package, so their names never collide with the ``inferlb`` application package). A ``.proto`` that
imports another names it from there too: ``import "protos/inferlb/v1/x.proto"``.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from types import ModuleType

import grpc

_ROOT = str(Path(__file__).resolve().parent.parent)
_LOCK = threading.Lock()


def load(proto: str) -> tuple[ModuleType, ModuleType]:
    """``(messages, services)`` modules of ``proto`` (a path under this folder, e.g. ``inferlb/v1/x.proto``).

    Raises:
        TypeError/ImportError: the ``.proto`` is missing or does not compile (protoc's message).
    """
    with _LOCK:
        added = _ROOT not in sys.path
        if added:
            sys.path.append(_ROOT)
        try:
            return grpc.protos_and_services(f"protos/{proto}")
        finally:
            if added:
                sys.path.remove(_ROOT)


node_status_pb2, node_status_pb2_grpc = load("inferlb/v1/node_status.proto")
load_view_pb2, load_view_pb2_grpc = load("inferlb/v1/load_view.proto")
