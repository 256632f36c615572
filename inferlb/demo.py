"""``inferlb demo``: the main job on embedded defaults, every part a real process on this machine.

Simulated GPU backends (A100- and A10-class, versions v1 and v2) -> Prometheus scraping every
second -> ``inferlb serve`` (xDS + ext_proc + admin, a child process) -> Envoy. Drives chat
traffic with session and version headers through the ``openai`` client (80 % streamed, a shared
system prompt), shows the live weights, writes a summary, and ends by
plotting the weight history to ``<workdir>/weight-history.png``. With ``--traffic none`` it drives
nothing: the stack serves any outside client (an OpenAI client, a benchmark tool) until Ctrl-C or
SIGTERM, and prints how to reach it (:func:`serve_outside_clients`).

Metrics source (``--metrics-source``): ``prometheus`` (with the scrape source as fallback),
``scrape`` (no Prometheus: the control plane scrapes the backends itself), or ``auto`` (default):
Prometheus when its binary is installed, else scrape. The summary's ``metrics_source`` says which
source answered, ``metrics_source_ok`` whether it was answering at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from inferlb.devstack import stack
from inferlb.devstack.envoy_admin import envoy_hosts
from inferlb.devstack.loadgen import DEMO_SYSTEM_PROMPT, MODEL_NAME, Traffic, drive, make_sessions
from inferlb.output import (
    AFFINITY_TEXT,
    WEIGHT_COLUMNS,
    demo_summary_text,
    plot_history,
    weights_rich_table,
    weights_table,
)
from xds_server.config import Config, load_config
from xds_server.resources.bootstrap import render_bootstrap

ENVOY_LISTENER, ENVOY_ADMIN, PROMETHEUS_PORT = 10000, 9901, 9090
XDS_PORT, EXT_PROC_PORT, ADMIN_PORT = 18000, 18080, 18090
#: (version, GPU class) of each simulated backend.
BACKENDS = (("v1", "a100"), ("v1", "a100"), ("v1", "a10"), ("v2", "a100"), ("v2", "a10"))


def demo_config(backends: list[tuple[str, str, int]], metrics_source: str = "prometheus",
                history_path: str = ":memory:") -> dict:
    """The demo's inferlb config (as a dict) for ``[(version, gpu_class, port)]``.

    ``metrics_source``: ``prometheus`` (scrape as fallback) or ``scrape``; the weight history is
    kept in ``history_path``.
    """
    versions: dict[str, list[dict]] = {}
    for version, gpu, port in backends:
        versions.setdefault(version, []).append(
            {"address": f"127.0.0.1:{port}", "gpu_class": gpu, "max_concurrency": 8})
    return {
        "listen": {"xds": f"127.0.0.1:{XDS_PORT}", "ext_proc": f"127.0.0.1:{EXT_PROC_PORT}",
                   "admin": f"127.0.0.1:{ADMIN_PORT}"},
        "envoy": {"listener": f"127.0.0.1:{ENVOY_LISTENER}"},
        "loop": {"interval_s": 1, "timeout_s": 1},
        "prometheus": {"url": f"http://127.0.0.1:{PROMETHEUS_PORT}", "window_s": 10},
        "engine": {"stale_after_s": 15},
        "history": {"path": history_path},
        "metrics": ({"sources": ["prometheus"], "fallback": "scrape"} if metrics_source == "prometheus"
                    else {"sources": ["scrape"]}),
        "services": [{
            "name": "chat",
            "default_version": "v1",
            "models": [MODEL_NAME],   # what OpenAI clients send in "model": the default version
            "versions": [{"name": v, "endpoints": eps} for v, eps in versions.items()],
        }],
    }


@dataclass
class DemoStack:
    """The demo's running stack: ``procs`` by name (``sim-PORT``, ``prometheus``, ``inferlb``,
    ``envoy``), the backends as ``[(version, gpu_class, port)]``, the config (its path and as
    loaded) and the admin base URLs."""

    procs: dict[str, stack.Proc]
    backends: list[tuple[str, str, int]]
    cfg_path: Path
    cfg: Config
    admin: str = f"http://127.0.0.1:{ADMIN_PORT}"
    envoy_admin: str = f"http://127.0.0.1:{ENVOY_ADMIN}"
    sim_args: tuple[str, ...] = ()

    def restart_sim(self, port: int) -> stack.Proc:
        """Start the backend on ``port`` again (after it was stopped or killed), same class, version and options."""
        version, gpu = next((v, g) for v, g, p in self.backends if p == port)
        proc = stack.start_sim(port, self.cfg_path.parent, gpu_class=gpu, version=version, extra=list(self.sim_args))
        self.procs[proc.name] = proc
        return proc

    def restart_control_plane(self) -> stack.Proc:
        """Stop ``inferlb serve`` (SIGTERM, its shutdown grace) and start it again; ready once ``/readyz`` answers."""
        self.procs["inferlb"].stop(timeout=15)
        proc = self.procs["inferlb"] = stack.start_control_plane(self.cfg_path, self.cfg_path.parent, ADMIN_PORT)
        stack.wait_http(f"{self.admin}/readyz", proc)
        return proc


def start_stack(work: Path, source: str, xds_protocol: str = "sotw", started: list[stack.Proc] | None = None,
                tokenizer: str | None = None) -> DemoStack:
    """Start the demo's processes in ``work``: the simulated backends (:data:`BACKENDS`, free ports),
    Prometheus (when ``source`` is ``prometheus``), ``inferlb serve`` and Envoy (``xds_protocol``
    sotw or delta), each ready before the next starts, on the demo's fixed ports. ``tokenizer``: a
    Hugging Face tokenizer directory the backends count tokens with (``sim-backend --tokenizer``).

    Each process is appended to ``started`` as soon as it runs, so the caller can stop them all
    even when a later one fails.

    Raises:
        stack.StackError: a port is taken, or a process did not start or become ready.
    """
    ports = [ENVOY_LISTENER, ENVOY_ADMIN, XDS_PORT, EXT_PROC_PORT, ADMIN_PORT]
    _check_ports(ports + ([PROMETHEUS_PORT] if source == "prometheus" else []))
    procs = started if started is not None else []
    backends = [(v, g, stack.free_port()) for v, g in BACKENDS]
    sim_args = ("--tokenizer", tokenizer) if tokenizer else ()
    for version, gpu, port in backends:
        procs.append(stack.start_sim(port, work, gpu_class=gpu, version=version, extra=list(sim_args)))
    if source == "prometheus":
        procs.append(stack.start_prometheus([f"127.0.0.1:{p}" for _, _, p in backends], work,
                                            PROMETHEUS_PORT, scrape_interval_s=1.0))
    cfg_path = work / "inferlb.yaml"
    cfg_path.write_text(yaml.safe_dump(demo_config(backends, source, str(work / "history.sqlite3")),
                                       sort_keys=False))
    cfg = load_config(cfg_path)
    cp = stack.start_control_plane(cfg_path, work, ADMIN_PORT)
    procs.append(cp)
    demo = DemoStack({}, backends, cfg_path, cfg, sim_args=sim_args)
    stack.wait_http(f"{demo.admin}/readyz", cp)
    procs.append(stack.start_envoy(
        render_bootstrap(xds_address=cfg.listen.xds, node_id="inferlb-demo", admin_port=ENVOY_ADMIN,
                         delta=xds_protocol == "delta"),
        work, ENVOY_ADMIN))
    stack.wait_http(f"{demo.envoy_admin}/ready", procs[-1])
    demo.procs = {p.name: p for p in procs}
    return demo


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


def _check_ports(ports: list[int]) -> None:
    import socket

    for p in ports:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", p)) == 0:
                raise stack.StackError(f"port {p} on 127.0.0.1 is already in use; stop what holds it")


def _compare_weights(cp_doc: dict, envoy: dict) -> dict:
    out: dict[str, dict[str, dict]] = {}
    for c in cp_doc["clusters"]:
        out[c["name"]] = {
            e["address"]: {"control_plane": e["weight"],
                           "envoy": envoy.get(c["name"], {}).get(e["address"], {}).get("weight")}
            for e in c["endpoints"]
        }
    return out


def _settled_weights(admin: str, envoy_admin: str, tries: int = 30) -> dict:
    """Control-plane and Envoy weights read at one moment, retried until they agree (or tries run out)."""
    weights: dict = {}
    for _ in range(tries):
        weights = _compare_weights(_get_json(f"{admin}/api/v1/weights"), envoy_hosts(envoy_admin))
        if all(v["control_plane"] == v["envoy"] for c in weights.values() for v in c.values()):
            break
        time.sleep(0.2)
    return weights


def health_changes(history: dict) -> list[dict]:
    """Every change of an endpoint's health in a weight-history document (``GET /api/v1/history``):
    ``[{"t", "cluster", "endpoint", "health", "reason"}]`` oldest first, ``reason`` the first of the
    point's reasons ("" without). An endpoint's first point counts when it is not HEALTHY."""
    out = []
    for series in history.get("series", []):
        before = "HEALTHY"
        for point in series["points"]:
            if point["health"] != before:
                out.append({"t": point["t"], "cluster": series["cluster"], "endpoint": series["endpoint"],
                            "health": point["health"], "reason": (point["reasons"] or [""])[0]})
            before = point["health"]
    return sorted(out, key=lambda c: c["t"])


def _xds_protocol(admin: str, node_id: str) -> str | None:
    """The ADS protocol the control plane sees ``node_id`` using ("sotw" / "delta"; None if not connected)."""
    nodes = _get_json(f"{admin}/api/v1/nodes")["nodes"]
    return next((n["protocol"] for n in nodes if n["node_id"] == node_id), None)


#: On a terminal the live table is redrawn in place this often (s); elsewhere (a log, a pipe) one
#: progress line is printed this often instead, and the table once at the end.
LIVE_EVERY_S, PROGRESS_EVERY_S = 2.0, 10.0


async def _live(admin: str, stop: asyncio.Event, traffic: Traffic, started: float) -> None:
    """The weights every :data:`LIVE_EVERY_S` as a table updated in place on a terminal (rich); on a
    non-terminal one progress line (time, completed requests, errors, unhealthy endpoints) every
    :data:`PROGRESS_EVERY_S` (a table reprinted every 2 s was 345 lines for 60 s, issue 39).

    Once ``stop`` is set (the traffic is over) one last line, marked "traffic done", gives the final
    counts: the ones the summary gives (the last periodic line can be up to an interval old). The
    terminal's table is cleared when it stops: the final table and the summary are printed after it."""
    tty = sys.stdout.isatty()
    live = None
    if tty:
        from rich.live import Live

        live = Live(auto_refresh=False, transient=True)
        live.start()
    try:
        done = False
        while not done:
            done = stop.is_set()
            n = len(traffic.results)
            errors = sum(1 for r in traffic.results if not 200 <= r.status < 300)
            head = f"inferlb demo  t={time.monotonic() - started:5.1f}s  completed={n}  errors={errors}" \
                + ("  traffic done" if done else "")
            try:
                doc = await asyncio.to_thread(_get_json, f"{admin}/api/v1/weights")
            except OSError as err:
                doc = None
                head += f"  (admin API not answering: {err})"
            if live is not None:
                live.update(weights_rich_table(doc, head) if doc else head, refresh=True)
            else:
                out = [e["address"] for c in (doc or {}).get("clusters", []) for e in c["endpoints"]
                       if e["health"] != "HEALTHY"]
                print(head + (f"  not healthy: {', '.join(out)}" if out else ""), flush=True)
            if done:
                break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(LIVE_EVERY_S if tty else PROGRESS_EVERY_S):  # not wait_for: it can
                    await stop.wait()                                                    # lose a cancellation on 3.11
    finally:
        if live is not None:
            live.stop()


class Terminated(BaseException):
    """SIGTERM arrived outside the traffic phase (a ``BaseException``, like ``KeyboardInterrupt`` for
    SIGINT, so no ``except Exception`` on the way swallows it)."""


def _raise_terminated(*_) -> None:
    raise Terminated


async def _traffic(duration: float, concurrency: int, admin: str, live: bool, traffic: Traffic) -> int | None:
    """Drive the demo's traffic for ``duration`` s, recording into ``traffic``, with the live table if
    ``live``. SIGINT or SIGTERM stops it early (the requests in flight are dropped, what was answered
    stays in ``traffic``); returns that signal's number, or None when the traffic ran its course."""
    sessions = make_sessions(48, ["v1", "v2", None], unsessioned_share=0.25, seed=7)
    stop = asyncio.Event()
    started = time.monotonic()
    driving = asyncio.create_task(drive(
        f"http://127.0.0.1:{ENVOY_LISTENER}/v1/chat/completions", sessions, duration_s=duration,
        concurrency=concurrency, traffic=traffic, stream_share=0.8, system_prompt=DEMO_SYSTEM_PROMPT))
    stopped_by: list[int] = []

    def on_signal(sig: int) -> None:
        stopped_by.append(sig)
        driving.cancel()

    loop = asyncio.get_running_loop()
    # signal.signal, not loop.add_signal_handler: the handlers before are put back exactly (removing a
    # loop's handler leaves SIGTERM at its default, which would kill the demo with its processes running)
    previous = {sig: signal.signal(sig, lambda sig, _frame: loop.call_soon_threadsafe(on_signal, sig))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    shower = asyncio.create_task(_live(admin, stop, traffic, started)) if live else None
    try:
        await asyncio.wait([driving])
        if not driving.cancelled():
            driving.result()   # drive records request errors; anything it raises is a bug to show
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop.set()
        if shower:
            await shower
    return stopped_by[0] if stopped_by else None


def choose_metrics_source(requested: str, prometheus_installed: bool) -> str:
    """``prometheus`` or ``scrape`` for ``--metrics-source`` ``requested`` (auto | prometheus | scrape).

    Raises:
        stack.StackError: ``prometheus`` was asked for and no binary is installed.
    """
    if requested == "auto":
        return "prometheus" if prometheus_installed else "scrape"
    if requested == "prometheus" and not prometheus_installed:
        raise stack.StackError(stack.PROMETHEUS_INSTALL_HINT + " Or run with --metrics-source scrape.")
    return requested


def outside_client_help(demo: DemoStack, models: dict) -> str:
    """What ``--traffic none`` prints: the URL, the served names (``models``: the ``GET /v1/models``
    answer Envoy gave) and how to send the session and version headers."""
    url = f"http://127.0.0.1:{ENVOY_LISTENER}"
    service = demo.cfg.services[0]
    headers = demo.cfg.headers
    names = ", ".join(m["id"] for m in models["data"])
    example = next((m for m in service.models), service.default)
    return "\n".join([
        f"inferlb demo: ready for any client at {url}/v1 (OpenAI API: chat/completions, completions, models)",
        f"  served models: {names} (a model name means the default version, {service.default})",
        f"  session: header '{headers.session[0]}: <id>' (or {', '.join(headers.session[1:] + ('the body',))}"
        "'s \"user\") keeps a conversation on one backend; without one, the prompt's first messages are the key",
        f"  version: header '{headers.version}: v2' (or \"model\": \"v2\" in the body) picks a version",
        f"  try:     curl {url}/v1/chat/completions -H 'content-type: application/json' "
        f"-H '{headers.session[0]}: s1' -d '{{\"model\": \"{example}\", \"max_tokens\": 16, "
        "\"messages\": [{\"role\": \"user\", \"content\": \"hello\"}]}'",
        f"  decisions: {demo.admin}/api/v1/decisions   weights: {demo.admin}/api/v1/weights",
        "  Ctrl-C (or SIGTERM) stops everything.",
    ])


def serve_outside_clients(demo: DemoStack) -> int:
    """``--traffic none``: print :func:`outside_client_help` and keep the stack up until SIGINT or
    SIGTERM (then 0: stopping is how this mode ends; the caller stops the processes).

    Raises:
        stack.StackError: Envoy does not answer ``GET /v1/models``.
    """
    try:
        models = _get_json(f"http://127.0.0.1:{ENVOY_LISTENER}/v1/models")
    except OSError as err:
        raise stack.StackError(f"Envoy does not answer GET /v1/models: {err}") from None
    print(outside_client_help(demo, models), flush=True)
    try:
        while all(p.alive() for p in demo.procs.values()):
            time.sleep(0.5)
    except (KeyboardInterrupt, Terminated):
        print("inferlb demo: stopping everything", file=sys.stderr, flush=True)
        return 0
    gone = next(p for p in demo.procs.values() if not p.alive())
    raise stack.StackError(f"{gone.name} exited with {gone.popen.returncode}:\n{gone.log_tail()}")


def run_demo(duration: float, json_path: str | None, workdir: str | None, concurrency: int,
             live: bool, xds_protocol: str = "sotw", metrics_source: str = "auto", traffic: str = "chat",
             tokenizer: str | None = None) -> int:
    """Run the demo; returns the process exit code (0 = ran and wrote its summary).

    ``xds_protocol``: "sotw" or "delta", the ADS variant Envoy's bootstrap asks for; the summary
    says which one served (``xds_protocol``, as the control plane saw the stream).
    ``metrics_source``: "auto", "prometheus" or "scrape" (see the module docstring).
    ``traffic``: "chat" (the demo's own load generator for ``duration`` s, then the summary) or
    "none" (:func:`serve_outside_clients`: no traffic, no summary, until a signal; exit code 0).
    ``tokenizer``: the backends count tokens with the Hugging Face tokenizer in that directory.
    """
    try:
        source = choose_metrics_source(metrics_source, stack.prometheus_binary() is not None)
    except stack.StackError as err:
        print(f"inferlb demo: {err}", file=sys.stderr)
        return 2
    import importlib.util

    if traffic == "chat" and importlib.util.find_spec("openai") is None:
        print("inferlb demo: the demo's traffic speaks through the openai client, which is not installed: "
              "pip install 'inferlb[demo]'", file=sys.stderr)
        return 2
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="inferlb-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    procs: list[stack.Proc] = []
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    # Ctrl-C stops everything even where the parent left SIGINT ignored (a background job of a
    # non-interactive shell, nohup, a test runner's worker): Python installs KeyboardInterrupt only
    # where SIGINT was not ignored at start.
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        print(f"inferlb demo: work dir {work}", flush=True)
        demo_started = time.time()
        print(f"inferlb demo: metrics source {source}" + ("" if source == "prometheus" else
              " (the control plane scrapes the backends' /metrics itself; no Prometheus)"), flush=True)
        demo = start_stack(work, source, xds_protocol, procs, tokenizer)
        if traffic == "none":
            return serve_outside_clients(demo)
        backends, cfg, admin, envoy_admin = demo.backends, demo.cfg, demo.admin, demo.envoy_admin
        print(f"inferlb demo: stack up; driving traffic for {duration:g} s through "
              f"http://127.0.0.1:{ENVOY_LISTENER}; session affinity "
              f"{AFFINITY_TEXT[cfg.services[0].session_affinity]}", flush=True)
        traffic = Traffic()
        traffic_started = time.monotonic()
        stopped_by = asyncio.run(_traffic(duration, concurrency, admin, live, traffic))
        if stopped_by is not None:
            print(f"inferlb demo: {signal.Signals(stopped_by).name}; traffic stopped, summarising what was "
                  "measured, then stopping everything", file=sys.stderr, flush=True)
        weights_doc = _get_json(f"{admin}/api/v1/weights")
        summary = {
            "duration_s": duration,
            "traffic_s": round(time.monotonic() - traffic_started, 3),
            "stopped_by": None if stopped_by is None else signal.Signals(stopped_by).name,
            "metrics_source": weights_doc["metrics_source"]["name"],
            "metrics_source_ok": weights_doc["metrics_source"]["ok"],
            "envoy_version": stack.envoy_version(),
            "xds_protocol": _xds_protocol(admin, "inferlb-demo"),
            "session_affinity": cfg.services[0].session_affinity,
            **traffic.summary(default_version=cfg.services[0].default),
            "weights": _settled_weights(admin, envoy_admin),
            "backends": [{"address": f"127.0.0.1:{p}", "version": v, "gpu_class": g} for v, g, p in backends],
            "workdir": str(work),
        }
        plot_path = work / "weight-history.png"
        history = _get_json(f"{admin}/api/v1/history?since={int(time.time() - demo_started) + 5}s")
        changes = health_changes(history)
        summary["health_changes"] = changes
        summary["ejections"] = sum(1 for c in changes if c["health"] == "UNHEALTHY" and "ejected" in c["reason"])
        print(weights_table(_get_json(f"{admin}/api/v1/weights"), source_line=False))
        print("\n".join(WEIGHT_COLUMNS))
        print(demo_summary_text(summary), flush=True)
        plot_history(history, plot_path, title=f"inferlb demo: EDS weight per endpoint ({duration:g} s of traffic)")
        summary["history_plot"] = str(plot_path)
        if json_path:
            Path(json_path).write_text(json.dumps(summary, indent=2))
            print(f"inferlb demo: summary written to {json_path}")
        print(f"inferlb demo: weight history plotted to {plot_path}")
        return 0 if stopped_by is None else 128 + stopped_by
    except stack.StackError as err:
        print(f"inferlb demo: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("inferlb demo: interrupted (SIGINT); stopping everything", file=sys.stderr)
        return 128 + signal.SIGINT
    except Terminated:
        print("inferlb demo: terminated (SIGTERM); stopping everything", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        stack.stop_all(procs)
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
