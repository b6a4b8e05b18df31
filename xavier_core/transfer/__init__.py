"""The KV data plane: move pages of registered buffers between peers over NIXL.

What this layer knows: buffers (`KvBuffer`: an address, a length, bytes per page, a device string), page
ids (coalesced into `PageRun`s), and peers (`peer_key(peer_id, epoch)` plus NIXL metadata). It never knows
an engine: the reference engine, the services and SGLang's KV sender/receiver all drive it with exactly
those values, and it imports neither `xavier_core.engine` nor `xavier_services` (a test checks).

Layers, bottom up: `NixlAgent` (one per process: registered buffers, cached peers, READs of page lists);
`KvManager` / `KvSender` / `KvReceiver` (per-room state machines modelled on SGLang's `KVPoll`, driven by
polling); `KvPort` (the asyncio service face: one NIXL thread, publish / pull of contract
`SourceDescriptor`s, the errors the services answer with). Beside NIXL page runs a pull may take CUDA
IPC (`cuda_ipc`, `cuda_copy`) or the staged transport (`staging`, `staged_read`: slab chunks); the
choice is `transport`'s.

Names load on first use (PEP 562), so importing one module of the package (the engine imports
`buffers`) does not load NIXL, gRPC or the protos.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xavier_core._lazy import lazy_exports

if TYPE_CHECKING:
    from xavier_core.transfer.buffers import KvBuffer
    from xavier_core.transfer.errors import (
        InvalidPagesError,
        InvalidSourceError,
        LayoutError,
        PeerError,
        StaleEpochError,
        TransferError,
        TransferInFlightError,
    )
    from xavier_core.transfer.kv_transfer import (
        DONE_PREFIX,
        FAIL_PREFIX,
        KvManager,
        KvPoll,
        KvReceiver,
        KvSender,
        done_notif,
        fail_notif,
    )
    from xavier_core.transfer.nixl_backend import NixlAgent, device_mem
    from xavier_core.transfer.nixl_thread import NixlThread
    from xavier_core.transfer.peers import peer_key, split_peer_key
    from xavier_core.transfer.port import KvPort, TransferTotals
    from xavier_core.transfer.runs import Mode, PageRun, coalesce, descriptors, expand, pair_stretches
    from xavier_core.transfer.source import SourceInfo, endpoint_proto
    from xavier_core.transfer.xfer import Transfer

_MODULES: dict[str, str] = {
    "DONE_PREFIX": "xavier_core.transfer.kv_transfer",
    "FAIL_PREFIX": "xavier_core.transfer.kv_transfer",
    "InvalidPagesError": "xavier_core.transfer.errors",
    "InvalidSourceError": "xavier_core.transfer.errors",
    "KvBuffer": "xavier_core.transfer.buffers",
    "KvManager": "xavier_core.transfer.kv_transfer",
    "KvPoll": "xavier_core.transfer.kv_transfer",
    "KvPort": "xavier_core.transfer.port",
    "KvReceiver": "xavier_core.transfer.kv_transfer",
    "KvSender": "xavier_core.transfer.kv_transfer",
    "LayoutError": "xavier_core.transfer.errors",
    "Mode": "xavier_core.transfer.runs",
    "NixlAgent": "xavier_core.transfer.nixl_backend",
    "NixlThread": "xavier_core.transfer.nixl_thread",
    "PageRun": "xavier_core.transfer.runs",
    "PeerError": "xavier_core.transfer.errors",
    "SourceInfo": "xavier_core.transfer.source",
    "StaleEpochError": "xavier_core.transfer.errors",
    "Transfer": "xavier_core.transfer.xfer",
    "TransferError": "xavier_core.transfer.errors",
    "TransferInFlightError": "xavier_core.transfer.errors",
    "TransferTotals": "xavier_core.transfer.port",
    "coalesce": "xavier_core.transfer.runs",
    "descriptors": "xavier_core.transfer.runs",
    "device_mem": "xavier_core.transfer.nixl_backend",
    "done_notif": "xavier_core.transfer.kv_transfer",
    "endpoint_proto": "xavier_core.transfer.source",
    "expand": "xavier_core.transfer.runs",
    "fail_notif": "xavier_core.transfer.kv_transfer",
    "pair_stretches": "xavier_core.transfer.runs",
    "peer_key": "xavier_core.transfer.peers",
    "split_peer_key": "xavier_core.transfer.peers",
}


__getattr__ = lazy_exports(__name__, _MODULES, globals())

__all__ = [
    "DONE_PREFIX",
    "FAIL_PREFIX",
    "InvalidPagesError",
    "InvalidSourceError",
    "KvBuffer",
    "KvManager",
    "KvPoll",
    "KvPort",
    "KvReceiver",
    "KvSender",
    "LayoutError",
    "Mode",
    "NixlAgent",
    "NixlThread",
    "PageRun",
    "PeerError",
    "SourceInfo",
    "StaleEpochError",
    "Transfer",
    "TransferError",
    "TransferInFlightError",
    "TransferTotals",
    "coalesce",
    "descriptors",
    "device_mem",
    "done_notif",
    "endpoint_proto",
    "expand",
    "fail_notif",
    "pair_stretches",
    "peer_key",
    "split_peer_key",
]
