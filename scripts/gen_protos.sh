#!/usr/bin/env bash
# Regenerates the committed Python stubs (and mypy .pyi files) from protos/xavier/v1.
set -euo pipefail
cd "$(dirname "$0")/.."
out=protos/python
rm -f "$out"/xavier/v1/*_pb2*.py "$out"/xavier/v1/*_pb2*.pyi
python -m grpc_tools.protoc -I protos \
  --python_out="$out" --grpc_python_out="$out" \
  --mypy_out="$out" --mypy_grpc_out="$out" \
  protos/xavier/v1/*.proto
# The v1 package re-exports nothing; modules are imported as xavier.v1.<name>_pb2.
