"""A cluster of per-request GPU servers (``RoutingTable.per_request``: each request holds its GPU memory
while it runs, no KV cache outlives it) places a ``soft`` service's requests by load, not by their
session or prefix key: a key finds no cache there, and a second request on a busy endpoint slows both
(the seed's 50 / 95 ms at 1 / 2 running). Found in the lab's ``uneven`` scenario: sessions kept on
their pins put 35 % of the requests beside another one while endpoints were idle (e2e p95 474 ms
against round robin's 332)."""

from __future__ import annotations

from dataclasses import replace

from ext_proc.body import BodyFields
from ext_proc.handler import PickerHandler
from ext_proc.inflight import MemorySamples
from ext_proc.picker import pick
from ext_proc.settings import from_wire, to_wire
from ext_proc.transport.base import StreamState
from ext_proc.view import ServiceRoute, ViewHolder
from inferlb.picker_config import picker_settings, routing_table
from tests.support.factories import config, service, version
from tests.unit.ext_proc.test_scheduler import FOUR, ROUTING, _endpoint, _headers_msg, headers, view

PER_REQUEST = replace(ROUTING, per_request=frozenset({"c"}))
STRICT = replace(PER_REQUEST, services=(ServiceRoute("llm", ("*",), "v1", {"v1": "c"}, affinity="strict"),))


def turns(routing, n: int = 3, samples: dict[str, tuple[float, float]] | None = None) -> list[str]:
    """The endpoints of one session's ``n`` requests sent back to back (none finished)."""
    handler = PickerHandler(ViewHolder(view(routing=routing)))
    if samples is not None:
        handler.control.set_samples(MemorySamples.of(samples))
    return [_endpoint(handler.process(StreamState(), _headers_msg(x_session_id=b"s-1"))[0]) for _ in range(n)]


def test_a_soft_session_on_per_request_servers_goes_to_the_least_loaded_endpoint():
    # A cluster the picker knows nothing of keeps a session on its pin up to the bound's floor (2 requests).
    assert len(set(turns(ROUTING, 2))) == 1
    assert len(set(turns(PER_REQUEST, 4))) == 4, "per-request servers: each request to an idle endpoint"


def test_memory_admission_still_decides_among_the_idle_endpoints():
    # Two endpoints lack the memory for a request (2048 MiB + 20 %): the session's requests go to the others.
    samples = {e: (24576.0, 0.0) for e in FOUR} | {FOUR[0]: (1000.0, 0.0), FOUR[1]: (1000.0, 0.0)}
    assert set(turns(PER_REQUEST, 2, samples)) == {FOUR[2], FOUR[3]}


def test_a_strict_session_on_per_request_servers_keeps_its_pin():
    assert len(set(turns(STRICT, 4))) == 1


def test_a_prompt_prefix_is_no_key_on_per_request_servers():
    body = BodyFields(prefix=12345, prompt_tokens=100.0, blocks=(1, 2, 3))
    keyed = pick(headers(), view(routing=ROUTING), body=body)
    assert (keyed.key, keyed.blocks) == ("prefix", (1, 2, 3))
    placed = pick(headers(), view(routing=PER_REQUEST), body=body)
    assert (placed.key, placed.blocks, placed.session) == ("none", (), None)


def test_the_per_request_clusters_reach_the_picker_and_survive_the_wire():
    cfg = config([service("llm", [version("v1", 1), {**version("v2", 1), "gpu_memory": "per_request"}])])
    routing = routing_table(cfg)
    assert routing.per_request == frozenset({"llm-v2"})
    back, _ = from_wire(to_wire(routing, picker_settings(cfg)))
    assert back.per_request == frozenset({"llm-v2"})
    assert routing_table(config(metrics={"preset": "triton"})).per_request == frozenset({"llm-v1"})
