#!/usr/bin/env bash
# GPU checks on a CUDA host with the project's dependencies importable: the GPU-marked tests, the P/D
# suite GPU to GPU (prefill on cuda:0, decode on the last GPU; NIXL VRAM reads), and the serving
# benchmark (pd vs colocated) on a Qwen2.5-0.5B-shaped fp16 checkpoint. Results go to $1 (default out/).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpus.txt"
python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -n 15 | tee "$out/gpu_tests.txt"
XAVIER_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/pd 2>&1 | tail -n 25 | tee "$out/pd_gpu_tests.txt"
model="${XAVIER_BENCH_MODEL:-/tmp/xavier-qwen2.5-0.5b-shape}"
[ -f "$model/config.json" ] || python3 -m xavier_cli.main models make-tiny "$model" --arch qwen2 \
  --shape qwen2.5-0.5b --dtype float16
python3 benchmarks/serving.py --device cuda --model "$model" --concurrency 1 16 32 --max-tokens 64 \
  --out "$out/serving_gpu" > "$out/serving_gpu.stdout" 2> "$out/serving_gpu.stderr"
tail -n 5 "$out/serving_gpu.stderr"
