"""A cluster whose engines hold a preallocated KV-cache pool: its requests need no GPU memory of their
own, so the picker's memory admission never decides them and the GPU memory samples (~10 % free on
vLLM whatever runs) cannot move a pick."""

from __future__ import annotations

from dataclasses import replace

from ext_proc.handler import PickerHandler
from ext_proc.inflight import MemorySamples
from ext_proc.picker import pick
from ext_proc.settings import from_wire, to_wire
from ext_proc.transport.base import StreamState
from ext_proc.view import ViewHolder
from inferlb.picker_config import picker_settings, routing_table
from tests.support.factories import config, service, version
from tests.unit.ext_proc.test_scheduler import FOUR, ROUTING, _endpoint, _headers_msg, headers, view

POOL = replace(ROUTING, preallocated=frozenset({"c"}))
KEYS = [f"s-{i}".encode() for i in range(12)]
#: Free GPU memory samples as an A100 with vLLM shows them (8 192 MiB), one endpoint nearly empty.
SAMPLES = {e: (8192.0, 0.0) for e in FOUR} | {FOUR[0]: (100.0, 0.0)}


def pins(routing, samples=None) -> list[str]:
    handler = PickerHandler(ViewHolder(view(routing=routing)))
    if samples is not None:
        handler.control.set_samples(MemorySamples.of(samples))
    return [_endpoint(handler.process(StreamState(), _headers_msg(x_session_id=k))[0]) for k in KEYS]


def test_a_request_to_a_kv_pool_cluster_needs_no_gpu_memory():
    assert pick(headers(x_session_id=b"a"), view(routing=POOL)).mib == 0.0
    assert pick(headers(x_session_id=b"a"), view(routing=ROUTING)).mib == ROUTING.default_request_mib


def test_memory_samples_do_not_move_the_picks_of_a_kv_pool_cluster():
    unsampled = pins(POOL)
    assert pins(POOL, SAMPLES) == unsampled
    assert FOUR[0] in unsampled  # a key the nearly empty endpoint owns keeps it
    # per-request servers with the same samples: the 100 MiB endpoint takes none of them
    per_request = pins(ROUTING, SAMPLES)
    assert FOUR[0] not in per_request and per_request != unsampled


def test_the_clusters_that_preallocate_reach_the_picker_and_survive_the_wire():
    cfg = config([service("llm", [version("v1", 1), {**version("v2", 1), "gpu_memory": "per_request"}])])
    routing = routing_table(cfg)
    assert routing.preallocated == frozenset({"llm-v1"})
    back, _ = from_wire(to_wire(routing, picker_settings(cfg)))
    assert back.preallocated == frozenset({"llm-v1"})
    assert routing_table(config(metrics={"preset": "triton"})).preallocated == frozenset()
