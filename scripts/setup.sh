#!/usr/bin/env bash
# Sets up a fresh machine: a virtualenv in .venv with Xavier and everything its tests need.
# torch is installed first so nothing pulls a multi-GB CUDA build where a CPU one serves:
# XAVIER_TORCH overrides the requirement (e.g. XAVIER_TORCH="torch==2.11.0" on a CUDA host).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" >/dev/null 2>&1; then
  python -m pip install -q "${XAVIER_TORCH:-torch==2.13.0}"
fi
python -m pip install -q -e ".[dev]"
# etcd for the directory's etcd backend and its tests (Debian's etcd-server). Only as root with apt:
# elsewhere the etcd tests skip and say why.
if ! command -v etcd >/dev/null 2>&1 && [ ! -x /usr/bin/etcd ]; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server >/dev/null 2>&1; then
      apt-get update -q >/dev/null 2>&1 || true
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server >/dev/null 2>&1 \
        || echo "setup: could not install etcd-server; the etcd tests will skip" >&2
    fi
    # The package enables a system etcd on the default ports; the tests start their own.
    if command -v systemctl >/dev/null 2>&1; then systemctl disable --now etcd >/dev/null 2>&1 || true; fi
  else
    echo "setup: etcd not installed (needs root and apt-get); the etcd tests will skip" >&2
  fi
fi
python -c "import torch, xavier_core, xavier.v1.types_pb2; print('xavier ready: torch', torch.__version__)"
