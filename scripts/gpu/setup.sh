#!/usr/bin/env bash
# On the GPU machine, from the project's root, in the call that carries DIR/sx01 and DIR/extra (the call
# before copied DIR/sx00 to /root/stage), or in one call that carries DIR/lean.tar.xz (stage_lean.sh: the
# reference engine's cases, no SGLang): unpacks the site into /root/site (once per machine), adds the extra
# wheels, installs the project editable into the machine's python and writes /root/env.sh, which every
# later call sources (scripts/gpu/cases.sh does). About 40 s.
# usage: bash scripts/gpu/setup.sh [DIR]
set -u
dir=${1:-.gpu}
t0=$(date +%s)
mkdir -p /root/stage
[ -f "$dir/sx01" ] && cp "$dir/sx01" /root/stage/
if [ -f "$dir/lean.tar.xz" ]; then  # the reference engine's cases alone (unpacked by an earlier call, kept)
  if [ ! -d /root/site/nixl_cu13 ]; then
    mkdir -p /root/site && python3 -c "import tarfile; tarfile.open('$dir/lean.tar.xz').extractall('/root/site')" ||
      { echo "setup: unpacking the lean site failed"; exit 1; }
  fi
elif [ ! -d /root/site/sglang ]; then
  [ -f /root/stage/sx00 ] || { echo "setup: /root/stage/sx00 is missing (call 1 copies it there)"; exit 1; }
  mkdir -p /root/site && cat /root/stage/sx0* > /root/site.tar.xz &&
    python3 -c "import tarfile; tarfile.open('/root/site.tar.xz').extractall('/root/site')" ||
    { echo "setup: unpacking the site failed"; exit 1; }
  rm -f /root/site.tar.xz
fi
# The project's root too: the benchmarks import the test suite's process helpers (tests.support).
cat > /root/env.sh <<EOT
export PYTHONPATH=/root/site:$(pwd) PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
EOT
source /root/env.sh
if compgen -G "$dir/extra/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /root/site "$dir"/extra/*.whl 2>&1 | tail -2
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 - <<'PY'
import importlib.util
import grpc, nixl_cu13, torch, xxhash  # noqa: F401
sglang = importlib.util.find_spec("sglang") and __import__("sglang").__version__
print("sglang", sglang or "absent (lean site)", "grpc", grpc.__version__, "torch", torch.__version__,
      "gpus", torch.cuda.device_count())
PY
echo "setup: $(( $(date +%s) - t0 )) s"
