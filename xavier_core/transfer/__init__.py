"""Engine-neutral KV transfer: page runs, the NIXL agent, and the KV manager / sender / receiver."""

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
from xavier_core.transfer.nixl_backend import NixlAgent, device_mem, peer_key, split_peer_key
from xavier_core.transfer.runs import Mode, PageRun, coalesce, descriptors, expand, pair_stretches
from xavier_core.transfer.source import SourceInfo
from xavier_core.transfer.xfer import Transfer

__all__ = [
    "DONE_PREFIX",
    "FAIL_PREFIX",
    "InvalidPagesError",
    "InvalidSourceError",
    "KvManager",
    "KvPoll",
    "KvReceiver",
    "KvSender",
    "LayoutError",
    "Mode",
    "NixlAgent",
    "PageRun",
    "PeerError",
    "SourceInfo",
    "StaleEpochError",
    "Transfer",
    "TransferError",
    "TransferInFlightError",
    "coalesce",
    "descriptors",
    "device_mem",
    "done_notif",
    "expand",
    "fail_notif",
    "pair_stretches",
    "peer_key",
    "split_peer_key",
]
