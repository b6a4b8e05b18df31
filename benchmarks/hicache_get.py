"""SGLang HiCache's get on the Xavier page store, on CPU: SGLang's own host pool, a real store process.

Replica A's backend writes `--pages` pages of SGLang's `MHATokenToKVPoolHost` (`--layout`, page-first unless
asked; the geometry of `--shape`, fp16) into a real `xavier-pagestore` process; replica B's backend gets
them into its own host pool, as SGLang's prefetch thread does (`batch_get_v1`). Per rep: the get's wall
time, its fetch steps (the store client's `xavier_pagestore_client_fetch_seconds{step}`: GetPages, READ,
checksum pass, ...), the same get with its checks taken off (the pages as they land) and, where the
native checksum loop is built (`xavier_core/pagestore/native.py`), the same get read first and then
checked by the loop (`apart`; by default a same-host read checks each page as it lands) and read first,
then checked page by page with the GIL held (`held`, the way before the loop), in rotating order, so what
verification adds to a HiCache get, each way, is measured in the same run. The first get of
each backend loads the store's endpoint and is left out. No GPU: what a get costs in the backend and the
store client, without SGLang's scheduler beside it (`--busy-python N` puts N threads of pure Python there,
as a busy scheduler holds the GIL; `--read-path` picks how B's client reads the store).

Needs the SGLang conformance environment (`tests/sglang/run_conformance.sh` builds it):

    ROOT=$(pwd); PYTHONPATH=$ROOT:$ROOT/services:$ROOT/clients:$ROOT/protos/python:$ROOT/engines \\
        build/sglang-venv/bin/python benchmarks/hicache_get.py --out docs/results/hicache-get-cpu

(prefix PYTHONPATH with build/sglang-venv/overlay-0.5.17: for SGLang 0.5.17). Prints JSON; writes <out>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from busy import busy_python  # noqa: E402  (benchmarks/busy.py, beside this)
from pagestore import fetch_steps, unchecked_verifier, unhashed_read  # noqa: E402  (benchmarks/pagestore.py, beside this)

SHAPES = {  # layers, KV heads, head dim (Qwen2.5's)
    "qwen2.5-0.5b": (24, 2, 64),
    "7b-width-4": (4, 4, 128),
    "qwen2.5-7b": (28, 4, 128),
}
PAGE_TOKENS = 16


def _get(backend: Any, keys: list[str], dst: Any, batch: int) -> tuple[float, float, list[bool]]:
    """(seconds looking up, seconds getting, each page found) of one get of `keys` into host indices
    `dst`: one `batch_get_v1` of them all, or with `batch`, as SGLang's prefetch makes it: `batch_exists`
    of every `batch` keys in turn (its prefetch thread), then `batch_get_v1` of each (its I/O thread)."""
    if not batch:
        t = time.perf_counter()
        got = backend.batch_get_v1(keys, dst)
        return 0.0, time.perf_counter() - t, got
    cuts = range(0, len(keys), batch)
    t = time.perf_counter()
    for at in cuts:
        backend.batch_exists(keys[at : at + batch])
    looked_up = time.perf_counter() - t
    t = time.perf_counter()
    got = []
    for at in cuts:
        got += backend.batch_get_v1(keys[at : at + batch], dst[at * PAGE_TOKENS : (at + batch) * PAGE_TOKENS])
    return looked_up, time.perf_counter() - t, got


def _median_steps(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    names = {k for r in rows for k in r.get(key, {})}
    return {k: statistics.median(r.get(key, {}).get(k, 0.0) for r in rows) for k in sorted(names)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    p.add_argument("--pages", type=int, default=125, help="pages per get (125: 2,000 tokens)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument(
        "--read-piece-bytes",
        type=int,
        default=None,
        help="B's store client reads in pieces of this many bytes, each checked while the next moves "
        "(default: the client's own setting)",
    )
    p.add_argument(
        "--busy-python",
        type=int,
        default=0,
        metavar="N",
        help="N threads running Python without pause beside the get, as SGLang's scheduler runs beside "
        "its HiCache thread (0: none)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=0,
        help="pages per lookup and get, as SGLang's prefetch makes them (its STORAGE_BATCH_SIZE is 128): "
        "every batch looked up (batch_exists), then each got; 0, the default: one get of every page",
    )
    p.add_argument(
        "--read-path",
        choices=("default", "direct", "nixl"),
        default="default",
        help="how B's client reads the store: its setting (default), straight out of the store's memory, or "
        "by NIXL READs",
    )
    p.add_argument(
        "--layout",
        choices=("page_first", "layer_first"),
        default="page_first",
        help="both host pools' layout (SGLang's --hicache-mem-layout): page_first, a page's K of every "
        "layer in one range and its V in another, or layer_first, one range per layer's K and V",
    )
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "hicache-get-cpu")
    args = p.parse_args()
    spinning = contextlib.ExitStack()  # closed when the gets end
    spinning.enter_context(busy_python(args.busy_python))
    import sglang

    import tests.sglang.test_hicache as hc
    from tests.pagestore.support import start_store
    from xavier_core.engine.tiny import make_tiny
    from xavier_core.pagestore import native

    layers, heads, dim = SHAPES[args.shape]
    hc.PAGE = PAGE_TOKENS  # the keys' page size (SGLang's hash chain)
    work = Path(tempfile.mkdtemp(prefix="hicache-get-"))
    # The KV geometry alone matters here (layers, KV heads, head dim): as many query heads as KV heads keeps
    # the checkpoint small, where Qwen2.5-7B's 28 query heads made a 1.6 GB one to build and fingerprint.
    model = make_tiny(
        work / "model",
        "qwen2",
        dtype="float16",
        layers=layers,
        hidden=heads * dim,
        heads=heads,
        kv_heads=heads,
    )
    page_bytes = 2 * PAGE_TOKENS * layers * heads * dim * 2
    tokens = 2 * args.pages * PAGE_TOKENS
    store = start_store(work / "store", arena=max(256 << 20, 4 * args.pages * page_bytes), chunk=16 << 20)
    rows: list[dict[str, Any]] = []
    try:
        a_pool, b_pool = (
            hc.host_pool(seed, layers, heads, dim, PAGE_TOKENS, tokens, torch.float16, args.layout)
            for seed in (1, None)
        )
        a, b = hc.backend(store.address, model, a_pool), hc.backend(store.address, model, b_pool)
        if args.read_piece_bytes is not None:
            b.client.settings = dataclasses.replace(b.client.settings, read_piece_bytes=args.read_piece_bytes)
        if args.read_path != "default":  # before the first get, which maps the store's arena or not
            b.client.conn.same_host_reads = args.read_path == "direct"
        real, settings, real_read = b.client._verifier, b.client.settings, b.client._read_checked
        built = native.native_hash
        # checked: as the client checks (where the native loop is built and the store's memory is read
        # straight, each page checked as it lands); apart: read first, then checked by the native loop;
        # held: read first, then checked page by page with the GIL held (the way before the loop);
        # unchecked: where the loop is built, the same read by the same loop with the hashing left out
        # (`unhashed_read`), else read first, the pages taken as they land. Rotated every rep.
        # loop (with --batch): checked as it lands, but each get made on the client's loop, not on the
        # calling thread (`fetch_here`).
        modes = ["checked", "unchecked", *(["apart", "held"] if built() is not None else [])]
        modes += ["loop"] if args.batch and built() is not None else []
        here = b.client.fetch_here
        for rep in range(args.reps + 1):
            keys = hc.sglang_keys(args.pages, first_token=1_000_000 * (rep + 1))
            src = a_pool.alloc(args.pages * PAGE_TOKENS)
            if a.batch_set_v1(keys, src) != [True] * args.pages:
                raise RuntimeError("the write-through did not store every page")
            row: dict[str, Any] = {"rep": rep}
            for mode in modes[rep % len(modes) :] + modes[: rep % len(modes)]:
                unhashed = mode == "unchecked" and built() is not None
                b.client._verifier = (
                    unchecked_verifier(b.client) if mode == "unchecked" and not unhashed else real
                )
                b.client._read_checked = unhashed_read(b.client) if unhashed else real_read  # type: ignore[method-assign]
                b.client.settings = dataclasses.replace(
                    settings, check_while_reading=mode in ("checked", "loop") or unhashed
                )
                b.client.fetch_here = (lambda *_: None) if mode == "loop" else here  # type: ignore[method-assign]
                native.native_hash = _no_native if mode == "held" else built  # type: ignore[assignment]
                dst = b_pool.alloc(args.pages * PAGE_TOKENS)
                before = fetch_steps()
                looked_up, spent, got = _get(b, keys, dst, args.batch)
                after = fetch_steps()
                b_pool.free(dst)
                if got != [True] * args.pages:
                    raise RuntimeError(f"the get found {got.count(True)} of {args.pages} pages")
                steps = {k: 1e3 * (v - before[k]) for k, v in after.items() if v > before[k]}
                suffix = "" if mode == "checked" else f"_{mode}"
                row[f"get{suffix}_ms"] = 1e3 * spent
                row[f"steps{suffix}_ms"] = steps
                if args.batch:
                    row[f"exists{suffix}_ms"] = 1e3 * looked_up
            b.client._verifier, b.client.settings, b.client.fetch_here = real, settings, here  # type: ignore[method-assign]
            b.client._read_checked = real_read  # type: ignore[method-assign]
            native.native_hash = built  # type: ignore[assignment]
            a_pool.free(src)
            if rep:  # the first get of a backend loads the store's endpoint
                rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        b_settings = b.client.settings.read_piece_bytes
        direct_reads = b.client.counters.direct_reads
        segments = len(b.client.buffers)  # the store's segments a page: one per host pool pointer
        a.close()
        b.close()
    finally:
        spinning.close()
        store.stop()
    get = statistics.median(r["get_ms"] for r in rows)
    plain = statistics.median(r["get_unchecked_ms"] for r in rows)
    held = statistics.median(r["get_held_ms"] for r in rows) if "get_held_ms" in rows[0] else None
    apart = statistics.median(r["get_apart_ms"] for r in rows) if "get_apart_ms" in rows[0] else None
    on_loop = statistics.median(r["get_loop_ms"] for r in rows) if "get_loop_ms" in rows[0] else None
    steps = _median_steps(rows, "steps_ms")
    nbytes = args.pages * page_bytes
    result = {
        "benchmark": "hicache_get",
        "sglang": sglang.__version__,
        "shape": args.shape,
        "pages": args.pages,
        "layout": args.layout,
        "segments_per_page": segments,
        "busy_python_threads": args.busy_python,
        "read_path": args.read_path,
        "direct_reads": direct_reads,
        "read_piece_bytes": b_settings,
        "bytes": nbytes,
        "reps": len(rows),
        "get_ms": get,
        "get_gbps": nbytes / get / 1e6,
        "get_unchecked_ms": plain,
        "verify_added_share": 1 - plain / get,
        "native_checks": built() is not None,
        "batch": args.batch,
        "exists_ms": statistics.median(r.get("exists_ms", 0.0) for r in rows),
        "get_loop_ms": on_loop,
        "exists_loop_ms": statistics.median(r["exists_loop_ms"] for r in rows) if on_loop else None,
        "get_apart_ms": apart,
        "verify_apart_added_share": None if apart is None else 1 - plain / apart,
        "steps_apart_ms": _median_steps(rows, "steps_apart_ms"),
        "get_held_ms": held,
        "verify_held_added_share": None if held is None else 1 - plain / held,
        "steps_ms": steps,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    return 0


def _no_native() -> None:
    return None


if __name__ == "__main__":
    raise SystemExit(main())
