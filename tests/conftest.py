"""How the suite is split over pytest-xdist workers (``-n 2 --dist loadgroup`` in pyproject.toml).

Each test module is one group, so a module-scoped stack (real Envoy, Prometheus, backends) starts
once, on one worker. Two groups span modules:

- ``faults``: every module of tests/faults shares one package-scoped fault stack;
- ``heavy``: the runs of whole benchmarks and of the demo (quality bench, soak, the wheel's demo,
  the demo without traffic).
  They burn both cores for minutes and the demo and soak bind the demo's fixed ports (10000,
  18000, ...), so they run one after another on one worker while the other worker takes the
  lighter modules.

With ``-n 0`` (one process) the markers do nothing and the suite runs in order. (``-p no:xdist``
would fail: the addopts pass ``-n``.)
"""

from __future__ import annotations

import os

import pytest

HEAVY = frozenset({
    "tests/integration/test_bench_quality_directions.py",
    "tests/integration/test_bench_quality_smoke.py",
    "tests/integration/test_bench_soak.py",
    "tests/integration/test_demo_outside_client.py",
    "tests/integration/test_wheel.py",
})


def group_of(path: str) -> str:
    """The xdist group of the test module at ``path`` (relative, ``/``-separated)."""
    if path.startswith("tests/faults/"):
        return "faults"
    if path in HEAVY:
        return "heavy"
    return path


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the markers into the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = config.rootpath
    for item in items:
        path = item.path.relative_to(root).as_posix()
        item.add_marker(pytest.mark.xdist_group(group_of(path)))


def pytest_collection_finish(session: pytest.Session) -> None:
    """On an xdist worker, refuse to run if the groups did not reach the node ids (pytest 9 with
    pytest-xdist 3.8: each test became its own scope, and modules' stacks started on both workers)."""
    if os.environ.get("PYTEST_XDIST_WORKER") and session.config.getvalue("dist") == "loadgroup":
        lost = [item.nodeid for item in session.items if "@" not in item.nodeid]
        if lost:
            raise pytest.UsageError(f"--dist loadgroup: {len(lost)} tests have no group in their node id "
                                    f"(e.g. {lost[0]}); check the pytest / pytest-xdist versions")
