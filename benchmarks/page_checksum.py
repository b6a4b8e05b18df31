"""The host checksum pass of a store get, alone: `local_page_checksums` over pages of a buffer-major
mirror (`(buffers, slots, bytes)`, the layout a GPU pool's reads land in), against the hash threads it
may use and the segment size, with XXH3-128 over the same bytes in one call as the floor.

No store, no NIXL: what it measures is whether spreading a get's pages over threads pays at a given
segment size (the hash releases the GIL only inside each segment's update; a call is cut into at
most one part per 4 MiB, so 24 MiB uses 6 threads at most), each thread count forced and then as the
client runs it (`as_configured`: one thread below `layout._MIN_UNIT_BYTES` a segment). Medians of
`--reps`, alternating the cases every rep. Prints JSON.
Example: `python benchmarks/page_checksum.py --pages 125 --buffers 48 --segment-bytes 1024,4096,65536`.

`--methods` compares instead how a page of several segments is hashed (what `local_page_checksums` picks
by `layout._NO_COPY_SEGMENT_BYTES` and `layout._HELD_PAGE_BYTES`): `joined`, the segments copied into one
bytes object and hashed in one call, vs `streamed`, XXH3's streaming calls over the segments in place with
the GIL held, vs `native`, the built loop over all pages in one call per thread without the GIL
(`xavier_core/pagestore/native.py`, what a get uses where it is built); with `--busy-python N` threads
running Python without pause beside it, as SGLang's scheduler runs beside its HiCache thread (a thread
that lets go of the GIL waits up to a switch interval to get it back there).

`--reads` times a same-host get's read and check together, as a host pool's get makes them
(`DirectArena.read_checked`: the page loop reads each page with `process_vm_readv` and hashes it while in
cache), forced onto each of `--threads` threads, beside `--busy-python` spinning threads, against a plain
copy of the same bytes on one thread (`np.copyto`) and the pages read by the loop with nothing hashed: so
it says how the read scales with threads on a host, and what the check adds to it. The pages are read out
of this process's own memory (an "arena" of `--pages` pages, segment-major as the store keeps them, in
NumPy's memory with the huge pages it asks for), which takes the kernel the same path as the store's.
With `--parts 1,4,8` each thread count's read is also made in that many consecutive calls of the loop (a
GPU pool's read in parts, `ClientSettings.checked_read_part_bytes`): what one more call costs (its threads are
started and joined per call, and each call ends on its slowest thread).
Example: `python benchmarks/page_checksum.py --reads --pages 500 --buffers 56 --segment-bytes 16384
--threads 2 --parts 1,4,8,16`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash
from busy import busy_python  # benchmarks/busy.py, beside this

from xavier_core.pagestore import layout, native
from xavier_core.transfer.common.buffers import KvBuffer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pages", type=int, default=125)
    p.add_argument("--buffers", type=int, default=48)
    p.add_argument("--segment-bytes", default="4096")
    p.add_argument("--threads", default="1,2,4,8")
    p.add_argument("--reps", type=int, default=21)
    p.add_argument(
        "--methods", action="store_true", help="joined vs streamed vs native page hashes (see above)"
    )
    p.add_argument(
        "--reads", action="store_true", help="a same-host get's read and check in one pass, by thread count"
    )
    p.add_argument(
        "--parts", default="1", help="with --reads: the read made in this many consecutive calls, e.g. 1,4,8"
    )
    p.add_argument(
        "--busy-python", default="0", help="with --methods or --reads: busy Python threads beside, e.g. 0,1,2"
    )
    p.add_argument(
        "--switch-interval-ms",
        type=float,
        default=0.0,
        help="the GIL switch interval while it runs (0: Python's own; the HiCache backend sets 0.2)",
    )
    return p.parse_args(argv)


def methods(pages: int, nbuf: int, seg: int, busy: int, reps: int) -> dict[str, Any]:
    """`joined` vs `streamed` hashing of `pages` pages of `nbuf` segments, `busy` Python threads beside,
    alternating every rep."""
    slots = pages + 8
    mirror = np.random.default_rng(seg).integers(0, 256, (nbuf, slots, seg), dtype=np.uint8)
    bufs = [KvBuffer(mirror[b].ctypes.data, slots * seg, seg, "cpu") for b in range(nbuf)]
    wanted = list(range(3, 3 + pages))
    configured = (layout._NO_COPY_SEGMENT_BYTES, layout._HELD_PAGE_BYTES)
    times: dict[str, list[float]] = {}
    ref: list[bytes] | None = None
    built = native.native_hash
    with busy_python(busy):
        try:
            for rep in range(reps):
                order = [("joined", 1 << 62), ("streamed", 0), *([("native", 0)] if built() else [])]
                for name, threshold in order if rep % 2 == 0 else order[::-1]:
                    layout._NO_COPY_SEGMENT_BYTES = layout._HELD_PAGE_BYTES = threshold
                    native.native_hash = built if name == "native" else _no_native  # type: ignore[assignment]
                    start = time.perf_counter()
                    got = layout.local_page_checksums(bufs, wanted)
                    times.setdefault(name, []).append(time.perf_counter() - start)
                    if ref is not None and got != ref:
                        raise RuntimeError("the methods' checksums differ")
                    ref = got
        finally:
            native.native_hash = built  # type: ignore[assignment]
            layout._NO_COPY_SEGMENT_BYTES, layout._HELD_PAGE_BYTES = configured
    out = _result(pages, nbuf, seg, busy, times)
    ms = out["ms"]
    return {
        **out,
        "joined_over_streamed": ms["joined"] / ms["streamed"],
        **({"streamed_over_native": ms["streamed"] / ms["native"]} if "native" in ms else {}),
    }


def _result(pages: int, nbuf: int, seg: int, busy: int, times: dict[str, list[float]]) -> dict[str, Any]:
    """A case's shape and each way's median milliseconds (`ms`), as `methods` and `reads` report them."""
    return {
        "pages": pages,
        "buffers": nbuf,
        "segment_bytes": seg,
        "busy_python": busy,
        "ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
    }


def reads(
    pages: int, nbuf: int, seg: int, threads: list[int], busy: int, reps: int, parts: Sequence[int] = (1,)
) -> dict[str, Any]:
    """A get's read and check in one pass (`NativeHash.read_checksums`) on each of `threads`, in each
    number of consecutive calls of `parts`, `busy` Python threads beside, against one `np.copyto` of the
    same bytes; alternating every rep."""
    built = native.native_hash()
    if built is None:
        raise RuntimeError("the native page loop is not built here")
    arena = np.random.default_rng(seg).integers(0, 256, (nbuf, pages, seg), dtype=np.uint8)
    pool = np.zeros((pages, nbuf, seg), dtype=np.uint8)  # page-first, as SGLang's host pool
    rows = np.empty((pages, nbuf, 3), dtype=np.uint64)
    rows[:, :, 0] = arena.ctypes.data + (np.arange(nbuf, dtype=np.uint64) * np.uint64(pages * seg))[None, :]
    rows[:, :, 0] += (np.arange(pages, dtype=np.uint64) * np.uint64(seg))[:, None]
    rows[:, :, 1] = pool.ctypes.data + (np.arange(pages * nbuf, dtype=np.uint64) * np.uint64(seg)).reshape(
        pages, nbuf
    )
    rows[:, :, 2] = seg
    want = [xxhash.xxh3_128_digest(np.ascontiguousarray(arena[:, p]).tobytes()) for p in range(pages)]
    times: dict[str, list[float]] = {}
    with busy_python(busy):
        for rep in range(reps):
            order: list[tuple[str, int, int]] = [
                *((f"threads_{t}" + (f"_parts_{n}" if n > 1 else ""), t, n) for t in threads for n in parts),
                ("copyto", 0, 1),
            ]
            for name, t, n in order if rep % 2 == 0 else order[::-1]:
                pool[:] = 0
                start = time.perf_counter()
                if t:
                    got = []
                    for part in np.array_split(rows, n):
                        got += built.read_checksums(os.getpid(), np.ascontiguousarray(part), t)
                else:
                    np.copyto(pool, arena.transpose(1, 0, 2))
                times.setdefault(name, []).append(time.perf_counter() - start)
                if t and got != want:
                    raise RuntimeError("a read's checksums differ from the arena's")
    nbytes = pages * nbuf * seg
    out = _result(pages, nbuf, seg, busy, times)
    return {
        **out,
        "bytes": nbytes,
        "gbps": {k: nbytes / v / 1e6 for k, v in out["ms"].items()},
    }


def _no_native() -> None:
    return None


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
    if args.switch_interval_ms > 0:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    if args.reads:
        threads = [int(t) for t in args.threads.split(",")]
        busy = [int(x) for x in args.busy_python.split(",")]
        cases = [
            reads(
                args.pages,
                args.buffers,
                int(seg),
                threads,
                b,
                args.reps,
                [int(n) for n in args.parts.split(",")],
            )
            for seg in args.segment_bytes.split(",")
            for b in busy
        ]
        json.dump({"benchmark": "page_reads", "cpus": os.cpu_count(), "cases": cases}, sys.stdout, indent=2)
        print()
        return 0
    if args.methods:
        sizes, busy = (
            [int(x) for x in args.segment_bytes.split(",")],
            [int(x) for x in args.busy_python.split(",")],
        )
        rows = [methods(args.pages, args.buffers, seg, b, args.reps) for seg in sizes for b in busy]
        json.dump(
            {
                "benchmark": "page_checksum_methods",
                "cpus": os.cpu_count(),
                "switch_interval_ms": sys.getswitchinterval() * 1e3,
                "cases": rows,
            },
            sys.stdout,
            indent=2,
        )
        print()
        return 0
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
