#!/usr/bin/env bash
# Downloads, on a machine with pip, the wheels Xavier needs on the GPU machine (Python 3.12, x86-64)
# beyond the SGLang site that ../shared/reference/sglang-gpu/one-gpu/build_site.sh builds: carry DIR in
# the call that runs setup.sh and install them there with
#   python3 -m pip install -q --no-index --no-deps --target /root/site DIR/*.whl
# usage: scripts/gpu_extra_wheels.sh DIR   (DIR is best a git-ignored folder, e.g. .gpu/extra)
set -euo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$out" "xxhash>=3.4"  # page checksums (xavier_core.pagestore.layout)
ls -la "$out"
