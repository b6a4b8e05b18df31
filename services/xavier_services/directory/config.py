"""Directory configuration: every lease, interval and limit is a key (``[directory]`` in TOML).

Environment: ``XAVIER_DIRECTORY__<KEY>`` (e.g. ``XAVIER_DIRECTORY__ROOM_LEASE_SECONDS=5``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from xavier_core.runtime.config import Address, ServiceConfig, TlsSettings

__all__ = ["DirectoryConfig", "DirectorySettings"]


class DirectorySettings(BaseModel):
    """Leases, intervals and bounds of the directory's soft state."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    room_lease_seconds: float = Field(default=30.0, gt=0.0, le=86400.0)
    """Lease of a room from its opening; a room not completed within it expires. Tombstones of ids
    aborted before anyone opened them are kept this long."""
    peer_lease_seconds: float = Field(default=10.0, gt=0.0, le=3600.0)
    """A peer that does not heartbeat within this is dead; its live rooms are aborted."""
    heartbeat_interval_seconds: float = Field(default=2.0, gt=0.0, le=3600.0)
    """Heartbeat interval suggested to peers (at most half the peer lease)."""
    sweep_interval_seconds: float = Field(default=0.25, gt=0.0, le=60.0)
    """How often the sweeper ends lapsed rooms and peers (calls also check leases lazily)."""
    max_rooms: int = Field(default=65536, ge=1, le=10_000_000)
    """Live rooms (open, source ready, transferring) before CAPACITY_EXHAUSTED; also the bound on
    tombstones."""
    max_peers: int = Field(default=4096, ge=1, le=1_000_000)
    """Registered peers before CAPACITY_EXHAUSTED."""
    max_watchers_per_room: int = Field(default=8, ge=1, le=1024)
    """Waiting BeginTransfer calls per room, and WatchPeerRooms feeds per peer."""
    max_feed_batch: int = Field(default=256, ge=1, le=65536)
    """Room changes one WatchPeerRooms message carries at most."""
    feed_batch_window_seconds: float = Field(default=0.002, ge=0.0, le=1.0)
    """After a change, how long a WatchPeerRooms feed waits for more before sending them in one
    message. Under load a room's changes come a millisecond or two apart and each message costs the
    directory and the peer a gRPC write and read; nothing on a request's path waits on the feed (the
    prefill unpins on it, or earlier on the reader's NIXL notification). 0 sends each change at once."""
    max_page_runs: int = Field(default=16384, ge=1, le=1_000_000)
    """Page runs in one published source."""
    max_regions: int = Field(default=4096, ge=1, le=1_000_000)
    """Memory regions in one transfer endpoint."""
    max_metadata_bytes: int = Field(default=1 << 20, ge=1024, le=64 << 20)
    """NIXL agent metadata bytes in one transfer endpoint."""
    list_page_size: int = Field(default=100, ge=1, le=1000)
    """ListPeers page size when the request gives none."""
    max_list_page_size: int = Field(default=1000, ge=1, le=100_000)
    """Largest ListPeers page; larger requests are coerced down."""
    request_ids_per_room: int = Field(default=8, ge=1, le=1024)
    """Recent request ids remembered per room for idempotent retries."""
    idempotency_entries: int = Field(default=65536, ge=16, le=10_000_000)
    """Recent RegisterPeer request ids remembered for idempotent retries."""
    ended_rooms_retained: int = Field(default=16384, ge=0, le=10_000_000)
    """Ended rooms kept (without their page runs) so late calls see the end state, not NOT_FOUND."""

    backend: Literal["memory", "etcd"] = "memory"
    """Where peers and rooms live: this process's memory (lost on restart; one directory only) or etcd
    (every directory process replays one command log there, so several serve the same mesh and any of
    them may restart; see ``xavier_services.directory.etcd_store``)."""
    etcd_endpoints: list[Address] = Field(
        default_factory=lambda: ["127.0.0.1:2379"], min_length=1, max_length=16
    )
    """etcd client addresses (host:port); calls spread over several round-robin, as etcd's own clients do,
    so a dead member's calls move to the others (IP addresses only when several)."""
    etcd_prefix: str = Field(default="/xavier/directory/", min_length=1, max_length=256)
    """Key prefix of this mesh's directory in etcd (several meshes may share one etcd)."""
    etcd_timeout_seconds: float = Field(default=5.0, gt=0.0, le=300.0)
    """How long a call waits for etcd (retrying while it is unreachable) before UNAVAILABLE."""
    etcd_tls: TlsSettings | None = None
    """mTLS to etcd (``https`` client URLs with ``--client-cert-auth``): etcd's CA, and the certificate
    this directory presents to it. None: plaintext (keep etcd's client port on a private network)."""
    etcd_snapshot_every: int = Field(default=20000, ge=10, le=10_000_000)
    """Commands between snapshots of the state in etcd; after each, the log history before the previous
    snapshot is compacted, so etcd holds at most about two snapshots' worth of commands."""

    @model_validator(mode="after")
    def _check(self) -> DirectorySettings:
        if self.heartbeat_interval_seconds * 2 > self.peer_lease_seconds:
            raise ValueError(
                "heartbeat_interval_seconds must be at most half of peer_lease_seconds "
                f"({self.heartbeat_interval_seconds} vs {self.peer_lease_seconds})"
            )
        if self.list_page_size > self.max_list_page_size:
            raise ValueError("list_page_size must not exceed max_list_page_size")
        return self


class DirectoryConfig(ServiceConfig):
    """The directory process: common service settings plus ``[directory]``."""

    directory: DirectorySettings = DirectorySettings()
