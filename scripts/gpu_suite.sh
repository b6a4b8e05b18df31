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
for transport in cuda_ipc nixl; do  # P/D exact vs colocated with each KV transport, forced
  XAVIER_TEST_DEVICE=cuda XAVIER_HANDOFF__TRANSPORT=$transport python3 -m pytest -q -p no:cacheprovider tests/pd \
    2>&1 | tail -n 25 | tee "$out/pd_gpu_tests_$transport.txt"
done
for run in 1 4 0; do  # handoff by transport: runs of 1 and 4 pages, and one contiguous run
  python3 benchmarks/handoff.py --device cuda --reps 3 --tokens 1024,8192,32768 --mean-run $run \
    --modes coalesced,per_page,cuda_ipc --out-dir "$out" --tag "0.5b-run$run" > /dev/null
  python3 benchmarks/handoff.py --device cuda --reps 3 --layers 28 --kv-heads 4 --head-dim 128 \
    --tokens 8192,32768 --mean-run $run --modes coalesced,per_page,cuda_ipc --out-dir "$out" --tag "7b-run$run" > /dev/null
done
model="${XAVIER_BENCH_MODEL:-/tmp/xavier-qwen2.5-0.5b-shape}"
[ -f "$model/config.json" ] || python3 -m xavier_cli.main models make-tiny "$model" --arch qwen2 \
  --shape qwen2.5-0.5b --dtype float16
python3 benchmarks/serving.py --device cuda --model "$model" --concurrency 1 16 32 --max-tokens 64 --run-lengths \
  --out "$out/serving_gpu" > "$out/serving_gpu.stdout" 2> "$out/serving_gpu.stderr"
tail -n 5 "$out/serving_gpu.stderr"
