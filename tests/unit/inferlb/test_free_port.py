"""free_port: each pytest-xdist worker draws from its own block of the ports; offsets are reserved with the port."""

import pytest

from inferlb.devstack import stack


@pytest.mark.parametrize("worker, count, share", [("gw0", "2", (0, 2)), ("gw1", "2", (1, 2)), ("gw3", "4", (3, 4)),
                                                  ("", "", (0, 1)), ("gw2", "2", (0, 1)), ("master", "2", (0, 1))])
def test_worker_share_from_xdist_environment(monkeypatch, worker, count, share):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", count)
    assert stack._worker_share() == share


def test_two_workers_never_draw_the_same_port(monkeypatch):
    drawn = {}
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
        monkeypatch.setattr(stack, "_handed_out", set())
        drawn[worker] = {stack.free_port() for _ in range(50)}
    half = stack.FREE_PORTS.start + len(stack.FREE_PORTS) // 2
    assert max(drawn["gw0"]) < half <= min(drawn["gw1"])
    assert not drawn["gw0"] & drawn["gw1"]


def test_a_port_drawn_with_an_offset_reserves_both(monkeypatch):
    """A backend's publisher port (its own + 1000) is never handed out to the next draw: the whole block is
    drawn after it, and neither the port nor its offset comes back."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    monkeypatch.setattr(stack, "_handed_out", set())
    first = stack.free_port((1000,))
    block = range(stack.FREE_PORTS.start + 3000, stack.FREE_PORTS.start + 6000)
    assert first in block and first + 1000 in block
    rest = set()
    with pytest.raises(stack.StackError, match="no free TCP port"):
        while True:
            rest.add(stack.free_port())
    assert not {first, first + 1000} & rest
    assert len(rest) > 2900
