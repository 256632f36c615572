"""Strict session affinity on real Envoy (issue 37): a session's endpoint holding requests far over its
load bound keeps every turn of the session, while a new session is placed elsewhere by load.

One stack: three v1 backends (simulated llm engines), the default contract (``strict``), the in-process
picker. The session's endpoint holds its requests (the simulator's ``hang`` fault) until the test lets
them go, so they stay in flight however slowly this machine runs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import requests

from ext_proc.scheduling.affinity import STRICT_PLUGIN
from ext_proc.telemetry import OUTCOMES
from tests.integration.conftest import Stack, start_stack, stop_stack, wait_until

pytestmark = pytest.mark.integration

HELD = 4  # turns of the session held in flight on its endpoint before the checked ones
TURNS = 4  # turns sent while those are held


@pytest.fixture(scope="module")
def strict_stack(tmp_path_factory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("affinity"), [("v1", "a100")] * 3)
    yield s
    stop_stack(s)


def send(s: Stack, session: str | None = None, timeout: float = 30) -> requests.Response:
    headers = {"x-session-id": session} if session else {}
    return requests.post(f"{s.listener}/v1/chat/completions", json={"max_tokens": 8, "messages": []},
                         headers=headers, timeout=timeout)


def hung(s: Stack, address: str) -> int:
    return requests.get(f"http://{address}/sim/state", timeout=5).json()["hung"]


def test_a_loaded_pinned_endpoint_keeps_every_turn_of_a_strict_session(strict_stack: Stack):
    s = strict_stack
    assert s.cfg.services[0].session_affinity == "strict"  # the default
    first = send(s, "conv-1")
    assert first.status_code == 200, first.text
    home = first.headers["x-served-by"]
    [held] = [b for b in s.backends if b.address == home]
    strict_before = OUTCOMES.get(("affinity", STRICT_PLUGIN), 0)
    held.fault(hang=True)
    answers: list[requests.Response] = []
    threads: list[threading.Thread] = []

    def turn() -> None:
        t = threading.Thread(target=lambda: answers.append(send(s, "conv-1")))
        t.start()
        threads.append(t)

    try:
        for _ in range(HELD):
            turn()
        wait_until(lambda: hung(s, home) == HELD, 15, what=f"{HELD} turns held on the session's endpoint")
        # 4 of 4 requests in flight on one of three endpoints: over the soft contract's bound for a pin
        # (bounded-load: pinned_load_factor 2 x (4 + 1) / 3 = 3.3), where a soft session's turn spills.
        # A request of a new session goes where the load is not: the picker sees the load.
        other = send(s, "conv-2")
        assert other.status_code == 200 and other.headers["x-served-by"] != home
        for _ in range(TURNS):
            turn()
        wait_until(lambda: hung(s, home) == HELD + TURNS, 15, what="every later turn held there too")
    finally:
        held.fault(reset=True)
        for t in threads:
            t.join(30)
    assert [r.status_code for r in answers] == [200] * (HELD + TURNS)
    assert {r.headers["x-served-by"] for r in answers} == {home}
    assert OUTCOMES.get(("affinity", STRICT_PLUGIN), 0) >= strict_before + HELD + TURNS
