"""docker-compose.yml: valid against the Compose Specification's JSON schema (as vendored, with its
licence, by the check-jsonschema package), every mounted config file exists, and each is checked by
the tool that will read it. No Docker engine runs here."""

from __future__ import annotations

import importlib.resources
import json
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from inferlb.devstack.stack import envoy_binary, prometheus_binary
from xds_server.config import load_config, split_hostport

ROOT = Path(__file__).resolve().parents[3]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def mounts(service: str) -> dict[str, Path]:
    """``{container path: host path}`` of a service's bind mounts (named volumes are left out)."""
    out = {}
    for volume in COMPOSE["services"][service].get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith(("./", "/")):
            out[target] = ROOT / source
    return out


def ip_of(service: str) -> str:
    return COMPOSE["services"][service]["networks"]["mesh"]["ipv4_address"]


def test_valid_against_the_compose_specification():
    schema_file = importlib.resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    jsonschema.validate(COMPOSE, schema, cls=jsonschema.Draft202012Validator)
    broken = {**COMPOSE, "services": {**COMPOSE["services"], "envoy": {**COMPOSE["services"]["envoy"],
                                                                       "ports": [{"bogus": 1}]}}}
    with pytest.raises(jsonschema.ValidationError):   # the schema does check services
        jsonschema.validate(broken, schema, cls=jsonschema.Draft202012Validator)


def test_the_stack_has_envoy_inferlb_prometheus_and_three_backends():
    services = COMPOSE["services"]
    assert services["envoy"]["image"].startswith("envoyproxy/envoy:v1.40")
    assert services["prometheus"]["image"].startswith("prom/prometheus:")
    sims = [n for n, s in services.items() if "sim-backend" in s.get("command", [])]
    assert len(sims) == 3
    for name in ("inferlb", *sims):
        assert services[name]["healthcheck"]["test"][0] == "CMD"


def test_every_mounted_file_exists():
    for name in COMPOSE["services"]:
        for target, source in mounts(name).items():
            assert source.exists(), f"{name}: {source} (mounted at {target}) is missing"


def test_inferlb_config_is_valid_and_points_at_the_compose_services():
    path = mounts("inferlb")["/etc/inferlb/inferlb.yaml"]
    command = COMPOSE["services"]["inferlb"]["command"]
    assert command[command.index("-c") + 1] == "/etc/inferlb/inferlb.yaml"
    cfg = load_config(path)
    sims = {ip_of(n) for n, s in COMPOSE["services"].items() if "sim-backend" in s.get("command", [])}
    assert {split_hostport(e.address)[0] for s in cfg.services for v in s.versions for e in v.endpoints} == sims
    assert cfg.prometheus.url == f"http://{ip_of('prometheus')}:9090"
    assert split_hostport(cfg.envoy.ext_proc_address)[0] == ip_of("inferlb")


def test_inferlb_takes_the_admin_token_from_the_environment_optionally():
    # the admin API binds 0.0.0.0 in the stack: drain and reload need INFERLB_ADMIN_TOKEN; ${VAR:-} is
    # empty when unset (inferlb: no token) so `docker compose up` works without one
    from inferlb.serve import TOKEN_ENV

    cfg = load_config(mounts("inferlb")["/etc/inferlb/inferlb.yaml"])
    assert split_hostport(cfg.listen.admin)[0] == "0.0.0.0" and cfg.admin.token is None
    assert COMPOSE["services"]["inferlb"]["environment"] == {TOKEN_ENV: "${INFERLB_ADMIN_TOKEN:-}"}


def test_envoy_bootstrap_is_what_inferlb_bootstrap_prints_and_envoy_accepts_it(tmp_path):
    from click.testing import CliRunner

    from inferlb.cli import main

    path = mounts("envoy")["/etc/envoy/envoy.yaml"]
    cfg = load_config(mounts("inferlb")["/etc/inferlb/inferlb.yaml"])
    port = split_hostport(cfg.listen.xds)[1]
    # the command docker-compose.yml and docs/operations.md give, run from the repository
    command = ["bootstrap", "-c", "deploy/compose/inferlb.yaml", "--node-id", "compose-envoy",
               "--xds-address", f"{ip_of('inferlb')}:{port}"]
    assert f"inferlb {' '.join(command)} > deploy/compose/envoy.yaml" in (ROOT / "docker-compose.yml").read_text()
    assert f"inferlb {' '.join(command)}" in " ".join((ROOT / "docs" / "operations.md").read_text().split())
    run = CliRunner().invoke(main, [*command[:2], str(ROOT / command[2]), *command[3:]])
    assert run.exit_code == 0, run.output
    assert path.read_text() + "\n" == run.output
    out = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout[-1500:] + out.stderr[-1500:]


def test_prometheus_config_passes_promtool_and_scrapes_every_backend():
    path = mounts("prometheus")["/etc/prometheus/prometheus.yml"]
    promtool = Path(prometheus_binary() or "/usr/bin/prometheus").with_name("promtool")
    out = subprocess.run([str(promtool), "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    doc = yaml.safe_load(path.read_text())
    targets = {t for job in doc["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    cfg = load_config(mounts("inferlb")["/etc/inferlb/inferlb.yaml"])
    assert {e.instance for s in cfg.services for v in s.versions for e in v.endpoints} <= targets
    assert f"{ip_of('inferlb')}:18090" in targets
