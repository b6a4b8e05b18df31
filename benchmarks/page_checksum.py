"""The host checksum pass of a store get, alone: `local_page_checksums` over pages of a buffer-major
mirror (`(buffers, slots, bytes)`, the layout a GPU pool's reads land in), against the hash threads it
may use and the segment size, with XXH3-128 over the same bytes in one call as the floor.

No store, no NIXL: what it measures is whether spreading a get's pages over threads pays at a given
segment size (the hash releases the GIL only inside each segment's update; a call is cut into at
most one part per 4 MiB, so 24 MiB uses 6 threads at most), each thread count forced and then as the
client runs it (`as_configured`: one thread below `layout._MIN_UNIT_BYTES` a segment). Medians of
`--reps`, alternating the cases every rep. Prints JSON.
Example: `python benchmarks/page_checksum.py --pages 125 --buffers 48 --segment-bytes 1024,4096,65536`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
import xxhash

from xavier_core.pagestore import layout
from xavier_core.transfer.common.buffers import KvBuffer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pages", type=int, default=125)
    p.add_argument("--buffers", type=int, default=48)
    p.add_argument("--segment-bytes", default="4096")
    p.add_argument("--threads", default="1,2,4,8")
    p.add_argument("--reps", type=int, default=21)
    return p.parse_args(argv)


def case(pages: int, nbuf: int, seg: int, threads: list[int], reps: int) -> dict[str, Any]:
    slots = pages + 8
    mirror = np.random.default_rng(seg).integers(0, 256, (nbuf, slots, seg), dtype=np.uint8)
    bufs = [KvBuffer(mirror[b].ctypes.data, slots * seg, seg, "cpu") for b in range(nbuf)]
    wanted = list(range(3, 3 + pages))  # a run of slots, as a lease takes them
    contiguous = np.ascontiguousarray(mirror[:, 3 : 3 + pages])
    configured = (layout._HASH_THREADS, layout._MIN_UNIT_BYTES)
    times: dict[str, list[float]] = {}
    ref = layout.local_page_checksums(bufs, wanted)
    for _ in range(reps):
        # Forced onto t threads whatever the segment size, then as the client runs it.
        for name, t, unit in [*((f"threads_{t}", t, 0) for t in threads), ("as_configured", *configured)]:
            layout._HASH_THREADS, layout._MIN_UNIT_BYTES = t, unit
            layout._hash_pool.cache_clear()
            start = time.perf_counter()
            got = layout.local_page_checksums(bufs, wanted)
            times.setdefault(name, []).append(time.perf_counter() - start)
            if got != ref:
                raise RuntimeError("checksums differ between thread counts")
        start = time.perf_counter()
        xxhash.xxh3_128_digest(contiguous)
        times.setdefault("one_call", []).append(time.perf_counter() - start)
    layout._HASH_THREADS, layout._MIN_UNIT_BYTES = configured
    layout._hash_pool.cache_clear()
    nbytes = pages * nbuf * seg
    return {
        "pages": pages,
        "buffers": nbuf,
        "segment_bytes": seg,
        "bytes": nbytes,
        "ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
        "gbps": {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    out = {
        "benchmark": "page_checksum",
        "cpus": os.cpu_count(),
        "cases": [
            case(args.pages, args.buffers, int(s), threads, args.reps) for s in args.segment_bytes.split(",")
        ],
    }
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
