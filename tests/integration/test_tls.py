"""TLS and mTLS on the xDS and ext_proc gRPC servers, against real Envoy, with certificates made here.

One inferlb requiring client certificates; three Envoys: one with the bootstrap `inferlb bootstrap
--tls-ca --tls-cert --tls-key` prints (gets its config over xDS and reaches the picker, whose cluster
came over CDS with its own UpstreamTlsContext), one without a client certificate and one trusting
another CA (both get nothing).
"""

from __future__ import annotations

import datetime
import ipaddress
import time
from pathlib import Path

import pytest
import requests
import yaml
from click.testing import CliRunner
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from inferlb.cli import main
from inferlb.devstack import stack
from inferlb.devstack.envoy_admin import envoy_hosts
from inferlb.serve import InferLB
from tests.integration.conftest import LoopThread, wait_until
from xds_server.config import EnvoyTls, load_config
from xds_server.resources.bootstrap import render_bootstrap

pytestmark = pytest.mark.integration


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, key, cert: x509.Certificate) -> tuple[str, str]:
    key_path, cert_path = path.with_suffix(".key"), path.with_suffix(".pem")
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(cert_path), str(key_path)


def make_ca(path: Path, cn: str):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    _write(path, key, cert)
    return key, cert


def issue(path: Path, ca, cn: str, *, server: bool) -> tuple[str, str]:
    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    usage = x509.oid.ExtendedKeyUsageOID.SERVER_AUTH if server else x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("inferlb.local")]), critical=False)
    return _write(path, key, builder.sign(ca_key, hashes.SHA256()))


def test_mtls_xds_and_ext_proc_against_real_envoy(tmp_path: Path):
    ca = make_ca(tmp_path / "ca", "inferlb test CA")
    make_ca(tmp_path / "other-ca", "someone else")   # a CA Envoy must not accept inferlb under
    server_cert, server_key = issue(tmp_path / "server", ca, "inferlb", server=True)
    client_cert, client_key = issue(tmp_path / "envoy", ca, "envoy", server=False)
    ca_pem, other_pem = str(tmp_path / "ca.pem"), str(tmp_path / "other-ca.pem")

    listener = stack.free_port()
    cfg_path = tmp_path / "inferlb.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "listen": {"xds": "127.0.0.1:0", "ext_proc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
        "tls": {"cert": server_cert, "key": server_key, "ca": ca_pem, "require_client_cert": True},
        "envoy": {"listener": f"127.0.0.1:{listener}",
                  "tls": {"ca": ca_pem, "cert": client_cert, "key": client_key, "server_name": "127.0.0.1"}},
        "prometheus": {"url": "http://127.0.0.1:1", "interval_s": 0.5, "timeout_s": 0.5, "first_round_wait_s": 0},
        "services": [{"name": "chat", "versions": [{"name": "v1", "endpoints": [{"address": "127.0.0.1:9"}]}]}],
    }))
    cfg = load_config(cfg_path)
    loop = LoopThread()
    app = InferLB(cfg, cfg_path)
    envoys: list[stack.Proc] = []
    try:
        loop.run(app.start())
        wait_until(app.control.ready.is_set, 10, what="first snapshot")
        xds = f"127.0.0.1:{app.xds_port}"

        # 1. The bootstrap the CLI prints, with a client certificate: xDS and the picker over mTLS.
        bootstrap_cfg = tmp_path / "bootstrap-input.yaml"   # the same config, with the bound xDS port
        bootstrap_cfg.write_text(yaml.safe_dump({**yaml.safe_load(cfg_path.read_text()), "listen": {"xds": xds}}))
        admin = stack.free_port()
        out = CliRunner().invoke(main, ["bootstrap", "-c", str(bootstrap_cfg), "--node-id", "tls-envoy",
                                        "--admin-port", str(admin), "--tls-ca", ca_pem, "--tls-cert", client_cert,
                                        "--tls-key", client_key, "--tls-server-name", "127.0.0.1"])
        assert out.exit_code == 0, out.output
        assert "UpstreamTlsContext" in out.output
        envoys.append(stack.start_envoy(out.output, tmp_path, admin, name="envoy-mtls"))
        wait_until(lambda: "chat-v1" in envoy_hosts(f"http://127.0.0.1:{admin}"), 15, 0.1,
                   "Envoy to get its clusters over mTLS xDS")
        def picker_says() -> str | None:
            try:
                r = requests.post(f"http://127.0.0.1:{listener}/v1/chat/completions",
                                  headers={"model-version": "v9"}, json={}, timeout=5)
            except requests.ConnectionError:   # the listener (LDS) may come a moment after the clusters
                return None
            return r.text if r.status_code == 400 else None

        text = wait_until(picker_says, 10, 0.2, "the picker to answer over mTLS")
        assert "known versions" in text   # only the picker says this: ext_proc over mTLS works
        node = next(n for n in app.ads.describe_nodes() if n["node_id"] == "tls-envoy")
        assert all(t["nacks"] == 0 for t in node["types"].values())

        # 2. No client certificate, and 3. trusting another CA: no config at all.
        for name, tls in (("envoy-no-cert", EnvoyTls(ca=ca_pem, server_name="127.0.0.1")),
                          ("envoy-wrong-ca", EnvoyTls(ca=other_pem, cert=client_cert, key=client_key))):
            admin = stack.free_port()
            envoys.append(stack.start_envoy(render_bootstrap(xds_address=xds, node_id=name, admin_port=admin,
                                                             tls=tls), tmp_path, admin, name=name))
            time.sleep(2.5)
            assert "chat-v1" not in envoy_hosts(f"http://127.0.0.1:{admin}"), name
            assert not [n for n in app.ads.describe_nodes() if n["node_id"] == name]
    finally:
        for e in envoys:
            e.stop()
        loop.run(app.stop(0.2))
        loop.close()
