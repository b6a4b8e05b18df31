"""Same-host reads: a Get's leased pages read straight out of the store process's memory.

A store advertises its arena with its endpoint (`DirectArena`: its pid, the arena's address and length,
its host's boot id, and where in its memory a tag naming the store instance lies). A client on the same host
(the boot id is its own) reads the tag with `process_vm_readv` and, if it names the store instance it
asked, reads every later READ of that instance's leased spans the same way: one system call per batch of
descriptor rows, spread over a few threads (`_COPY_THREADS`), instead of a NIXL READ (one UCX thread:
~5 GB/s over CMA on an H200 host). The store's arena stays ordinary anonymous memory, with the huge pages
that NumPy asks for, which NIXL's own transfers into and out of it keep too.

The kernel lets a process read another's memory this way only where it could ptrace it (same user, or
CAP_SYS_PTRACE): CMA, which a NIXL READ on the same host uses, takes the same check, so this reads nothing
NIXL could not. Where the call is refused (another PID namespace, a seccomp or LSM policy, another user) or
the tag names another instance, the client logs once per store instance and reads over NIXL.

A bad address costs an error, never a crash: the kernel answers `EFAULT` (and a store gone, `ESRCH`), and
every row's arena range is checked against the arena before any read. The pages a row reads are leased (the
store neither reuses nor moves them until the lease ends), and their checksums are verified after the read,
as after a NIXL READ.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar, cast

import numpy as np
import numpy.typing as npt
from xavier.v1 import page_store_service_pb2 as pb

from xavier_core.pagestore import native
from xavier_core.transfer.common.errors import PeerError
from xavier_core.transfer.common.host import boot_id
from xavier_core.transfer.nixl._raw import XferState

__all__ = ["DirectArena", "DirectCopy", "arena_tag", "open_direct_arena", "read_memory"]

log = logging.getLogger(__name__)
Rows = npt.NDArray[np.uint64]

_T = TypeVar("_T")
_TAG = b"xavier-pagestore-arena/1\n"
_THREADS_ENV = "XAVIER_PAGE_READ_THREADS"


def _copy_threads() -> int:
    """`XAVIER_PAGE_READ_THREADS` where set (1-64), else min(16, cores)."""
    raw = os.environ.get(_THREADS_ENV, "").strip()
    if not raw:
        return min(16, os.cpu_count() or 1)
    if not raw.isdigit() or not 1 <= int(raw) <= 64:
        raise ValueError(f"{_THREADS_ENV} must be a whole number from 1 to 64, not {raw!r}")
    return int(raw)


_COPY_THREADS = _copy_threads()
"""Shared by every client of the process. The system call runs without the GIL, so the threads read at
once. On a 2-core box one thread reads 16-18 GB/s, two 25-32 GB/s. On a 16-core H100 host one thread
reads and checks only 5.4 GB/s, 8 threads 32 GB/s and 16 threads 45 GB/s
(`docs/results/page-reads-h100-dynamic.json`). Inside SGLang, beside its busy schedulers, a 458 MB get
took 22-24 ms on 16 threads against 32-35 ms on 8 (`sglang-hicache-h100-7b-threads16.json`, `-threads8`).
`XAVIER_PAGE_READ_THREADS` sets it for a process (read once, at import)."""
_COPY_UNIT_BYTES = 1 << 20
"""No thread is handed less than this: below it the hop to the pool costs more than the read saves."""
_IOV_MAX = 1024
"""Rows per system call (Linux's UIO_MAXIOV)."""


def arena_tag(instance: str) -> bytes:
    """What the store keeps in its memory at the advertised tag address: names the store instance."""
    return _TAG + instance.encode() + b"\n"


@functools.cache
def _readv() -> Callable[..., int]:
    """libc's process_vm_readv (pid, local iovecs, count, remote iovecs, count, flags) -> bytes read."""
    fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
    ulong, ptr = ctypes.c_ulong, ctypes.c_void_p
    fn.argtypes = [ctypes.c_int, ptr, ulong, ptr, ulong, ulong]
    fn.restype = ctypes.c_ssize_t
    return cast(Callable[..., int], fn)


def read_memory(pid: int, local: Rows, remote: Rows) -> None:
    """Reads into this process's `local` ranges, out of process `pid`'s `remote` ones, in order (each a
    C-contiguous (n, 2) array of address, length: Linux's `struct iovec`), a batch of rows per system call
    (without the GIL). Raises `PeerError` naming the kernel's reason unless every byte arrived."""
    fn = _readv()
    for at in range(0, local.shape[0], _IOV_MAX):
        mine, theirs = local[at : at + _IOV_MAX], remote[at : at + _IOV_MAX]
        want = int(mine[:, 1].sum())
        got = fn(pid, mine.ctypes.data, mine.shape[0], theirs.ctypes.data, theirs.shape[0], 0)
        if got != want:
            err = ctypes.get_errno() if got < 0 else 0
            why = os.strerror(err) if err else f"{got} of {want} bytes"
            raise PeerError(f"reading the page store's memory (pid {pid}) failed: {why}")


class DirectArena:
    """A store's arena on this host, read with `process_vm_readv`, for one store instance."""

    def __init__(self, pid: int, arena_base: int, arena_bytes: int) -> None:
        self.pid = pid
        self.arena_base = arena_base
        self.arena_bytes = arena_bytes
        self.closed = False

    def copy(self, rows: Rows) -> DirectCopy:
        """Starts reading `rows` (arena address, local address, nbytes) out of the store: the first part
        on this thread at once, the rest on the copy threads. Raises `PeerError`, reading nothing, when
        a row leaves the arena or the arena was closed (its store instance forgotten)."""
        self._check_inside(rows[:, 0], rows[:, 2])
        parts = _split(rows)
        futures = [_copy_pool().submit(read_memory, self.pid, *part) for part in parts[1:]]
        here: Future[None] = Future()
        try:
            if parts:
                read_memory(self.pid, *parts[0])
            here.set_result(None)
        except BaseException as exc:
            here.set_exception(exc)
        return DirectCopy([here, *futures])

    def read_checked(self, pages: Rows) -> list[bytes]:
        """Reads every page of `pages`, (pages, segments, 3) words of (arena address, local address,
        nbytes), out of the store and returns each one's `layout.page_checksum` as it landed: the built
        loop (`native.NativeHash.read_checksums`) reads a page and hashes it while it is in cache, one
        pass over memory, on up to `_COPY_THREADS` threads without the GIL. Raises `PeerError`, reading
        nothing, where a segment leaves the arena, and when a read fails (the local pages then hold
        unspecified bytes). Call only where `native.available()`."""
        return self._loop_read(pages, lambda built: built.read_checksums)

    def read_unhashed(self, pages: Rows) -> None:
        """`read_checked` without the checksums (`native.NativeHash.read_pages`): the same read alone,
        the baseline what checking pages as they land adds is told against."""
        self._loop_read(pages, lambda built: built.read_pages)

    def _loop_read(self, pages: Rows, pick: Callable[[native.NativeHash], Callable[..., _T]]) -> _T:
        """`pick(built loop)(pid, pages, threads)`, once every segment is checked against the arena."""
        built = native.native_hash()
        if built is None:
            raise PeerError("the built page loop is unavailable")
        self._check_inside(pages[:, :, 0].ravel(), pages[:, :, 2].ravel())
        total = int(pages[:, :, 2].sum()) if pages.size else 0
        threads = max(1, min(_COPY_THREADS, pages.shape[0], total // _COPY_UNIT_BYTES))
        try:
            return pick(built)(self.pid, np.ascontiguousarray(pages), threads)
        except OSError as exc:
            raise PeerError(
                f"reading the page store's memory (pid {self.pid}) failed: {exc.strerror}"
            ) from exc

    def _check_inside(self, src: Rows, size: Rows) -> None:
        if self.closed:
            raise PeerError("the store's arena was closed (its store instance is gone)")
        end = self.arena_base + self.arena_bytes
        if src.shape[0] and (int(src.min()) < self.arena_base or int((src + size).max()) > end):
            raise PeerError("a page span lies outside the store's arena")

    def close(self) -> None:
        """Later `copy` calls raise `PeerError`; reads under way end on their own."""
        self.closed = True


class DirectCopy:
    """A READ served from a `DirectArena`: what `StoreConnection.post` gives on the same-host path, waited
    for by `settle` as a NIXL transfer is. It has no deadline: a read of memory ends, it cannot stall on
    a peer."""

    def __init__(self, parts: list[Future[None]]) -> None:
        self._parts = parts

    @property
    def in_flight(self) -> bool:
        return not all(f.done() for f in self._parts)

    @property
    def state(self) -> XferState:
        if self.in_flight:
            return "PROC"
        return "ERR" if any(f.exception() is not None for f in self._parts) else "DONE"

    def error(self) -> BaseException | None:
        """The first part's error, once every part has ended (None: every byte arrived)."""
        return next((e for f in self._parts if (e := f.exception()) is not None), None)

    def wait(self) -> XferState:
        """Waits for every part to end; its end state."""
        for f in self._parts:
            f.exception()
        return self.state


def _split(rows: Rows) -> list[tuple[Rows, Rows]]:
    """`rows` as (local, remote) iovec arrays in at most `_COPY_THREADS` parts of about equal bytes, cut
    between rows (a part of one long row is never shared: rows are at most an arena chunk)."""
    sizes = rows[:, 2]
    total = int(sizes.sum()) if rows.shape[0] else 0
    if total == 0:
        return []
    count = max(1, min(_COPY_THREADS, total // _COPY_UNIT_BYTES, rows.shape[0]))
    ends = np.cumsum(sizes)
    cuts = np.searchsorted(ends, [total * k // count for k in range(1, count)], side="left") + 1
    local = np.ascontiguousarray(rows[:, [1, 2]])
    remote = np.ascontiguousarray(rows[:, [0, 2]])
    bounds = [0, *sorted({int(c) for c in cuts if 0 < c < rows.shape[0]}), rows.shape[0]]
    return [(local[lo:hi], remote[lo:hi]) for lo, hi in itertools.pairwise(bounds) if hi > lo]


@functools.cache
def _copy_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="page-copy")


def open_direct_arena(
    direct: pb.DirectArena, instance: str, region_base: int, region_bytes: int
) -> DirectArena:
    """The arena a `DirectArena` describes, once its tag, read out of the store's memory, names `instance`
    and it is the region the endpoint gave NIXL. Raises `PeerError` (another host, a refused read, not
    that store instance)."""
    if direct.boot_id != boot_id() or not direct.boot_id:
        raise PeerError("the page store runs on another host")
    if (direct.arena_base, direct.arena_bytes) != (region_base, region_bytes) or not direct.arena_bytes:
        raise PeerError("the advertised arena does not match the store's NIXL region")
    want = arena_tag(instance)
    if direct.tag_bytes != len(want):
        raise PeerError("the store's tag does not name this store instance")
    got = np.zeros(len(want), dtype=np.uint8)
    n = len(want)
    local = np.array([[got.ctypes.data, n]], dtype=np.uint64)
    read_memory(int(direct.pid), local, np.array([[direct.tag_address, n]], dtype=np.uint64))
    if got.tobytes() != want:
        raise PeerError("the process read is not this store instance (another PID namespace?)")
    return DirectArena(int(direct.pid), int(direct.arena_base), int(direct.arena_bytes))
