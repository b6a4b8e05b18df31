"""The DRAM arena: one NIXL registration, fixed-size chunks, and the passive side's progress thread.

A client on the store's host reads leased pages straight out of this process's memory
(`xavier_core.pagestore.direct`): `Arena.direct` tells it where the arena lies, and where a tag naming the
store instance does.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
from xavier.v1 import page_store_service_pb2 as pb

from xavier_core.pagestore.direct import arena_tag
from xavier_core.pagestore.layout import PageGeometry, buffer_view
from xavier_core.pagestore.nixl import STORE_UCX_ENV, TCP_SEGMENT_BYTES, PageAgent
from xavier_core.transfer.common.buffers import KvBuffer
from xavier_core.transfer.common.host import boot_id


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
        # Touched once up front: a missing page would otherwise fault inside the first NIXL WRITE into it
        # (measured: first-touch WRITEs ran 10-20x slower), and a store that cannot have its memory should
        # fail at start, not under load.
        self._memory = np.zeros(self.capacity_bytes, dtype=np.uint8)
        self._memory.fill(0)
        self.base = int(self._memory.ctypes.data)
        self._view = buffer_view(self.base, self.capacity_bytes)
        self.instance = uuid.uuid4().hex
        self._tag = np.frombuffer(bytearray(arena_tag(self.instance)), dtype=np.uint8)  # kept for our life
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

    def direct(self) -> pb.DirectArena:
        """How a client on this host reads the arena out of this process's memory."""
        return pb.DirectArena(
            pid=os.getpid(),
            arena_base=self.base,
            arena_bytes=self.capacity_bytes,
            boot_id=boot_id(),
            tag_address=int(self._tag.ctypes.data),
            tag_bytes=self._tag.nbytes,
        )

    def page_ranges(
        self, geometry: PageGeometry, slots: Sequence[tuple[Chunk, int]]
    ) -> npt.NDArray[np.uint64]:
        """(pages, segments, 2) words: the arena (address, length) of each segment of each (chunk, slot),
        what `layout.range_checksums` hashes."""
        out = np.empty((len(slots), len(geometry.segment_bytes), 2), dtype=np.uint64)
        out[:, :, 1] = np.asarray(geometry.segment_bytes, dtype=np.uint64)
        for i, (chunk, slot) in enumerate(slots):
            out[i, :, 0] = geometry.slot_addresses(chunk.address, chunk.slots, slot)
        return out

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
