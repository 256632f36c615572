"""The ``inferlb`` command."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import urllib.error
import urllib.request

import click

from sim.cli import sim_backend

from .config import ConfigError, load_config

DEFAULT_ADMIN = "http://127.0.0.1:18090"


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
    try:
        return load_config(path)
    except ConfigError as err:
        click.echo(f"invalid config:\n{err}", err=True)
        sys.exit(2)


@click.group()
def main() -> None:
    """inferlb: an inference-aware control plane for Envoy (xDS weights + ext_proc picker)."""


@main.command()
@click.option("-c", "--config", "config_path", required=True, type=click.Path(), help="YAML config file.")
def validate(config_path: str) -> None:
    """Check a config file; print each problem with its field and line."""
    cfg = _load(config_path)
    n = sum(len(v.endpoints) for s in cfg.services for v in s.versions)
    click.echo(f"{config_path}: OK ({len(cfg.services)} services, {n} endpoints)")


@main.command()
@click.option("-c", "--config", "config_path", required=True, type=click.Path(), help="YAML config file.")
@click.option("--log-level", default="info", type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--log-format", default="text", show_default=True, type=click.Choice(["text", "json"]),
              help="json: one JSON object per line (time, level, logger, message).")
@click.option("--watch-config", "watch_s", default=2.0, show_default=True, type=click.FloatRange(min=0),
              help="Poll the config file every S seconds and reload it when it changes (0 = only on SIGHUP).")
@click.option("--shutdown-grace", "grace_s", default=5.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds open streams get to finish on SIGTERM.")
def serve(config_path: str, log_level: str, log_format: str, watch_s: float, grace_s: float) -> None:
    """Run the xDS server, the ext_proc picker and the admin API. SIGHUP reloads the config."""
    from .serve import serve as run

    cfg = _load(config_path)
    _setup_logging(log_level, log_format)
    asyncio.run(run(cfg, config_path=config_path, watch_interval_s=watch_s, grace_s=grace_s))


@main.command()
@click.option("-c", "--config", "config_path", required=True, type=click.Path(), help="YAML config file.")
@click.option("--node-id", required=True, help="Envoy node.id (the control plane keys its state by it).")
@click.option("--node-cluster", default="inferlb", show_default=True, help="Envoy node.cluster.")
@click.option("--admin-port", default=9901, show_default=True, type=int, help="Envoy's admin port (127.0.0.1).")
@click.option("--tls-ca", type=click.Path(), help="CA bundle Envoy trusts for the xDS server (turns TLS on).")
@click.option("--tls-cert", type=click.Path(), help="Envoy's client certificate (mTLS; with --tls-key).")
@click.option("--tls-key", type=click.Path(), help="Envoy's client key (mTLS; with --tls-cert).")
@click.option("--tls-server-name", help="SNI and subject alt name the xDS server certificate must carry.")
def bootstrap(config_path: str, node_id: str, node_cluster: str, admin_port: int, tls_ca: str | None,
              tls_cert: str | None, tls_key: str | None, tls_server_name: str | None) -> None:
    """Print the Envoy bootstrap YAML for CONFIG (everything else comes over xDS).

    Paths are as Envoy's host sees them. Without --tls-ca the config's envoy.tls is used, if any.
    """
    from .bootstrap import render_bootstrap
    from .config import EnvoyTls

    cfg = _load(config_path)
    tls = cfg.envoy.tls
    if tls_ca or tls_cert or tls_key:
        if not tls_ca or bool(tls_cert) != bool(tls_key):
            raise click.UsageError("--tls-ca is required with TLS, and --tls-cert and --tls-key go together")
        tls = EnvoyTls(ca=tls_ca, cert=tls_cert, key=tls_key, server_name=tls_server_name)
    click.echo(render_bootstrap(xds_address=cfg.listen.xds, node_id=node_id, node_cluster=node_cluster,
                                admin_port=admin_port, tls=tls))


@main.command()
@click.option("--admin", default=DEFAULT_ADMIN, show_default=True, help="Admin API base URL.")
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON document.")
def weights(admin: str, as_json: bool) -> None:
    """Show the current weights, health and reasons."""
    from .table import weights_table

    try:
        with urllib.request.urlopen(f"{admin.rstrip('/')}/api/v1/weights", timeout=5) as r:
            doc = json.load(r)
    except (urllib.error.URLError, OSError, ValueError) as err:
        click.echo(f"cannot read {admin}/api/v1/weights: {err}", err=True)
        sys.exit(1)
    click.echo(json.dumps(doc, indent=2) if as_json else weights_table(doc))


@main.command()
@click.option("--duration", default=60.0, show_default=True, type=float, help="Seconds of traffic.")
@click.option("--json", "json_path", type=click.Path(), help="Write the run summary here.")
@click.option("--workdir", type=click.Path(), help="Keep configs and logs here (default: a temp dir).")
@click.option("--concurrency", default=8, show_default=True, type=int, help="Concurrent client requests.")
@click.option("--quiet", is_flag=True, help="No live table.")
def demo(duration: float, json_path: str | None, workdir: str | None, concurrency: int, quiet: bool) -> None:
    """Run the whole stack on this machine (simulated GPUs, Prometheus, inferlb, Envoy) and drive traffic."""
    from .demo import run_demo

    _setup_logging("warning")
    sys.exit(run_demo(duration=duration, json_path=json_path, workdir=workdir, concurrency=concurrency,
                      live=not quiet))


main.add_command(sim_backend, "sim-backend")

if __name__ == "__main__":
    main()
