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
python -c "import torch, xavier_core, xavier.v1.types_pb2; print('xavier ready: torch', torch.__version__)"
