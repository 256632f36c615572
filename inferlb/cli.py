"""The ``inferlb`` command (console script ``inferlb.cli:main``; also ``python -m inferlb``).

Commands only: each imports what it runs when it runs, so ``inferlb --help`` stays fast; the
benchmark and simulator commands are loaded on first use (:class:`LazyGroup`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import urllib.error
import urllib.request

import click

DEFAULT_ADMIN = "http://127.0.0.1:18090"


class HostPort(click.ParamType):
    """A ``HOST:PORT`` option, checked as the config checks its addresses
    (:func:`xds_server.config.model.check_hostport`). ``dial``: an address to connect to, so port 0
    (any free port, for a listener) is refused."""

    name = "HOST:PORT"

    def __init__(self, dial: bool = False) -> None:
        self.dial = dial

    def convert(self, value, param, ctx) -> str:
        from xds_server.config import split_hostport
        from xds_server.config.model import check_hostport

        try:
            check_hostport(value)
        except ValueError as err:
            self.fail(str(err), param, ctx)
        if self.dial and split_hostport(value)[1] == 0:
            self.fail(f"port 0 cannot be dialled, got {value!r}", param, ctx)
        return value


def _not_empty(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """Option callback: refuse an empty (or blank) value."""
    if value is not None and not value.strip():
        raise click.BadParameter("must not be empty")
    return value


def _admin_url(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    """Option callback: the admin API's base URL must be ``http://HOST[:PORT]`` or ``https://...``
    (refused as a usage error otherwise, before anything is read)."""
    import urllib.parse

    url = urllib.parse.urlsplit(value)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise click.BadParameter(f"expected a URL such as {DEFAULT_ADMIN}, got {value!r}")
    return value


def _setup_logging(level: str, fmt: str = "text") -> None:
    """Log to stderr as text lines, or (``fmt="json"``) one JSON object per line (python-json-logger:
    ``time``, ``level``, ``logger``, ``message`` and, on errors, ``exc_info``)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(JsonFormatter("%(asctime)s %(levelname)s %(name)s %(message)s",
                                           rename_fields={"asctime": "time", "levelname": "level", "name": "logger"}))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler], force=True)


def _load(path: str):
    from inferlb.picker_config import CONFIG_CHECKS
    from xds_server.config import ConfigError, load_config

    try:
        return load_config(path, CONFIG_CHECKS)
    except ConfigError as err:
        click.echo(f"invalid config:\n{err}", err=True)
        sys.exit(2)


class LazyGroup(click.Group):
    """A click group whose ``lazy`` commands (``{name: "module:attribute"}``) are imported on first use
    (the pattern of click's documentation, "Lazily Loading Subcommands")."""

    def __init__(self, *args, lazy: dict[str, str] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.lazy])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy:
            import importlib

            module, attr = self.lazy[name].split(":")
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)


@click.group(cls=LazyGroup, lazy={"sim-backend": "sim.cli:sim_backend", "sim-tokenizer": "sim.cli:sim_tokenizer"})
@click.version_option(package_name="inferlb", prog_name="inferlb")
def main() -> None:
    """inferlb: an inference-aware control plane for Envoy (xDS weights + ext_proc picker)."""


@main.command()
@click.option("-c", "--config", "config_path", required=True, type=click.Path(), help="YAML config file.")
def validate(config_path: str) -> None:
    """Check a config file; print each problem with its field and line."""
    from inferlb.serve import require_runtime
    from xds_server.config import ConfigError

    cfg = _load(config_path)
    try:
        require_runtime(cfg)
    except ConfigError as err:
        click.echo(f"invalid config:\n{config_path}: {err}", err=True)
        sys.exit(2)
    n = sum(len(v.endpoints) for s in cfg.services for v in s.versions)
    found = [name for name in ("kubernetes", "etcd") if getattr(cfg.discovery, name) is not None]
    more = f", plus discovery from {' and '.join(found)}" if found else ""
    click.echo(f"{config_path}: OK ({len(cfg.services)} services, {n} endpoints{more})")


@main.command()
@click.option("-c", "--config", "config_path", required=True, type=click.Path(), help="YAML config file.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]), help="Log level of the process's log lines.")
@click.option("--log-format", default="text", show_default=True, type=click.Choice(["text", "json"]),
              help="json: one JSON object per line (time, level, logger, message).")
@click.option("--watch-config", "watch_s", default=2.0, show_default=True, type=click.FloatRange(min=0),
              help="Poll the config file every S seconds and reload it when it changes (0 = only on SIGHUP).")
@click.option("--shutdown-grace", "grace_s", default=5.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds open streams get to finish on SIGTERM.")
def serve(config_path: str, log_level: str, log_format: str, watch_s: float, grace_s: float) -> None:
    """Run the xDS server, the ext_proc picker and the admin API. SIGHUP reloads the config."""
    from inferlb.listeners import BindError
    from inferlb.serve import serve as run
    from xds_server.config import ConfigError
    from xds_server.history.types import HistoryError

    cfg = _load(config_path)
    _setup_logging(log_level, log_format)
    try:
        asyncio.run(run(cfg, config_path=config_path, watch_interval_s=watch_s, grace_s=grace_s))
    except (BindError, ConfigError, HistoryError) as err:
        click.echo(f"inferlb serve: {err}", err=True)
        sys.exit(2)


@main.command()
@click.option("-c", "--config", "config_path", type=click.Path(),
              help="YAML config file (default: every listen address at its default).")
@click.option("--node-id", required=True, callback=_not_empty,
              help="Envoy node.id (the control plane keys its state by it).")
@click.option("--node-cluster", default="inferlb", show_default=True, callback=_not_empty, help="Envoy node.cluster.")
@click.option("--admin-port", default=9901, show_default=True, type=click.IntRange(1, 65535),
              help="Envoy's admin port (127.0.0.1).")
@click.option("--delta", is_flag=True, help="Delta (incremental) ADS instead of State-of-the-World.")
@click.option("--xds-address", type=HostPort(dial=True),
              help="The xDS address Envoy dials (default: the config's listen.xds, a wildcard host there "
                   "becoming 127.0.0.1); a host name makes the xDS cluster STRICT_DNS.")
@click.option("--tls-ca", type=click.Path(), help="CA bundle Envoy trusts for the xDS server (turns TLS on).")
@click.option("--tls-cert", type=click.Path(), help="Envoy's client certificate (mTLS; with --tls-key).")
@click.option("--tls-key", type=click.Path(), help="Envoy's client key (mTLS; with --tls-cert).")
@click.option("--tls-server-name", help="SNI and subject alt name the xDS server certificate must carry.")
def bootstrap(config_path: str | None, node_id: str, node_cluster: str, admin_port: int, delta: bool,
              xds_address: str | None, tls_ca: str | None,
              tls_cert: str | None, tls_key: str | None, tls_server_name: str | None) -> None:
    """Print the Envoy bootstrap YAML (everything else comes over xDS).

    It needs only the xDS address: --xds-address, else the config's listen.xds, or its default
    without -c. Paths are as Envoy's host sees them. Without --tls-ca the config's envoy.tls is used, if any.
    """
    from xds_server.config import EnvoyTls, Listen
    from xds_server.resources.bootstrap import render_bootstrap

    cfg = _load(config_path) if config_path else None
    xds = xds_address or (cfg.listen.xds if cfg else Listen().xds)
    tls = cfg.envoy.tls if cfg else None
    if tls_ca or tls_cert or tls_key:
        if not tls_ca or bool(tls_cert) != bool(tls_key):
            raise click.UsageError("--tls-ca is required with TLS, and --tls-cert and --tls-key go together")
        tls = EnvoyTls(ca=tls_ca, cert=tls_cert, key=tls_key, server_name=tls_server_name)
    click.echo(render_bootstrap(xds_address=xds, node_id=node_id, node_cluster=node_cluster,
                                admin_port=admin_port, delta=delta, tls=tls))


@main.command()
@click.option("--admin", default=DEFAULT_ADMIN, show_default=True, callback=_admin_url, help="Admin API base URL.")
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON document.")
def weights(admin: str, as_json: bool) -> None:
    """Show the current weights, health and reasons."""
    from inferlb.output import weights_table

    try:
        with urllib.request.urlopen(f"{admin.rstrip('/')}/api/v1/weights", timeout=5) as r:
            doc = json.load(r)
    except (urllib.error.URLError, OSError, ValueError) as err:
        click.echo(f"cannot read {admin}/api/v1/weights: {err}", err=True)
        sys.exit(1)
    click.echo(json.dumps(doc, indent=2) if as_json else weights_table(doc))


@main.command()
@click.option("--admin", default=DEFAULT_ADMIN, show_default=True, callback=_admin_url, help="Admin API base URL.")
@click.option("--cluster", help="Cluster, e.g. chat-v1 (without it: the clusters to choose from).")
@click.option("--endpoint", help="Only this endpoint (HOST:PORT).")
@click.option("--since", default="10m", show_default=True, help="A duration ago (10m, 2h) or an RFC 3339 time.")
@click.option("--until", help="End, in the same forms (default: now).")
@click.option("--step", help="Resample to one point per step (e.g. 30s).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write a PNG plot here instead.")
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON document.")
def history(admin: str, cluster: str | None, endpoint: str | None, since: str, until: str | None,
            step: str | None, plot_path: str | None, as_json: bool) -> None:
    """Show the weight history of a cluster: a table, the JSON, or a PNG plot (--plot)."""
    import urllib.parse

    from inferlb.output import history_table

    if cluster is None:
        try:
            with urllib.request.urlopen(f"{admin.rstrip('/')}/api/v1/weights", timeout=5) as r:
                names = [c["name"] for c in json.load(r)["clusters"]]
        except (urllib.error.URLError, OSError, ValueError, KeyError) as err:
            raise click.UsageError(f"pass --cluster (the clusters could not be read from {admin}: {err})") from None
        raise click.UsageError("pass --cluster, one of: " + (", ".join(names) or "(the control plane has none)"))

    params = {k: v for k, v in (("cluster", cluster), ("endpoint", endpoint), ("since", since), ("until", until),
                                ("step", step)) if v is not None}
    url = f"{admin.rstrip('/')}/api/v1/history?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            doc = json.load(r)
    except urllib.error.HTTPError as err:
        try:
            message = json.load(err)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = err.reason
        click.echo(f"inferlb history: {message}", err=True)
        sys.exit(2 if err.code in (400, 404) else 1)  # a bad parameter or an unknown cluster: usage
    except (urllib.error.URLError, OSError, ValueError) as err:
        click.echo(f"cannot read {url}: {err}", err=True)
        sys.exit(1)
    if plot_path:
        from inferlb.output import plot_history

        try:
            n = plot_history(doc, plot_path, title=f"inferlb: EDS weight per endpoint, {cluster}")
        except ModuleNotFoundError as err:
            raise click.ClickException(f"--plot needs {err.name}: pip install 'inferlb[demo]'") from None
        except OSError as err:
            raise click.BadParameter(f"cannot write {plot_path}: {err.strerror or err}",
                                     param_hint="'--plot'") from None
        click.echo(f"{plot_path}: {n} endpoints")
    else:
        click.echo(json.dumps(doc, indent=2) if as_json else history_table(doc))


@main.command()
@click.option("--duration", default=60.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Seconds of traffic.")
@click.option("--traffic", type=click.Choice(["chat", "none"]), default="chat", show_default=True,
              help="chat: the demo's own chat traffic, then a summary; none: no traffic, the stack serves any "
                   "client (it prints the URL, the models and the headers) until Ctrl-C.")
@click.option("--tokenizer", type=click.Path(exists=True, file_okay=False), default=None,
              help="The simulated backends count tokens with the Hugging Face tokenizer in this directory "
                   "(inferlb sim-tokenizer writes one)  [default: 4 bytes a token]")
@click.option("--json", "json_path", type=click.Path(), help="Write the run summary here.")
@click.option("--workdir", type=click.Path(), help="Keep configs and logs here (default: a temp dir).")
@click.option("--concurrency", default=8, show_default=True, type=click.IntRange(min=1),
              help="Concurrent client requests.")
@click.option("--quiet", is_flag=True, help="No live table.")
@click.option("--xds-protocol", type=click.Choice(["sotw", "delta"]), default="sotw", show_default=True,
              help="How Envoy talks to the control plane: State-of-the-World or delta ADS.")
@click.option("--metrics-source", type=click.Choice(["auto", "prometheus", "scrape"]), default="auto",
              show_default=True, help="auto: Prometheus if installed, else the control plane scrapes the backends.")
def demo(duration: float, traffic: str, tokenizer: str | None, json_path: str | None, workdir: str | None,
         concurrency: int, quiet: bool, xds_protocol: str, metrics_source: str) -> None:
    """Run the whole stack on this machine (simulated GPUs, Prometheus, inferlb, Envoy) and drive traffic."""
    from inferlb.demo import run_demo

    _setup_logging("warning")
    sys.exit(run_demo(duration=duration, json_path=json_path, workdir=workdir, concurrency=concurrency,
                      live=not quiet, xds_protocol=xds_protocol,
                      metrics_source=metrics_source, traffic=traffic, tokenizer=tokenizer))


@main.command("ext-proc")
@click.option("--xds", required=True, type=HostPort(dial=True), help="The control plane's ADS address.")
@click.option("--listen", default="127.0.0.1:18080", show_default=True, type=HostPort(),
              help="Serve ext_proc here (port 0 = any free port).")
@click.option("--transport", type=click.Choice(["fast", "grpcio"]), default="fast", show_default=True,
              help="The ext_proc server: fast (its own HTTP/2, less CPU per decision) or grpcio "
                   "(the grpcio library's; docs/picker.md, Transports).")
@click.option("--workers", default=1, show_default=True, type=click.IntRange(1, 64),
              help="Picker processes sharing the port (SO_REUSEPORT); one per Envoy worker.")
@click.option("--node-id", default=None, callback=_not_empty,
              help="xDS node id (default: inferlb-picker-HOSTNAME-PID).")
@click.option("--tls-cert", type=click.Path(exists=True), help="Serve TLS (ALPN h2) with this certificate (PEM).")
@click.option("--tls-key", type=click.Path(exists=True), help="The certificate's private key (PEM).")
@click.option("--tls-ca", type=click.Path(exists=True), help="CA bundle client certificates are checked against.")
@click.option("--require-client-cert", is_flag=True,
              help="mTLS: refuse clients without a certificate (needs --tls-ca).")
@click.option("--reuse-port", is_flag=True, help="Set SO_REUSEPORT (implied by --workers > 1).")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]), help="Log level of the process's log lines.")
def ext_proc_cmd(xds: str, listen: str, transport: str, workers: int, node_id: str | None, tls_cert: str | None,
                 tls_key: str | None, tls_ca: str | None, require_client_cert: bool, reuse_port: bool,
                 log_level: str) -> None:
    """Run the picker alone, learning endpoints and routing from the control plane over ADS."""
    import os
    import socket

    from ext_proc.transport.base import TlsFiles
    from inferlb.picker_process import run_picker, run_workers

    _setup_logging(log_level)
    if bool(tls_cert) != bool(tls_key) or ((tls_ca or require_client_cert) and not tls_cert):
        raise click.UsageError("--tls-cert and --tls-key go together; --tls-ca and --require-client-cert need them")
    if require_client_cert and not tls_ca:
        raise click.UsageError("--require-client-cert needs --tls-ca")
    if workers > 1 and listen.rpartition(":")[2] == "0":
        raise click.UsageError("--workers above 1 share one port: give --listen a port other than 0 (each worker "
                               "would take its own)")
    if workers > 1:
        argv = ["--xds", xds, "--listen", listen, "--transport", transport, "--log-level", log_level]
        for flag, value in (("--tls-cert", tls_cert), ("--tls-key", tls_key), ("--tls-ca", tls_ca)):
            argv += [flag, value] if value else []
        argv += ["--require-client-cert"] if require_client_cert else []
        sys.exit(run_workers(argv, workers, node_id))

    import uvloop

    tls = TlsFiles(tls_cert, tls_key, tls_ca, require_client_cert) if tls_cert and tls_key else None
    node = node_id or f"inferlb-picker-{socket.gethostname()}-{os.getpid()}"
    from ext_proc.kv_events import KvEventsUnavailable
    from inferlb.listeners import BindError

    try:
        uvloop.run(run_picker(xds, listen, kind=transport, node_id=node, reuse_port=reuse_port, tls=tls))
    except (BindError, KvEventsUnavailable) as err:
        click.echo(f"inferlb ext-proc: {err}", err=True)
        sys.exit(2)


_BENCHES = {"picker": "bench.picker_cli:picker", "ext-proc-config": "bench.picker_cli:ext_proc_config",
            "quality": "bench.quality.cli:quality", "soak": "bench.soak_cli:soak", "lab": "bench.lab.cli:lab"}


@main.group(cls=LazyGroup, lazy=_BENCHES)
def bench() -> None:
    """Benchmarks on this machine (results to JSON and BENCHMARKS.md)."""


if __name__ == "__main__":
    main()
