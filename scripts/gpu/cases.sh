#!/usr/bin/env bash
# On the GPU machine after scripts/gpu/setup.sh (same or a later call): named runs, each writing its JSON to
# $OUT (what a device call brings back: at most 8 files, so pictures are left out) and printing a one-line
# summary per run. Both P/D roles and both replicas share GPU 0 throughout.
#
#   tests             the GPU-marked tests, then the page store's replica tests and the P/D suite's prefix
#                     sharing tests with their KV on the GPU (XAVIER_TEST_DEVICE=cuda)
#   share [REPS [SHAPES [PATHS]]]  page store TTFT, cold / warm from the store / warm local: the warm fetch
#                     READing the store vs copying the writer's pages (--share-prefixes): 7B width at 28
#                     layers at 8,000 tokens, one run per PATHS entry in its order (stand: the pages stand
#                     in the writer's pool, copied without asking; copy: the writer is asked first,
#                     --standing-seconds 0; read: the store is READ; default stand,copy,read), then
#                     0.5B-shaped at 2,000 (read, stand, copy, read); SHAPES: 05b,7b (both, the default),
#                     05b or 7b
#   checkab           page store TTFT, a same-host store read checked as each page lands (one pass, the
#                     default) vs read whole and checked after (--read-then-check), alternating: 7B width at
#                     28 layers at 8,000 tokens (3 reps each), then 0.5B-shaped at 2,000 (5 reps, twice each;
#                     `checkab short`: once each; `checkab 7b`: 7B width alone)
#   partab [gets|short]  page store TTFT, a same-host read into the GPU pool checked as it lands made in parts
#                     of 128 MiB, each part's pages copied to the GPU while the next is read
#                     (--checked-part-bytes 134217728) vs one part, copied once all landed (the default,
#                     pagestore.checked_read_part_bytes 0), alternating on, off, off, on: 7B width at 28
#                     layers at 8,000 tokens (3 reps each; `partab short`: on, off), then 0.5B-shaped at
#                     2,000 once each (one part either way at that size; `partab 7b`: 7B width alone,
#                     on, off, off, on); `partab gets`: instead the page
#                     loop's reads in 1-16 calls (16 threads), then the GB/s gets of `verify` at 7B width
#                     (500 pages) by part size, 0 (one part), 128, 64 and 32 MiB, then 0.5B (125 pages) at
#                     128 MiB and 0
#   loopab SPAWN_C [short]  the page loop's helper threads kept between calls (pagehash.c now) vs
#                     started and joined by every call (SPAWN_C: that loop's source, `git show
#                     5c75b0f:xavier_core/pagestore/pagehash.c`), alternating: the loop's reads of 500
#                     7B-width pages in 1-16 calls (16 threads), the GB/s gets of 125 0.5B-shaped pages into
#                     the GPU pool, then the 0.5B-shaped store TTFT at 2,000 tokens (5 reps): kept, started,
#                     started, kept (`short`: no TTFT)
#   verify            page store gets into a GPU pool (through the pinned host mirror) with and without their
#                     checks, the GB/s points: 125 pages at the 0.5B shape, 500 at 7B width (28 layers)
#   reads             a same-host get's read and check in one pass by thread count (page_checksum.py --reads):
#                     the GB/s the page loop reads at on this host, 1-16 threads, 0-2 busy Python threads
#   verify-ab [SHAPE] verify's gets checked page by page (the GIL held) vs by the native loop, alternating:
#                     0.5B twice each way, 7B width natively once (SHAPE 05b or 7b: that shape's runs alone)
#   profile           a warm local prefix hit's GPU kernels (torch.profiler, benchmarks/prefix_hit.py): 0.5B-shaped
#                     at 2,000 tokens, 7B width at 8 layers at 8,000
#   compileab [REPS [twice]]  page store TTFT at the 0.5B shape (2,000 tokens, REPS reps, default 5) with
#                     the replicas' static step compiled by torch.compile (--compile-static) and eager,
#                     alternating (on, off; `twice`: on, off, off, on)
#   chunk [ARGS]      a prefix hit's suffix (16 rows) as one static step, a page table per row vs one shared
#                     table, eager and graphed (benchmarks/static_chunk.py; ARGS go to it, e.g. --compile):
#                     0.5B-shaped after 2,000 keys, then 7B width at 28 layers after 8,000
#   pd ROUNDS [S [W [ARGS]]]  SGLang P/D: native vs pd, interleaved, ROUNDS rounds, no level started after S
#                     seconds (default 420: a call's 600 s covers the servers' start), W router processes
#                     in each mode (xavier up --router-workers, default 1); ARGS go to sglang_pd.py (e.g.
#                     --concurrency 64; `--modes native@w1,pd@w1,pd --baseline native@w1`: modes of other
#                     router-process counts side by side, each round's ratios over the one named)
#   hicache [SHAPE [ARGS]]  SGLang HiCache on the Xavier store vs SGLang's file L3, 2,000 and 8,000 tokens
#                     (SHAPE: qwen2.5-0.5b, the default, or qwen2.5-7b; ARGS go to sglang_hicache.py,
#                     e.g. --lengths 8000)
#
# usage: bash scripts/gpu/cases.sh CASE [ARGS] [-- CASE [ARGS]]...
# (DEVICE=cpu MODELS=DIR OUT=DIR run the store cases on this machine's CPU: a check of the script.)
set -u
cd "$(dirname "$0")/../.."
[ -f /root/env.sh ] && source /root/env.sh
out=${OUT:-out}
logs=/tmp/gpu-case-logs  # stdout and stderr of each run: $OUT keeps the results alone
models=${MODELS:-/root/models}  # random checkpoints, made once per machine
device=${DEVICE:-cuda}
mkdir -p "$out" "$logs" "$models"
export PYTHONUNBUFFERED=1

gets() {  # one line per GB/s point of a pagestore.py result
  python3 - "$1" <<'PY'
import json, sys
keys = ("pages", "run_length", "read_path", "get_ms", "get_unverified_ms", "get_verify_added_share", "get_rpc_ms",
        "get_nixl_ms", "get_checksum_ms", "get_staging_ms")
for p in json.load(open(sys.argv[1]))["points"]:
    print(sys.argv[1].rsplit("/", 1)[-1], {k: round(p[k], 3) if isinstance(p[k], float) else p[k] for k in keys if k in p})
PY
}

summary() {  # one line of a pagestore.py TTFT result
  python3 - "$1" <<'PY'
import json, sys
t = json.load(open(sys.argv[1]))["ttft"]
keys = ("cold_ms", "warm_store_ms", "warm_local_ms", "speedup_store", "speedup_local", "warm_store_holder_copies",
        "warm_store_static_shared_chunks", "warm_local_static_shared_chunks")
print(sys.argv[1].rsplit("/", 1)[-1], {k: round(t[k], 2) for k in keys if k in t},
      "fetch steps", {k: round(v, 2) for k, v in t.get("warm_store_steps_ms", {}).items() if v},
      "handled", {k: round(v, 2) for k, v in t.get("warm_store_handling_ms", {}).items() if v})
PY
}

store_ttft() {  # TAG SHAPE PREFIX LAYERS REPS [--share-prefixes]
  local tag=$1 shape=$2 prefix=$3 layers=$4 reps=$5; shift 5
  python3 benchmarks/pagestore.py --skip-gbps --device "$device" --shape "$shape" --shape-layers "$layers" \
    --prefix "$prefix" --ttft-reps "$reps" --model-cache "$models" --out-dir "$out" --tag "$tag" "$@" \
    > "$logs/$tag.stdout" 2> "$logs/$tag.stderr" || { echo "$tag failed:"; tail -n 20 "$logs/$tag.stderr"; }
  rm -f "$out/pagestore-$tag.png"
  [ -f "$out/pagestore-$tag.json" ] && summary "$out/pagestore-$tag.json"
}

part_gets() {  # TAG LAYERS SEGMENT_BYTES PAGES REPS PART_MIB: GB/s gets into a GPU pool, read in parts
  local tag=$1 pool=(--pool-device cuda:0)
  [ "$device" = cpu ] && pool=(--stage-host-pool)  # the same staged path, the pool in host memory
  python3 benchmarks/pagestore.py --ttft-reps 0 "${pool[@]}" --read-path direct --layers "$2" \
    --segment-bytes "$3" --pages "$4" --run-lengths "$4" --reps "$5" --checked-part-bytes $(($6 << 20)) \
    --out-dir "$out" --tag "$tag" > "$logs/$tag.stdout" 2> "$logs/$tag.stderr" ||
    tail -n 20 "$logs/$tag.stderr"
  rm -f "$out/pagestore-$tag.png"
  [ -f "$out/pagestore-$tag.json" ] && gets "$out/pagestore-$tag.json"
}

loop_reads() {  # TAG LABEL: the page loop's reads of 500 7B-width pages, 16 threads, whole and in 4-16 calls
  if python3 benchmarks/page_checksum.py --reads --pages 500 --buffers 56 --segment-bytes 16384 \
    --threads 16 --parts 1,4,8,16 --reps 11 > "$out/$1.json" 2> "$logs/$1.stderr"; then
    python3 -c "import json; [print('$2', {k: round(v, 2) for k, v in c['ms'].items()})
      for c in json.load(open('$out/$1.json'))['cases']]"
  else
    tail -n 20 "$logs/$1.stderr"
  fi
}

run_case() {
  local name=$1; shift
  local t0; t0=$(date +%s)
  echo "== $name $* ($(date +%H:%M:%S))"
  case "$name" in
    tests)
      python3 -m pytest -q -p no:cacheprovider -m gpu tests -o timeout=1500 2>&1 | tail -n 8
      XAVIER_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -o timeout=900 \
        tests/pagestore/test_prefix_sharing.py tests/pagestore/test_engines.py tests/pd/test_share_prefix.py \
        2>&1 | tail -n 8
      ;;
    share)
      local reps=${1:-5} shapes=${2:-05b,7b} paths=${3:-stand,copy,read} n=0 path
      if [[ ,$shapes, == *,7b,* ]]; then
        for path in ${paths//,/ }; do
          n=$((n + 1))
          case "$path" in
            stand) store_ttft "share-7b-stand-$n" 7b-width 8000 28 3 --share-prefixes ;;
            copy) store_ttft "share-7b-copy-$n" 7b-width 8000 28 3 --share-prefixes --standing-seconds 0 ;;
            read) store_ttft "share-7b-read-$n" 7b-width 8000 28 3 ;;
            *) echo "unknown share path: $path (stand, copy, read)" ;;
          esac
        done
      fi
      if [[ ,$shapes, == *,05b,* ]]; then
        store_ttft share-05b-read-1 qwen2.5-0.5b 2000 0 "$reps"
        store_ttft share-05b-stand-1 qwen2.5-0.5b 2000 0 "$reps" --share-prefixes
        store_ttft share-05b-copy-1 qwen2.5-0.5b 2000 0 "$reps" --share-prefixes --standing-seconds 0
        store_ttft share-05b-read-2 qwen2.5-0.5b 2000 0 "$reps"
      fi
      ;;
    checkab)
      store_ttft check-7b-onepass-1 7b-width 8000 28 3
      store_ttft check-7b-apart-1 7b-width 8000 28 3 --read-then-check
      [ "${1:-}" = 7b ] && return 0
      store_ttft check-05b-apart-1 qwen2.5-0.5b 2000 0 5 --read-then-check
      store_ttft check-05b-onepass-1 qwen2.5-0.5b 2000 0 5
      [ "${1:-}" = short ] && return 0
      store_ttft check-05b-onepass-2 qwen2.5-0.5b 2000 0 5
      store_ttft check-05b-apart-2 qwen2.5-0.5b 2000 0 5 --read-then-check
      ;;
    partab)
      if [ "${1:-}" = gets ]; then
        # first the page loop alone, 500 pages of the 7B-width pool's shape on 16 threads, in 1-16 calls:
        # what one more call (one more part) costs on this host
        loop_reads page-reads-parts parts
        local mib
        for mib in 0 128 64 32; do
          part_gets "part-7b-$mib" 28 16384 500 5 "$mib"
        done
        part_gets part-05b-128 24 4096 125 7 128
        part_gets part-05b-0 24 4096 125 7 0
        return 0
      fi
      store_ttft part-7b-on-1 7b-width 8000 28 3 --checked-part-bytes $((128 << 20))
      store_ttft part-7b-off-1 7b-width 8000 28 3 --checked-part-bytes 0
      if [ "${1:-}" != short ]; then
        store_ttft part-7b-off-2 7b-width 8000 28 3 --checked-part-bytes 0
        store_ttft part-7b-on-2 7b-width 8000 28 3 --checked-part-bytes $((128 << 20))
      fi
      [ "${1:-}" = 7b ] && return 0
      store_ttft part-05b-off-1 qwen2.5-0.5b 2000 0 5 --checked-part-bytes 0
      store_ttft part-05b-on-1 qwen2.5-0.5b 2000 0 5 --checked-part-bytes $((128 << 20))
      ;;
    loopab)
      local spawn=${1:?loopab takes the source of the loop that starts its threads per call}
      local kept=/tmp/pagehash-kept.c src=xavier_core/pagestore/pagehash.c which n=0
      cp "$src" "$kept"
      for which in kept spawn spawn kept; do
        n=$((n + 1))
        [ "$which" = spawn ] && cp "$spawn" "$src"
        loop_reads "page-reads-loop-$which-$n" "$which parts"
        part_gets "loop-05b-$which-$n" 24 4096 125 7 0
        cp "$kept" "$src"
      done
      [ "${2:-}" = short ] && return 0
      for which in kept spawn spawn kept; do
        n=$((n + 1))
        [ "$which" = spawn ] && cp "$spawn" "$src"
        store_ttft "loop-05b-ttft-$which-$n" qwen2.5-0.5b 2000 0 5
        cp "$kept" "$src"
      done
      ;;
    verify)
      for shape in "05b 24 4096 125 7" "7b 28 16384 500 5"; do
        set -- $shape
        python3 benchmarks/pagestore.py --ttft-reps 0 --pool-device cuda:0 --read-path direct --layers "$2" \
          --segment-bytes "$3" --pages "$4" --run-lengths "$4" --reps "$5" --out-dir "$out" --tag "verify-$1" \
          > "$logs/verify-$1.stdout" 2> "$logs/verify-$1.stderr" || tail -n 20 "$logs/verify-$1.stderr"
        rm -f "$out/pagestore-verify-$1.png"
        [ -f "$out/pagestore-verify-$1.json" ] && gets "$out/pagestore-verify-$1.json"
      done
      ;;
    reads)
      # a same-host get's read and check in one pass (the page loop) by thread count, quiet and beside
      # busy Python threads, against one plain copy: 500 pages of Qwen2.5-7B's page-first shape
      if python3 benchmarks/page_checksum.py --reads --pages 500 --buffers 2 --segment-bytes 458752 \
        --threads 1,2,4,8,16 --busy-python 0,1,2 --reps 5 > "$out/page-reads.json" 2> "$logs/reads.stderr"; then
        python3 -c "import json; [print(c['busy_python'], {k: round(v, 1) for k, v in c['gbps'].items()})
          for c in json.load(open('$out/page-reads.json'))['cases']]"
      else
        tail -n 20 "$logs/reads.stderr"
      fi
      ;;
    verify-ab)
      # the same gets as verify, checked page by page with the GIL held (XAVIER_NATIVE_PAGEHASH=0, the
      # way before the native loop) and natively, alternating: 0.5B twice each, 7B width natively
      local only=${1:-}
      for run in "05b 0 1" "05b 1 1" "7b 1 1" "05b 1 2" "05b 0 2"; do
        set -- $run
        [ -n "$only" ] && [ "$1" != "$only" ] && continue
        local geo="24 4096 125 7"; [ "$1" = 7b ] && geo="28 16384 500 5"
        local tag="verify-$1-native$2-$3"
        set -- $geo
        XAVIER_NATIVE_PAGEHASH=$(echo "$run" | cut -d' ' -f2) python3 benchmarks/pagestore.py --ttft-reps 0 \
          --pool-device cuda:0 --read-path direct --layers "$1" --segment-bytes "$2" --pages "$3" \
          --run-lengths "$3" --reps "$4" --out-dir "$out" --tag "$tag" \
          > "$logs/$tag.stdout" 2> "$logs/$tag.stderr" || tail -n 20 "$logs/$tag.stderr"
        rm -f "$out/pagestore-$tag.png"
        [ -f "$out/pagestore-$tag.json" ] && gets "$out/pagestore-$tag.json"
      done
      ;;
    profile)
      for shape in "05b qwen2.5-0.5b 0 2000" "7b 7b-width 8 8000"; do
        set -- $shape
        python3 benchmarks/prefix_hit.py --device "$device" --shape "$2" --layers "$3" --prefix "$4" --reps 3 \
          --torch-profile > "$out/prefix-hit-profile-$1.json" 2> "$logs/profile-$1.stderr" ||
          tail -n 20 "$logs/profile-$1.stderr"
        python3 - "$out/prefix-hit-profile-$1.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); t = d["torch_profile"]
print(sys.argv[1].rsplit("/", 1)[-1], "cold", round(d["cold_ms"], 2), "warm", round(d["warm_local_ms"], 2),
      "profiled", round(t["warm_ms"], 2), "gpu busy", round(t["gpu_busy_ms"], 2), "launches", t["gpu_launches"])
for k in t["top_gpu"][:12]:
    print("  ", round(k["ms"], 3), k["count"], k["name"])
PY
      done
      ;;
    compileab)
      # the 0.5B store TTFT with the replicas' static step compiled (engine.compile) and eager, alternating
      local reps=${1:-5}
      store_ttft compile-05b-on-1 qwen2.5-0.5b 2000 0 "$reps" --compile-static
      store_ttft compile-05b-off-1 qwen2.5-0.5b 2000 0 "$reps"
      [ "${2:-}" = twice ] && store_ttft compile-05b-off-2 qwen2.5-0.5b 2000 0 "$reps" &&
        store_ttft compile-05b-on-2 qwen2.5-0.5b 2000 0 "$reps" --compile-static
      ;;
    chunk)
      local extra=("$@")
      for shape in "05b qwen2.5-0.5b 0 2000" "7b 7b-width 28 8000"; do
        set -- $shape "${extra[@]}"
        python3 benchmarks/static_chunk.py --device "$device" --shape "$2" --layers "$3" --prefix "$4" \
          "${@:5}" --out "$out/static-chunk-$1.json" > /dev/null 2> "$logs/chunk-$1.stderr" || tail -n 20 "$logs/chunk-$1.stderr"
        [ -f "$out/static-chunk-$1.json" ] && python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print(
          sys.argv[1].rsplit('/', 1)[-1], {k: round(v, 3) for k, v in d['ms'].items()}, 'rows/shared',
          {k: round(v, 2) for k, v in d['rows_over_shared'].items()}, 'diff', d['max_abs_logit_diff'])" "$out/static-chunk-$1.json"
      done
      ;;
    pd)
      local rounds=${1:-5} stop=${2:-420} workers=${3:-1}; shift $(( $# > 3 ? 3 : $# ))
      python3 benchmarks/sglang_pd.py --gpus 0,0 --modes native,pd --interleave --rounds "$rounds" \
        --stop-after "$stop" --router-workers "$workers" "$@" --rows-log "$out/sglang-pd-rows.jsonl" --out "$out/sglang-pd" \
        > "$logs/pd.stdout" 2> "$logs/pd.stderr" || tail -n 20 "$logs/pd.stderr"
      rm -f "$out/sglang-pd.png"
      grep -h '"started_s"\|"warm_up"' "$logs/pd.stderr" | cut -c1-200  # where the call's time went
      tail -c 3000 "$logs/pd.stdout"
      ;;
    hicache)
      local shape=${1:-qwen2.5-0.5b}; shift $(( $# > 0 ? 1 : 0 ))
      python3 benchmarks/sglang_hicache.py --shape "$shape" --gpus 0,0 --out "$out/sglang-hicache-$shape" "$@" \
        > "$logs/hicache.stdout" 2> "$logs/hicache.stderr" || tail -n 20 "$logs/hicache.stderr"
      rm -f "$out/sglang-hicache-$shape.png"
      tail -c 3000 "$logs/hicache.stdout"
      ;;
    *) echo "unknown case: $name (tests, share, checkab, partab, loopab, verify, reads, verify-ab, profile, pd, hicache)"; return 2 ;;
  esac
  echo "== $name: $(( $(date +%s) - t0 )) s"
}

args=("$@")
while [ ${#args[@]} -gt 0 ]; do
  one=()
  while [ ${#args[@]} -gt 0 ] && [ "${args[0]}" != "--" ]; do one+=("${args[0]}"); args=("${args[@]:1}"); done
  [ ${#args[@]} -gt 0 ] && args=("${args[@]:1}")
  [ ${#one[@]} -gt 0 ] && run_case "${one[@]}"
done
