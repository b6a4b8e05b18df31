"""The KV data plane: move pages of registered buffers between peers over NIXL.

What this layer knows: buffers (`KvBuffer`: an address, a length, bytes per page, a device string), page
ids (coalesced into `PageRun`s), and peers (`peer_key(peer_id, epoch)` plus NIXL metadata). It never knows
an engine: the reference engine, the services and SGLang's KV sender/receiver all drive it with exactly
those values, and it imports neither `xavier_core.engine` nor `xavier_services` (a test checks).

Layers, bottom up: `NixlAgent` (one per process: registered buffers, cached peers, READs of page lists);
`KvManager` / `KvSender` / `KvReceiver` (per-room state machines modelled on SGLang's `KVPoll`, driven by
polling); `KvPort` (the asyncio service face: one NIXL thread, publish / pull of contract
`SourceDescriptor`s, the errors the services answer with).
"""

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
