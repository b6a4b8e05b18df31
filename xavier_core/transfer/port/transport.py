"""Which transport a pull takes, the CUDA IPC pull itself, and what pulls are counted by.

Transports: "nixl" (NIXL READs of registered memory, DRAM or VRAM, any host: every endpoint offers it),
"cuda_ipc" (the reader maps the source's VRAM pool once per peer epoch and one fused Triton kernel
copies every page of every buffer; same host and peer access only) and "staged" (the source gathers the
room into a registered slab, the reader READs whole chunks and scatters them; see `staged.slab`). "auto"
takes CUDA IPC when the source's endpoint offers it and mapping it works, else staged when the source
staged the room (VRAM pools; the prefill stages for readers on other hosts), else NIXL. A forced
cuda_ipc never falls back; a forced staged stages every room and falls back to NIXL page runs only when
a slab has no free chunk, so a full slab never fails a request.

Run lengths: scattered pages cost per-descriptor transports dearly, so every pull records how long the
runs it moves are (stretches contiguous on both sides), as a histogram.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt

from xavier_core.runtime.logging import get_logger
from xavier_core.transfer.common.buffers import KvBuffer
from xavier_core.transfer.common.errors import InvalidSourceError, TransferError
from xavier_core.transfer.common.runs import pair_stretches

if TYPE_CHECKING:
    from xavier_core.transfer.cuda.copy import CopyHandle
    from xavier_core.transfer.cuda.copy_plan import PoolView
    from xavier_core.transfer.cuda.ipc import IpcImporter

log = get_logger(__name__)

Transport = Literal["nixl", "cuda_ipc", "staged"]
TransportChoice = Literal["auto", "nixl", "cuda_ipc", "staged"]
TRANSPORTS: tuple[Transport, ...] = ("nixl", "cuda_ipc", "staged")
# Upper bounds (pages) of the run-length histogram's buckets; the last bucket is +Inf.
RUN_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)


@dataclass
class RunLengths:
    """Histogram of the page runs pulls moved: `counts[i]` runs of length <= RUN_BUCKETS[i] (not
    cumulative; the last entry counts longer runs)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(RUN_BUCKETS) + 1))
    runs: int = 0
    pages: int = 0

    def observe(self, src_pages: npt.NDArray[np.int64], dst_pages: npt.NDArray[np.int64]) -> None:
        lengths = pair_stretches(src_pages, dst_pages)[:, 2].tolist()
        # A pull moves a few runs: bisecting each beats numpy's per-call overhead by far.
        for n in lengths:
            self.counts[bisect.bisect_left(RUN_BUCKETS, n)] += 1
        self.runs += len(lengths)
        self.pages += sum(lengths)

    def to_dict(self) -> dict[str, object]:
        labels = [str(b) for b in RUN_BUCKETS] + ["inf"]
        return {
            "runs": self.runs,
            "pages": self.pages,
            "mean": self.pages / self.runs if self.runs else 0.0,
            "buckets": dict(zip(labels, self.counts, strict=True)),
        }


def export_blob(buffers: Sequence[KvBuffer]) -> bytes:
    """This process's VRAM pool as CUDA IPC handles (the endpoint's `cuda_ipc_pool`); raises
    `TransferError` when it cannot be shared."""
    from xavier_core.transfer.cuda.ipc import export_pool

    try:
        return export_pool(buffers).to_bytes()
    except (TransferError, RuntimeError, OSError) as exc:
        raise TransferError(f"the KV pool cannot be exported through CUDA IPC: {exc}") from exc


def is_vram(buffers: Sequence[KvBuffer]) -> bool:
    return all(b.device.startswith("cuda") for b in buffers)


class IpcPeers:
    """Peers' pools mapped once per epoch through CUDA IPC, and copies between them and the local pool:
    `pull` (a reader copies a source's pages into its own) and `push` (a prefill writes its pages into a
    decode's). Not thread-safe: one owner calls it (the port's NIXL thread, or under the owner's lock)."""

    def __init__(self, buffers: Sequence[KvBuffer]) -> None:
        from xavier_core.transfer.cuda.copy_plan import PoolView
        from xavier_core.transfer.cuda.ipc import IpcImporter

        self.local: PoolView = PoolView.from_buffers(buffers)
        self.importer: IpcImporter = IpcImporter(self.local.device)
        self._unreachable: dict[str, int] = {}  # peer id -> epoch whose pool could not be mapped

    def warm_up(self) -> None:
        """Compiles the copy kernel now (a page copied onto itself), not inside the first pull."""
        from xavier_core.transfer.cuda.copy import copy_pages

        copy_pages(self.local, self.local, [0], [0]).wait(60.0)

    def view(self, peer_id: str, epoch: int, blob: bytes) -> PoolView | None:
        """The peer's pool mapped here, or None when CUDA IPC cannot reach it (another host, no peer
        access, a bad export); one failed attempt per peer epoch."""
        from xavier_core.transfer.cuda.ipc import CudaIpcError

        if not blob or self._unreachable.get(peer_id) == epoch:
            return None
        try:
            return self.importer.open(peer_id, epoch, blob)
        except (CudaIpcError, InvalidSourceError) as exc:
            self._unreachable[peer_id] = epoch
            log.info("CUDA IPC not usable for this peer; reading over NIXL", peer=peer_id, error=str(exc))
            return None

    def pull(
        self,
        peer_id: str,
        view: PoolView,
        src_pages: npt.NDArray[np.int64],
        dst_pages: npt.NDArray[np.int64],
    ) -> CopyHandle:
        """Copies the peer's `src_pages` into local `dst_pages` (one fused launch per page size); the
        mapping lives until the copy is done."""
        return self._copy(peer_id, view, self.local, src_pages, dst_pages)

    def push(
        self,
        peer_id: str,
        view: PoolView,
        src_pages: npt.NDArray[np.int64],
        dst_pages: npt.NDArray[np.int64],
    ) -> CopyHandle:
        """Copies local `src_pages` into the peer's `dst_pages`, as `pull` the other way."""
        return self._copy(peer_id, self.local, view, src_pages, dst_pages)

    def _copy(
        self,
        peer_id: str,
        src: PoolView,
        dst: PoolView,
        src_pages: npt.NDArray[np.int64],
        dst_pages: npt.NDArray[np.int64],
    ) -> CopyHandle:
        from xavier_core.transfer.cuda.copy import copy_pages

        handle = copy_pages(src, dst, src_pages, dst_pages, device=self.local.device)
        self.importer.track(peer_id, handle)
        return handle

    def mapped(self, peer_id: str) -> int | None:
        """The peer's epoch mapped now, if any."""
        return self.importer.mapped().get(peer_id)

    def drop(self, peer_id: str, epoch: int) -> None:
        """Retires the peer's mapping if it is of `epoch` (that epoch ended; a newer one stays mapped);
        it is unmapped once its copies are done."""
        if self.mapped(peer_id) == epoch:
            self.importer.drop(peer_id)
        if self._unreachable.get(peer_id) == epoch:
            del self._unreachable[peer_id]

    def collect(self) -> None:
        self.importer.collect()

    def close(self) -> None:
        self.importer.close()
