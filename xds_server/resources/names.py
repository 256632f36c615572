"""Names and small helpers every xDS resource builder shares."""

from __future__ import annotations

LISTENER_NAME = "inferlb"
ROUTE_NAME = "inferlb"
#: The picker's own cluster (ext_proc and the access-log stream go to it).
EXT_PROC_CLUSTER = "inferlb_ext_proc"
#: Prefix of every ``@type`` in the JSON forms the builders parse.
TYPE_PREFIX = "type.googleapis.com/"
#: A config source that points at the ADS stream.
ADS_SOURCE = {"ads": {}, "resource_api_version": "V3"}


def seconds(s: float) -> str:
    """A protobuf JSON duration for ``s`` seconds (``"1.500s"``)."""
    return f"{s:.3f}s"
