"""Page geometry shared by the page store and its clients: segments, arena spans, checksums.

A store page is one page index of every KV buffer of a replica (layer 0 K, layer 0 V, ...): one *segment*
per buffer. The arena keeps a namespace's pages in chunks laid out segment-major, so a run of consecutive
slots is one contiguous range per segment and travels as one NIXL descriptor per segment, whatever the
number of pages in the run (the descriptor count, not the link, bounds NIXL throughput).
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt
import xxhash

from xavier_core.pagestore import native
from xavier_core.transfer.common import runs
from xavier_core.transfer.common.buffers import KvBuffer
from xavier_core.transfer.common.errors import InvalidPagesError

CHECKSUM_BYTES = 16
KEY_BYTES = 32
_T = TypeVar("_T")
_R = TypeVar("_R")
_HASH_THREADS = min(8, os.cpu_count() or 1)
_BYTES_PER_THREAD = 4 << 20
_MIN_UNIT_BYTES = 128 << 10
_NO_COPY_SEGMENT_BYTES = 64 << 10
"""Pages whose segments are all at least this long are hashed in place by XXH3's own streaming calls made
with the GIL held (`_held_xxh3`); shorter segments cost more in calls than a joined copy does."""
_JOIN_BYTES = 1 << 20
"""Pages up to this size are checked as one joined copy and one one-shot digest, both under the GIL
(CPython's bytes.join keeps it below 1 MiB, the one-shot digest always): see `local_page_checksums`."""
_HELD_PAGE_BYTES = 512 << 10
"""Pages larger than this are hashed in place by `_held_xxh3` whatever their segments: joined, a 917 KiB
page (56 segments of 16 KiB, Qwen2.5-7B's) beside one busy Python thread took 10x as long (500 pages: 1,629
vs 157 ms; quiet 60 vs 68.5 ms; `docs/results/page-checksum-methods-cpu.json`)."""


@dataclass(frozen=True)
class Span:
    """`count` consecutive slots from `first_slot` of the chunk at `chunk_address` (`chunk_slots` slots)."""

    chunk_address: int
    chunk_slots: int
    first_slot: int
    count: int


@dataclass(frozen=True)
class PageGeometry:
    """Bytes of each segment of one page, in buffer order."""

    segment_bytes: tuple[int, ...]

    @property
    def page_bytes(self) -> int:
        return sum(self.segment_bytes)

    def segment_offsets(self) -> npt.NDArray[np.uint64]:
        """Offset of each segment inside one slot's worth of a chunk row (the prefix sums)."""
        sizes = np.asarray(self.segment_bytes, dtype=np.uint64)
        return np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.uint64)

    def slot_addresses(self, span_base: int, chunk_slots: int, slot: int) -> list[int]:
        """Address of each segment of `slot` in a chunk at `span_base` (the layout the proto documents)."""
        offs = self.segment_offsets()
        return [
            span_base + int(o) * chunk_slots + slot * s for o, s in zip(offs, self.segment_bytes, strict=True)
        ]

    def span_descriptors(
        self,
        spans: Sequence[Span],
        local_bases: Sequence[int],
        local_pages: Sequence[int] | npt.NDArray[np.integer],
    ) -> npt.NDArray[np.uint64]:
        """Nx3 rows (arena address, local address, nbytes) moving span pages to/from `local_pages`.

        Page i of the spans (in span order) pairs with `local_pages[i]`; local buffer b's page p lives at
        `local_bases[b] + p * segment_bytes[b]`. Rows coalesce wherever both sides are consecutive.
        """
        pages = runs.as_page_array(local_pages)
        total = sum(s.count for s in spans)
        if total != pages.size:
            raise InvalidPagesError(f"spans cover {total} pages, local side has {pages.size}")
        offs = self.segment_offsets()
        parts: list[npt.NDArray[np.uint64]] = []
        at = 0
        for span in spans:
            bases = [span.chunk_address + int(o) * span.chunk_slots for o in offs]
            slots = np.arange(span.first_slot, span.first_slot + span.count, dtype=np.int64)
            parts.append(
                runs.descriptors(bases, local_bases, self.segment_bytes, slots, pages[at : at + span.count])
            )
            at += span.count
        if not parts:
            return np.zeros((0, 3), dtype=np.uint64)
        return np.ascontiguousarray(np.concatenate(parts))

    def row_descriptors(
        self, spans: Sequence[Span], rows_base: int, local_rows: Sequence[int]
    ) -> npt.NDArray[np.uint64]:
        """Nx3 rows (arena address, local address, nbytes) moving span pages into page-major rows: page i
        of the spans (in span order) lands at `rows_base + local_rows[i] * page_bytes`, its segments one
        after another in buffer order (one contiguous range a page, the layout `page_row_checksums`
        hashes). One row per segment per page: the arena's runs are segment-major, so no two rows join."""
        return self.page_descriptors(spans, self.row_addresses(rows_base, local_rows)).reshape(-1, 3)

    def row_addresses(self, rows_base: int, local_rows: Sequence[int]) -> npt.NDArray[np.uint64]:
        """(pages, segments) addresses of each segment of page-major rows `local_rows` at `rows_base`
        (row r's page at `rows_base + r * page_bytes`, its segments one after another in buffer order)."""
        rows = np.asarray(local_rows, dtype=np.uint64).reshape(-1)
        return np.uint64(rows_base) + rows[:, None] * np.uint64(self.page_bytes) + self.segment_offsets()

    def page_descriptors(
        self, spans: Sequence[Span], local: npt.NDArray[np.uint64]
    ) -> npt.NDArray[np.uint64]:
        """(pages, segments, 3) words (arena address, local address, nbytes): page i of the spans (in span
        order), segment by segment, paired with the local addresses `local[i]` ((pages, segments))."""
        total = sum(s.count for s in spans)
        if local.shape != (total, len(self.segment_bytes)):
            raise InvalidPagesError(f"spans cover {total} pages, local side has {local.shape[0]}")
        offs = self.segment_offsets()
        sizes = np.asarray(self.segment_bytes, dtype=np.uint64)
        out = np.empty((total, len(sizes), 3), dtype=np.uint64)
        at = 0
        for span in spans:
            slots = np.arange(span.first_slot, span.first_slot + span.count, dtype=np.uint64)[:, None]
            out[at : at + span.count, :, 0] = span.chunk_address + offs * span.chunk_slots + slots * sizes
            at += span.count
        out[:, :, 1] = local
        out[:, :, 2] = sizes
        return out


def page_checksum(segments: Sequence[memoryview | bytes]) -> bytes:
    """XXH3-128 over a page's segments in order, as 16 bytes (what CommitPut and readers compare).

    A check against torn, stale or corrupt bytes, not against a forger (a writer of a namespace could
    store any page anyway): XXH3 runs at tens of GB/s on one core (BLAKE2b-128, used before, at ~1), so
    verifying a hit costs a small share of fetching it."""
    h = xxhash.xxh3_128()
    for seg in segments:
        h.update(seg)
    return h.digest()


def buffer_view(addr: int, nbytes: int) -> memoryview:
    """A byte view of `nbytes` of host memory at `addr` (a registered DRAM buffer or the arena)."""
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


def failed_pages(got: Sequence[bytes], want: Sequence[bytes], first: int = 0) -> list[int]:
    """Indices, from `first`, of the pages whose checksum in `got` is not the one `want` holds for it
    (both in page order, of equal length)."""
    return [first + i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]


def local_page_checksums(buffers: Sequence[KvBuffer], pages: Sequence[int]) -> list[bytes]:
    """Checksums of pages of local DRAM buffers (buffer b's page p at addr + p * bytes_per_page).

    `page_checksum` of each page's segments, through `range_checksums` (the built loop, without the GIL,
    where there is one). Without it: the streaming hash of the `xxhash` module lets go of the GIL in every
    update, and where another thread runs Python without pause (SGLang's scheduler beside its HiCache
    thread) each update then waits up to a switch interval to get it back: 250 updates of a 24 MiB get
    took 30 ms on an H200 host that way. So the GIL is kept: pages of long segments, and pages larger
    than `_HELD_PAGE_BYTES`, are hashed in place by XXH3's streaming calls with the GIL held
    (`_held_xxh3`); other pages up to `_JOIN_BYTES` are joined into one copy and hashed in one call; larger
    ones (where the library lacks the streaming calls) segment by segment, over a few threads when that
    pays."""
    if native.available():
        return range_checksums(page_ranges(buffers, pages))
    views = [(buffer_view(b.addr, b.nbytes), b.bytes_per_page) for b in buffers]
    page_bytes = sum(b.bytes_per_page for b in buffers)
    shortest = min((b.bytes_per_page for b in buffers), default=0)
    held = _held_xxh3() if shortest >= _NO_COPY_SEGMENT_BYTES or page_bytes > _HELD_PAGE_BYTES else None

    if held is not None:
        segments = [(b.addr, b.bytes_per_page) for b in buffers]
        return [held([(a + p * n, n) for a, n in segments]) for p in pages]

    if page_bytes <= _JOIN_BYTES:

        def joined(page: int) -> bytes:
            return xxhash.xxh3_128_digest(b"".join([v[page * n : (page + 1) * n] for v, n in views]))

        return [joined(p) for p in pages]

    def one(page: int) -> bytes:
        h = xxhash.xxh3_128()
        for view, size in views:
            at = page * size
            h.update(view[at : at + size])
        return h.digest()

    return map_pages(one, pages, page_bytes, shortest)


def page_ranges(buffers: Sequence[KvBuffer], pages: Sequence[int]) -> npt.NDArray[np.uint64]:
    """(pages, buffers, 2) words: the (address, length) of each page's segment in each buffer."""
    at = np.asarray(pages, dtype=np.uint64).reshape(-1, 1)
    sizes = np.asarray([b.bytes_per_page for b in buffers], dtype=np.uint64)
    out = np.empty((at.shape[0], len(buffers), 2), dtype=np.uint64)
    out[:, :, 0] = np.asarray([b.addr for b in buffers], dtype=np.uint64) + at * sizes
    out[:, :, 1] = sizes
    return out


def range_checksums(ranges: npt.NDArray[np.uint64]) -> list[bytes]:
    """`page_checksum` of each page of `ranges`, a (pages, segments, 2) array of the (address, length) of
    each page's segments in order, in host memory this process can read. The built loop
    (`native.NativeHash`) hashes them in one call without the GIL, at least `_BYTES_PER_THREAD` on each
    of its threads; without it, page by page (`_held_xxh3`, or the module's streaming hash)."""
    ranges = np.ascontiguousarray(ranges, dtype=np.uint64)
    n = ranges.shape[0]
    if n == 0:
        return []
    built = native.native_hash()
    if built is None:
        held = _held_xxh3()
        if held is not None:
            return [held([(int(a), int(b)) for a, b in page]) for page in ranges]
        return [page_checksum([buffer_view(int(a), int(b)) for a, b in page]) for page in ranges]
    total = int(ranges[:, :, 1].sum())
    return built.checksums(ranges, max(1, min(_HASH_THREADS, n, total // _BYTES_PER_THREAD)))


class _Hash128(ctypes.Structure):
    _fields_ = (("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64))


@functools.cache
def _held_xxh3() -> Callable[[Sequence[tuple[int, int]]], bytes] | None:
    """XXH3-128 over `(address, length)` ranges in order, its canonical 16 bytes, computed by the C
    library the `xxhash` module is built on, called through `ctypes.PyDLL` (which keeps the GIL); None
    where that library does not export XXH3's streaming calls (the caller then uses the module)."""
    try:
        lib = ctypes.PyDLL(str(importlib.import_module("xxhash._xxhash").__file__))
        create, reset = lib.XXH3_createState, lib.XXH3_128bits_reset
        update, digest = lib.XXH3_128bits_update, lib.XXH3_128bits_digest
    except (ImportError, OSError, AttributeError):
        return None
    create.restype = ctypes.c_void_p
    reset.argtypes = [ctypes.c_void_p]
    update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    digest.argtypes = [ctypes.c_void_p]
    digest.restype = _Hash128
    local = threading.local()  # a state per thread: a thread may lose the GIL between two calls

    def hash_ranges(ranges: Sequence[tuple[int, int]]) -> bytes:
        state = getattr(local, "state", None)
        if state is None:
            state = local.state = create()
            if not state:
                raise MemoryError("XXH3_createState failed")
        reset(state)
        for addr, n in ranges:
            update(state, addr, n)
        h = digest(state)
        return int(h.high64).to_bytes(8, "big") + int(h.low64).to_bytes(8, "big")

    return hash_ranges


def page_row_checksums(rows: npt.NDArray[np.uint8]) -> list[bytes]:
    """`page_checksum` of each row of a C-contiguous (pages, page bytes) host array: each page is one
    range, hashed in one call (XXH3 of a page's segments in order is XXH3 of their concatenation), so
    long pages spread over threads."""
    n, size = rows.shape
    rows = np.ascontiguousarray(rows)
    if native.available():
        ranges = np.empty((n, 1, 2), dtype=np.uint64)
        ranges[:, 0, 0] = rows.ctypes.data + np.arange(n, dtype=np.uint64) * np.uint64(size)
        ranges[:, 0, 1] = size
        return range_checksums(ranges)
    view = rows.data.cast("B")
    return map_pages(lambda i: xxhash.xxh3_128_digest(view[i * size : (i + 1) * size]), range(n), size, size)


def map_pages(fn: Callable[[_T], _R], items: Sequence[_T], item_bytes: int, unit_bytes: int) -> list[_R]:
    """`[fn(x) for x in items]` for `fn` hashing `item_bytes` each in updates of at least `unit_bytes`,
    spread over a few threads when that pays. The hash releases the GIL only inside an update, so threads
    help only when each update is long: measured on a 16-core H200 host, 48 segments a page hashed no
    faster on 2-8 threads than on one at 4, 16 or 64 KiB a segment, and 3x faster on 8 at 256 KiB;
    pages of 192 KiB hashed in one update each ran 2x faster on 4 threads. Below `_MIN_UNIT_BYTES` the
    threads' fight over the GIL costs what they save. Each thread also gets at least
    `_BYTES_PER_THREAD`: handing work to the pool costs too."""
    if unit_bytes < _MIN_UNIT_BYTES:
        return [fn(x) for x in items]
    parts = min(_HASH_THREADS, len(items) * item_bytes // _BYTES_PER_THREAD)
    if parts <= 1:
        return [fn(x) for x in items]
    step = -(-len(items) // parts)
    parts_out = _hash_pool().map(
        lambda at: [fn(x) for x in items[at : at + step]], range(0, len(items), step)
    )
    return [r for part in parts_out for r in part]


@functools.cache
def _hash_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(_HASH_THREADS, thread_name_prefix="page-checksum")
