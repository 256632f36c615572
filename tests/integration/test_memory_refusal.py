"""Issue 15 item 4 on real Envoy: requests no endpoint could ever hold get the picker's 503 saying why.

Before, with the default settings (``picker.memory_queue`` off), each such request was pinned to
the endpoint with the most free memory and failed there (500 ``oom``); those failures took the
endpoints out of the cluster. Now the picker refuses them itself, the backends never see them, and
the endpoints stay in.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.integration.conftest import Stack, start_stack, stop_stack, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def memory_stack(tmp_path_factory) -> Iterator[Stack]:
    """Two A100-class per-request servers (``--engine job``, 81 920 MiB each); requests give their need
    in ``x-sim-memory-mib``."""
    s = start_stack(tmp_path_factory.mktemp("memory"), [("v1", "a100"), ("v1", "a100")], ["--engine", "job"],
                    config={"picker": {"request_memory_header": "x-sim-memory-mib"}})
    yield s
    stop_stack(s)


def _oom_total(s: Stack) -> float:
    total = 0.0
    for b in s.backends:
        for line in requests.get(f"http://{b.address}/metrics", timeout=5).text.splitlines():
            if line.startswith("inferlb_sim_oom_total "):
                total += float(line.split()[-1])
    return total


def test_forty_requests_larger_than_any_endpoint_get_503_from_the_picker_and_no_endpoint_drops_out(
        memory_stack: Stack):
    s = memory_stack
    wait_until(lambda: s.app.picker.control.largest_memory.get("chat-v1") == 81920, 15,
               what="the endpoints' GPU memory in the picker")
    before = _oom_total(s)

    def send(_):
        return requests.post(f"{s.listener}/v1/chat/completions", json={"max_tokens": 8, "messages": []},
                             headers={"x-sim-memory-mib": "200000", "model-version": "v1"}, timeout=30)

    with ThreadPoolExecutor(40) as pool:
        answers = list(pool.map(send, range(40)))
    assert Counter(r.status_code for r in answers) == {503: 40}
    message = json.loads(answers[0].text)["error"]["message"]
    assert "no endpoint with 200000 MiB of GPU memory" in message and "81920 MiB" in message
    assert "retry-after" not in answers[0].headers
    assert _oom_total(s) == before
    ok = requests.post(f"{s.listener}/v1/chat/completions", json={"max_tokens": 8, "messages": []},
                       headers={"model-version": "v1"}, timeout=30)
    assert ok.status_code == 200
    health = {address: e["health"] for c in s.weights().values() for address, e in c.items()}
    assert set(health.values()) == {"HEALTHY"} and len(health) == 2, health
