#!/usr/bin/env bash
# Here, on a CPU machine with pip: stages in one file what the reference engine's GPU cases need
# (scripts/gpu/cases.sh share, verify, profile; not SGLang's) into DIR/lean.tar.xz (default DIR .gpu), small
# enough for one call's 64 MiB carry: NIXL and Xavier's runtime dependencies that the GPU machine lacks
# (the machine has torch 2.11, numpy, aiohttp, uvloop, prometheus-client, safetensors and matplotlib). Then,
# on the GPU machine, in one call, carry [DIR/lean.tar.xz]:
#   bash scripts/gpu/setup.sh DIR && bash scripts/gpu/cases.sh CASE...
# usage: scripts/gpu/stage_lean.sh [DIR]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dir=${1:-.gpu}
cd "$root"
grep -qx "/$dir/" .git/info/exclude 2>/dev/null || echo "/$dir/" >> .git/info/exclude
mkdir -p "$dir"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_34_x86_64
 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
 --platform manylinux2014_x86_64 --platform any"
for req in nixl==1.5.1 nixl-cu13==1.5.1 grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
  grpcio-status==1.85.1 protobuf==7.35.1 googleapis-common-protos structlog aetcd cryptography cffi pycparser \
  pydantic pydantic-core annotated-types typing-inspection tokenizers xxhash pytest-asyncio trustme; do
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps $plat -d "$work/w" "$req"
done
# shellcheck disable=SC2086
python3 -m pip install -q --no-deps --no-compile --no-index --target "$work/site" $plat "$work"/w/*.whl
# nixl_ep (expert-parallel kernels built for torch 2.12-2.14) cannot load beside torch 2.11
rm -rf "$work/site/nixl_ep_cu13" "$work/site/bin"
tar -cf - -C "$work/site" . | xz -T2 -6 > "$dir/lean.tar.xz"
du -sh "$dir/lean.tar.xz"
