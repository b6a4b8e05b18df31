#!/usr/bin/env bash
# Regenerates the committed Python stubs (and mypy .pyi files) from protos/xavier/v1. They are made in a
# scratch folder first: where protoc cannot run (no grpc_tools on this python), the stubs stay as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
out=protos/python
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python -m grpc_tools.protoc -I protos \
  --python_out="$tmp" --grpc_python_out="$tmp" \
  --mypy_out="$tmp" --mypy_grpc_out="$tmp" \
  protos/xavier/v1/*.proto
rm -f "$out"/xavier/v1/*_pb2*.py "$out"/xavier/v1/*_pb2*.pyi
cp "$tmp"/xavier/v1/*_pb2*.py "$tmp"/xavier/v1/*_pb2*.pyi "$out"/xavier/v1/
# The v1 package re-exports nothing; modules are imported as xavier.v1.<name>_pb2.
