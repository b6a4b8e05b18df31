#!/usr/bin/env bash
# Here, on a CPU machine with pip: stages what a lent GPU machine needs into DIR (default .gpu, which
# .git/info/exclude then lists): the SGLang 0.5.17 site as two chunks (sx00, sx01; each under a call's
# 64 MiB carry) from ../shared/reference/sglang-gpu/one-gpu/build_site.sh, and the wheels Xavier needs beyond
# it (extra/, from scripts/gpu_extra_wheels.sh). About 4 minutes. Then, on the GPU machine:
#   call 1, carry [DIR/sx00]:                mkdir -p /root/stage && cp DIR/sx00 /root/stage/
#   call 2, carry [DIR/sx01, DIR/extra]:     bash scripts/gpu/setup.sh DIR && bash scripts/gpu/cases.sh CASE...
# (The reference engine's cases alone need no SGLang: scripts/gpu/stage_lean.sh stages them for one call.)
# usage: scripts/gpu/stage.sh [DIR] [SHARED]   (SHARED: the shared folder, default ../shared)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dir=${1:-.gpu}
shared=${2:-$root/../shared}
cd "$root"
grep -qx "/$dir/" .git/info/exclude 2>/dev/null || echo "/$dir/" >> .git/info/exclude
[ -f "$dir/sx00" ] && [ -f "$dir/sx01" ] || bash "$shared/reference/sglang-gpu/one-gpu/build_site.sh" "$dir"
bash scripts/gpu_extra_wheels.sh "$dir/extra" > /dev/null
du -sh "$dir"/sx00 "$dir"/sx01 "$dir"/extra
