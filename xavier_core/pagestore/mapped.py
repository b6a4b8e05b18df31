"""Same-host reads: a Get's pages copied straight out of the store's arena, mapped read-only.

The store keeps its arena in a memory file (`memfd_create`) that it maps shared and registers with NIXL
as before; its first `HEADER_BYTES` hold `arena_header(instance)`, the arena proper follows. A client on
the same host (the endpoint's `SharedArena.boot_id` is its own) opens the file as `/proc/<pid>/fd/<fd>`,
maps it read-only, checks the header names the store instance it asked, and from then on a READ of a
leased span is `memmove`s from the mapping, spread over a few threads (`_COPY_THREADS`), instead of a
NIXL READ (one UCX thread, ~5 GB/s over CMA on an H200 host).

Opening `/proc/<pid>/fd/<fd>` passes the kernel's ptrace read check on the store (same user, or
CAP_SYS_PTRACE): a process that passes it could read the store's memory through `/proc/<pid>/mem` anyway,
and CMA, which a NIXL READ on the same host uses, asks for more (the ptrace attach check). So the mapping
reaches nothing NIXL could not. A mapping that cannot be made (another PID namespace finds another
process's file, or none; a seccomp or LSM refusal; a header naming another instance) is logged once per
store instance and that instance is read over NIXL.

A fault inside `memmove` cannot be caught in Python, so nothing is copied that could fault: the file is
sealed against shrinking by the store (`fcntl` seals), the mapping is as long as the endpoint says and
checked against the file's size, every row's arena range is checked against the arena before any copy,
and the pages a row reads are leased (the store neither reuses nor moves them until the lease ends). The
mapping is released only when no copy uses it (`SharedArena.close` waits for the last one's end).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import numpy.typing as npt
from xavier.v1 import page_store_service_pb2 as pb

from xavier_core.transfer.common.errors import PeerError
from xavier_core.transfer.nixl._raw import XferState

__all__ = [
    "ARENA_FILE_NAME",
    "HEADER_BYTES",
    "MappedCopy",
    "SharedArena",
    "arena_header",
    "boot_id",
    "map_shared_arena",
]

log = logging.getLogger(__name__)
Rows = npt.NDArray[np.uint64]

ARENA_FILE_NAME = "xavier-pagestore-arena"
"""The name of the store's arena memory file (what `/proc/<pid>/fd/<fd>` links to, after `memfd:`)."""
HEADER_BYTES = max(4096, mmap.PAGESIZE)
"""Bytes before the arena in the file: one page, so the arena (and its chunks) stay page-aligned."""
_MAGIC = b"xavier-pagestore-arena/1\n"
_COPY_THREADS = min(8, os.cpu_count() or 1)
"""Shared by every client of the process. `ctypes.memmove` lets go of the GIL, so the threads copy at
once; more than 8 seldom adds bandwidth on one socket's memory and takes cores an engine needs."""
_COPY_UNIT_BYTES = 1 << 20
"""No thread is handed less than this: below it the hop to the pool costs more than the copy saves."""


def arena_header(instance: str) -> bytes:
    """What the store writes at the start of its arena file: names the store instance it belongs to."""
    return _MAGIC + instance.encode() + b"\n"


@functools.cache
def boot_id() -> str:
    """This host's boot id (empty where the kernel does not say): two processes with the same one run on
    the same host, since this boot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


class SharedArena:
    """The store's arena mapped read-only into this process, for one store instance."""

    def __init__(self, mapping: mmap.mmap, header_bytes: int, arena_base: int, arena_bytes: int) -> None:
        self._mapping = mapping
        self._view: npt.NDArray[np.uint8] | None = np.frombuffer(mapping, dtype=np.uint8)
        self._address = int(self._view.ctypes.data) + header_bytes
        self.arena_base = arena_base
        self.arena_bytes = arena_bytes
        self._users = 0
        self._closing = False
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return self._view is None

    def copy(self, rows: Rows) -> MappedCopy:
        """Starts copying `rows` (arena address, local address, nbytes) out of the mapping: the part of
        it on this thread at once, the rest on the copy threads. Raises `PeerError`, copying nothing,
        when a row leaves the arena or the mapping is being released."""
        src, size = rows[:, 0], rows[:, 2]
        end = self.arena_base + self.arena_bytes
        if rows.shape[0] and (int(src.min()) < self.arena_base or int((src + size).max()) > end):
            raise PeerError("a page span lies outside the store's arena")
        parts = _split(rows, self._address - self.arena_base)
        with self._lock:
            if self._closing:
                raise PeerError("the store's arena mapping is being released")
            self._users += len(parts)
        futures: list[Future[None]] = []
        try:
            for part in parts[1:]:
                futures.append(_copy_pool().submit(self._run, part))
        except BaseException:
            self._done(len(parts) - len(futures))
            raise
        here: Future[None] = Future()
        try:
            if parts:
                self._run(parts[0])
            here.set_result(None)
        except BaseException as exc:
            here.set_exception(exc)
        return MappedCopy([here, *futures])

    def _run(self, part: list[tuple[int, int, int]]) -> None:
        try:
            for dst, src, n in part:
                ctypes.memmove(dst, src, n)
        finally:
            self._done(1)

    def _done(self, parts: int) -> None:
        with self._lock:
            self._users -= parts
            last = self._closing and self._users == 0
        if last:
            self._release()

    def close(self) -> None:
        """Unmaps now, or once the copies under way end; later `copy` calls raise `PeerError`."""
        with self._lock:
            self._closing = True
            idle = self._users == 0
        if idle:
            self._release()

    def _release(self) -> None:
        with self._lock:
            if self._view is None:
                return
            self._view = None  # the mapping's only exported buffer: mmap.close() refuses while one lives
            self._mapping.close()


class MappedCopy:
    """A READ served from a `SharedArena`: what `StoreConnection.post` gives on the mapped path, waited
    for by `settle` as a NIXL transfer is. It has no deadline: a copy ends, it cannot stall on a peer."""

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

    def wait(self) -> XferState:
        """Waits for every part to end; its end state."""
        for f in self._parts:
            f.exception()
        return self.state


def _split(rows: Rows, shift: int) -> list[list[tuple[int, int, int]]]:
    """`(dst, src, n)` copies of `rows` (src moved by `shift` into the mapping) in at most
    `_COPY_THREADS` parts of about equal bytes, long rows cut where a part ends."""
    total = int(rows[:, 2].sum()) if rows.shape[0] else 0
    if total == 0:
        return []
    count = max(1, min(_COPY_THREADS, total // _COPY_UNIT_BYTES))
    share = -(-total // count)
    parts: list[list[tuple[int, int, int]]] = [[]]
    room = share
    for src, dst, n in rows.tolist():
        at = 0
        while at < n:
            if room == 0:
                parts.append([])
                room = share
            take = min(n - at, room)
            parts[-1].append((dst + at, src + shift + at, take))
            at += take
            room -= take
    return parts


@functools.cache
def _copy_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="page-copy")


def map_shared_arena(
    shared: pb.SharedArena, instance: str, region_base: int, region_bytes: int
) -> SharedArena:
    """Maps the arena a `SharedArena` describes, read-only, and checks it is `instance`'s (its header)
    and the region the endpoint gave NIXL. Raises `OSError` (the file cannot be opened or mapped) or
    `PeerError` (it is not that store's arena)."""
    if shared.boot_id != boot_id() or not shared.boot_id:
        raise PeerError("the page store runs on another host")
    if (shared.arena_base, shared.arena_bytes) != (region_base, region_bytes) or not shared.arena_bytes:
        raise PeerError("the shared arena does not match the store's NIXL region")
    if shared.header_bytes < len(arena_header(instance)):
        raise PeerError(f"the shared arena's header of {shared.header_bytes} bytes cannot name the store")
    length = shared.header_bytes + shared.arena_bytes
    fd = os.open(f"/proc/{shared.pid}/fd/{shared.fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size < length:
            raise PeerError("the shared arena's file is shorter than the arena")
        mapping = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)  # the mapping keeps the file
    want = arena_header(instance)
    if mapping[: len(want)] != want:
        mapping.close()
        raise PeerError("the mapped file is not this store instance's arena")
    return SharedArena(mapping, int(shared.header_bytes), int(shared.arena_base), int(shared.arena_bytes))
