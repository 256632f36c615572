"""free_port: each pytest-xdist worker draws from its own share of the ports."""

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
    assert {p % 2 for p in drawn["gw0"]} == {0} and {p % 2 for p in drawn["gw1"]} == {1}
    assert not drawn["gw0"] & drawn["gw1"]
