"""The KV data plane: move pages of registered buffers between peers over NIXL.

What this layer knows: buffers (`KvBuffer`: an address, a length, bytes per page, a device string), page
ids (coalesced into `PageRun`s), and peers (`peer_key(peer_id, epoch)` plus NIXL metadata). It never knows
an engine: the reference engine, the services and SGLang's KV sender/receiver all drive it with exactly
those values, and it imports neither `xavier_core.engine` nor `xavier_services` (a test checks).

Rooms, bottom up (each package's docstring is its own map):
- `common`: the shared types: buffers, page runs, peer keys, the published source and its wire form, the
  slab layout, the typed errors.
- `nixl`: `NixlAgent` (one per process: registered buffers, cached peers, READs of page lists), the posted
  READ (`Transfer`), `KvManager` / `KvSender` / `KvReceiver` (per-room state machines modelled on SGLang's
  `KVPoll`, driven by polling) and the one NIXL thread.
- `cuda`: between two GPUs of one host, CUDA IPC (a peer's pool mapped once per epoch) and the fused
  page-copy kernel.
- `staged`: across hosts, the staged transport: a room's pages gathered into whole slab chunks, READ and
  scattered chunk by chunk.
- `port`: `KvPort`, the asyncio service face: one NIXL thread, publish / pull of contract
  `SourceDescriptor`s over whichever transport `port.transport` picks, how a source's read ended
  (`ReadEnd`), the errors the services answer with, and the port's metrics.

A room imports only rooms above it in that list (`nixl` and `cuda` use `common`, `staged` those three,
`port` all; a test checks). `peers.py` here is the old path of `common.peers`, kept for one importer
outside the package. Names load on first use (PEP 562), so importing one module of the package (the
engine imports `common.buffers`) does not load NIXL, gRPC or the protos.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xavier_core._lazy import lazy_exports

if TYPE_CHECKING:
    from xavier_core.transfer.common.buffers import KvBuffer
    from xavier_core.transfer.common.errors import (
        InvalidPagesError,
        InvalidSourceError,
        LayoutError,
        PeerError,
        StaleEpochError,
        TransferError,
        TransferInFlightError,
    )
    from xavier_core.transfer.common.peers import peer_key, split_peer_key
    from xavier_core.transfer.common.runs import Mode, PageRun, coalesce, descriptors, expand, pair_stretches
    from xavier_core.transfer.common.source import SourceInfo, endpoint_proto
    from xavier_core.transfer.nixl.agent import NixlAgent, device_mem
    from xavier_core.transfer.nixl.rooms import (
        DONE_PREFIX,
        FAIL_PREFIX,
        KvManager,
        KvPoll,
        KvReceiver,
        KvSender,
        done_notif,
        fail_notif,
    )
    from xavier_core.transfer.nixl.thread import NixlThread
    from xavier_core.transfer.nixl.xfer import Transfer
    from xavier_core.transfer.port.kv_port import KvPort, ReadEnd, TransferTotals

_MODULES: dict[str, str] = {
    "DONE_PREFIX": "xavier_core.transfer.nixl.rooms",
    "FAIL_PREFIX": "xavier_core.transfer.nixl.rooms",
    "InvalidPagesError": "xavier_core.transfer.common.errors",
    "InvalidSourceError": "xavier_core.transfer.common.errors",
    "KvBuffer": "xavier_core.transfer.common.buffers",
    "KvManager": "xavier_core.transfer.nixl.rooms",
    "KvPoll": "xavier_core.transfer.nixl.rooms",
    "KvPort": "xavier_core.transfer.port.kv_port",
    "KvReceiver": "xavier_core.transfer.nixl.rooms",
    "KvSender": "xavier_core.transfer.nixl.rooms",
    "LayoutError": "xavier_core.transfer.common.errors",
    "Mode": "xavier_core.transfer.common.runs",
    "NixlAgent": "xavier_core.transfer.nixl.agent",
    "NixlThread": "xavier_core.transfer.nixl.thread",
    "PageRun": "xavier_core.transfer.common.runs",
    "PeerError": "xavier_core.transfer.common.errors",
    "ReadEnd": "xavier_core.transfer.port.kv_port",
    "SourceInfo": "xavier_core.transfer.common.source",
    "StaleEpochError": "xavier_core.transfer.common.errors",
    "Transfer": "xavier_core.transfer.nixl.xfer",
    "TransferError": "xavier_core.transfer.common.errors",
    "TransferInFlightError": "xavier_core.transfer.common.errors",
    "TransferTotals": "xavier_core.transfer.port.kv_port",
    "coalesce": "xavier_core.transfer.common.runs",
    "descriptors": "xavier_core.transfer.common.runs",
    "device_mem": "xavier_core.transfer.nixl.agent",
    "done_notif": "xavier_core.transfer.nixl.rooms",
    "endpoint_proto": "xavier_core.transfer.common.source",
    "expand": "xavier_core.transfer.common.runs",
    "fail_notif": "xavier_core.transfer.nixl.rooms",
    "pair_stretches": "xavier_core.transfer.common.runs",
    "peer_key": "xavier_core.transfer.common.peers",
    "split_peer_key": "xavier_core.transfer.common.peers",
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
    "ReadEnd",
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
