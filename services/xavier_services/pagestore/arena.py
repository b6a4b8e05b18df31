"""The DRAM arena: one NIXL registration, fixed-size chunks, and the passive side's progress thread.

The arena's memory is a memory file (`memfd_create`) mapped shared, so that a client on the same host can
map it read-only and copy its leased pages out with no NIXL READ (`xavier_core.pagestore.mapped`): the
file's first `HEADER_BYTES` name the store instance, the arena follows. Where the file cannot be made the
arena is anonymous memory and every client reads over NIXL.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from xavier.v1 import page_store_service_pb2 as pb

from xavier_core.pagestore.layout import PageGeometry, buffer_view, page_checksum
from xavier_core.pagestore.mapped import ARENA_FILE_NAME, HEADER_BYTES, arena_header, boot_id
from xavier_core.pagestore.nixl import STORE_UCX_ENV, TCP_SEGMENT_BYTES, PageAgent
from xavier_core.transfer.common.buffers import KvBuffer

log = logging.getLogger(__name__)


@dataclass
class Chunk:
    """One arena chunk; while a namespace owns it, `slots` slots of its page geometry, segment-major."""

    index: int
    address: int
    slots: int = 0
    free: list[int] = field(default_factory=list)  # a min-heap: low slots first keeps runs contiguous
    used: int = 0


class Arena:
    """`arena_bytes` of DRAM cut into chunks, registered with a NIXL agent once for the store's life."""

    def __init__(self, arena_bytes: int, chunk_bytes: int, progress_interval_s: float) -> None:
        self.chunk_bytes = chunk_bytes
        count = arena_bytes // chunk_bytes
        self.capacity_bytes = count * chunk_bytes
        self.instance = uuid.uuid4().hex
        self._file, self._fd = _arena_file(HEADER_BYTES + self.capacity_bytes)
        # Touched once up front: a missing page would otherwise fault inside the first NIXL WRITE into it
        # (measured: first-touch WRITEs ran 10-20x slower), and a store that cannot have its memory should
        # fail at start, not under load.
        whole = np.frombuffer(self._file, dtype=np.uint8)
        whole.fill(0)
        header = arena_header(self.instance)
        whole[: len(header)] = np.frombuffer(header, dtype=np.uint8)
        self._memory = whole[HEADER_BYTES:]
        self.base = int(self._memory.ctypes.data)
        self._view = buffer_view(self.base, self.capacity_bytes)
        self.agent = PageAgent(
            f"pagestore-{self.instance[:12]}",
            [KvBuffer(self.base, self.capacity_bytes, chunk_bytes, "cpu")],
            STORE_UCX_ENV,
        )
        self.tcp_segment_bytes = TCP_SEGMENT_BYTES  # what the agent sends over UCX's TCP transport
        self.chunks = [Chunk(i, self.base + i * chunk_bytes) for i in range(count)]
        self.free_chunks = list(reversed(self.chunks))  # pop() hands out low addresses first
        self._interval = progress_interval_s
        self._busy: Callable[[], bool] = lambda: False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def shared(self) -> pb.SharedArena | None:
        """How a client on this host maps the arena (None: the arena is not in a file)."""
        if self._fd is None:
            return None
        return pb.SharedArena(
            pid=os.getpid(),
            fd=self._fd,
            header_bytes=HEADER_BYTES,
            arena_bytes=self.capacity_bytes,
            arena_base=self.base,
            boot_id=boot_id(),
        )

    def checksum(self, geometry: PageGeometry, chunk: Chunk, slot: int) -> bytes:
        """Checksum of the bytes a slot holds now (what a writer's checksum is compared with)."""
        addrs = geometry.slot_addresses(chunk.address, chunk.slots, slot)
        segs = [
            self._view[a - self.base : a - self.base + s]
            for a, s in zip(addrs, geometry.segment_bytes, strict=True)
        ]
        return page_checksum(segs)

    def start(self, busy: Callable[[], bool]) -> None:
        """Starts polling NIXL whenever `busy()` (some lease is live): a READ or WRITE of the arena moves
        only while this side polls, and an idle store should not spin a core."""
        self._busy = busy
        self._thread = threading.Thread(target=self._progress_loop, name="pagestore-nixl", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def _progress_loop(self) -> None:
        while not self._stop.is_set():
            if self._busy():
                self.agent.progress()
                self._stop.wait(self._interval)
            else:
                self._wake.wait(0.05)
                self._wake.clear()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)
        self.agent.close()


def _arena_file(size: int) -> tuple[mmap.mmap, int | None]:
    """`size` bytes of shared memory in a memory file, mapped, and the file's descriptor (kept open for the
    store's life: clients open it through /proc); anonymous memory and None where no file can be made.

    The file is sealed at its size: a mapping of it can then never reach past its end (a copy from
    there would fault the client's process)."""
    try:
        fd = os.memfd_create(ARENA_FILE_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (AttributeError, OSError) as exc:
        log.info("no memory file for the arena (%s): clients on this host read it over NIXL", exc)
        return mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), None
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE), fd
    except BaseException:
        os.close(fd)
        raise
