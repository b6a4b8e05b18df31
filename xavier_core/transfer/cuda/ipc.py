"""CUDA IPC for KV pools on one host: export this process's pool, import a peer's once per epoch.

The exporter (prefill) describes its pool as legacy IPC handles, one per cudaMalloc allocation holding
a KV buffer, plus each buffer's offset in its allocation; `PoolExport.to_bytes()` travels over the
control plane with the peer's other metadata. The importer (decode) maps each allocation once per peer
epoch and gets a `PoolView` whose addresses the fused copy kernel reads directly (a pull over NVLink).
Handles are opened in the context of the GPU that runs the copies (lazily enabling peer access to
the exporter's GPU): a mapping made in another device's context is not reachable from kernels here,
even with peer access between the two devices.

Lifetimes: a mapping must outlive every copy that reads it, so copies are tracked per peer and a peer
whose epoch changes is retired, then unmapped by `collect()` once its copies have finished; nothing
here blocks except `close()`. The exporter must keep its pool allocated while any importer may copy
(a KV pool lives as long as its engine), and must have finished writing pages before it publishes them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from xavier_core.transfer.common.buffers import KvBuffer
from xavier_core.transfer.common.errors import InvalidSourceError, StaleEpochError, TransferError
from xavier_core.transfer.common.host import boot_id
from xavier_core.transfer.cuda._driver import (
    IPC_HANDLE_SIZE,
    allocation_range,
    current_device,
    ipc_close,
    ipc_get_handle,
    ipc_open,
)
from xavier_core.transfer.cuda.copy import CopyHandle
from xavier_core.transfer.cuda.copy_plan import PoolView

_FORMAT = 1
_MAX_BLOB = 1 << 20


class CudaIpcError(TransferError):
    """The pool cannot be shared or mapped through CUDA IPC (another host, the same process, a bad handle)."""


def host_id() -> str:
    """Identifies this host's kernel boot: IPC handles are meaningful only between its processes."""
    return boot_id() or os.uname().nodename


@dataclass(frozen=True)
class PoolExport:
    """A KV pool as IPC handles; `buffers` rows are (allocation index, offset, nbytes, bytes_per_page)."""

    host: str
    pid: int
    device_uuid: str
    allocations: tuple[bytes, ...]
    buffers: tuple[tuple[int, int, int, int], ...]

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "format": _FORMAT,
                "host": self.host,
                "pid": self.pid,
                "device_uuid": self.device_uuid,
                "allocations": [h.hex() for h in self.allocations],
                "buffers": [list(b) for b in self.buffers],
            }
        ).encode()

    @classmethod
    def from_bytes(cls, blob: bytes) -> PoolExport:
        """Parses and validates a peer's export; malformed input raises `InvalidSourceError`."""
        if len(blob) > _MAX_BLOB:
            raise InvalidSourceError(f"CUDA IPC export of {len(blob)} bytes exceeds {_MAX_BLOB}")
        try:
            raw = json.loads(blob)
            if raw["format"] != _FORMAT:
                raise InvalidSourceError(f"unknown CUDA IPC export format {raw['format']!r}")
            allocations = tuple(bytes.fromhex(h) for h in raw["allocations"])
            buffers = tuple((int(a), int(o), int(n), int(p)) for a, o, n, p in raw["buffers"])
            export = cls(str(raw["host"]), int(raw["pid"]), str(raw["device_uuid"]), allocations, buffers)
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidSourceError(f"malformed CUDA IPC export: {exc}") from exc
        if not buffers or any(len(h) != IPC_HANDLE_SIZE for h in allocations):
            raise InvalidSourceError("CUDA IPC export has no buffers or a handle of the wrong size")
        for a, off, nbytes, bpp in buffers:
            if not 0 <= a < len(allocations) or off < 0 or bpp <= 0 or nbytes < bpp:
                raise InvalidSourceError(f"CUDA IPC export has an invalid buffer row {(a, off, nbytes, bpp)}")
        return export


def export_pool(buffers: Sequence[KvBuffer]) -> PoolExport:
    """This process's KV buffers (all on one CUDA device) as IPC handles, one per allocation."""
    import torch

    device = PoolView.from_buffers(buffers).device
    handles: list[bytes] = []
    index: dict[int, int] = {}
    rows = []
    with current_device(device):
        for b in buffers:
            base, size = allocation_range(b.addr)
            if b.addr + b.nbytes > base + size:
                raise CudaIpcError(f"KV buffer at {b.addr:#x} runs past the end of its allocation")
            if base not in index:
                index[base] = len(handles)
                handles.append(ipc_get_handle(base))
            rows.append((index[base], b.addr - base, b.nbytes, b.bytes_per_page))
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return PoolExport(host_id(), os.getpid(), uuid, tuple(handles), tuple(rows))


@dataclass
class _Imported:
    epoch: int
    bases: list[int]  # mapped allocation bases, to unmap
    view: PoolView
    copies: list[CopyHandle] = field(default_factory=list)

    def idle(self) -> bool:
        self.copies = [c for c in self.copies if not c.is_done()]
        return not self.copies


class IpcImporter:
    """Peers' pools mapped into the context of `device`, this process's GPU that runs the copies;
    cached by peer id, one epoch at a time. Not thread-safe: one owner (the transfer port) calls it.
    """

    def __init__(self, device: int) -> None:
        self.device = device
        self._peers: dict[str, _Imported] = {}
        self._retired: list[_Imported] = []

    def open(self, peer_id: str, epoch: int, blob: bytes) -> PoolView:
        """The peer's pool as seen from `device`; maps it on the first call of each epoch.

        A newer epoch retires the older mapping; an older epoch than the one mapped raises
        `StaleEpochError`.
        """
        cur = self._peers.get(peer_id)
        if cur is not None:
            if cur.epoch == epoch:
                return cur.view
            if epoch < cur.epoch:
                raise StaleEpochError(f"CUDA IPC export of {peer_id} epoch {epoch} after epoch {cur.epoch}")
            self.drop(peer_id)
        export = PoolExport.from_bytes(blob)
        if export.host != host_id():
            raise CudaIpcError(f"{peer_id} is on another host: CUDA IPC cannot reach its pool")
        if export.pid == os.getpid():
            raise CudaIpcError("a process cannot import its own pool; use PoolView.from_buffers")
        imported = self._map(export, epoch)
        self._peers[peer_id] = imported
        return imported.view

    def _map(self, export: PoolExport, epoch: int) -> _Imported:
        bases: list[int] = []
        with current_device(self.device):
            try:
                for handle in export.allocations:
                    bases.append(ipc_open(handle))
            except TransferError as exc:
                for b in bases:
                    ipc_close(b)
                raise CudaIpcError(f"cannot map the peer's KV pool: {exc}") from exc
        view = PoolView(
            bases=tuple(bases[a] + off for a, off, _, _ in export.buffers),
            bytes_per_page=tuple(bpp for _, _, _, bpp in export.buffers),
            num_pages=min(n // bpp for _, _, n, bpp in export.buffers),
            device=self.device,
            imported=True,
        )
        return _Imported(epoch, bases, view)

    def track(self, peer_id: str, copy: CopyHandle) -> None:
        """Records a copy that reads the peer's pool: the mapping stays until the copy is done."""
        imported = self._peers.get(peer_id)
        if imported is None:
            raise CudaIpcError(f"no CUDA IPC mapping for {peer_id}")
        imported.copies.append(copy)

    def drop(self, peer_id: str) -> None:
        """Retires the peer's mapping (epoch change, peer gone); `collect()` unmaps it once idle."""
        imported = self._peers.pop(peer_id, None)
        if imported is not None:
            self._retired.append(imported)
            self.collect()

    def collect(self) -> int:
        """Unmaps retired mappings whose copies have finished; returns how many. Never blocks."""
        done = [r for r in self._retired if r.idle()]
        self._retired = [r for r in self._retired if r not in done]
        if done:
            with current_device(self.device):
                for r in done:
                    for b in r.bases:
                        ipc_close(b)
        return len(done)

    def mapped(self) -> dict[str, int]:
        """Peer id -> mapped epoch (for stats)."""
        return {p: i.epoch for p, i in self._peers.items()}

    def close(self) -> None:
        """Waits for every tracked copy, then unmaps everything (shutdown)."""
        for peer_id in list(self._peers):
            self.drop(peer_id)
        for r in self._retired:
            for c in r.copies:
                c.wait()
        self.collect()
