"""Registered peers: epochs, leases, and what happens to a peer's rooms when its epoch ends."""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Callable, Iterable

from xavier.v1 import types_pb2

from xavier_core.contract import KvLayout, require_compatible
from xavier_core.runtime.errors import CapacityExhausted, FailedPrecondition, InvalidArgument, NotFound
from xavier_core.runtime.logging import get_logger
from xavier_services.directory.config import DirectorySettings
from xavier_services.directory.records import PeerRecord
from xavier_services.directory.validate import (
    check_endpoint,
    check_layout,
    check_peer_id,
    check_request_id,
    check_text,
)

__all__ = ["PeerTable"]
_log = get_logger("xavier.directory.peers")

_KV_ROLES = (types_pb2.ROLE_PREFILL, types_pb2.ROLE_DECODE, types_pb2.ROLE_UNIFIED)
_ENDPOINT_ROLES = (types_pb2.ROLE_PREFILL, types_pb2.ROLE_DECODE)

# on_gone(peer, why) -> rooms aborted; called when an epoch ends (restart, unregister, lapsed lease).
OnGone = Callable[[PeerRecord, str], int]


class PeerTable:
    """Peers by id. Epochs grow across re-registrations and across directory restarts.

    An epoch is ``max(previous + 1, wall-clock microseconds)``: a restarted directory that forgot every
    peer still hands out epochs larger than any it gave before (clocks permitting), so a caller holding
    an epoch from before the restart is told STALE_EPOCH instead of matching by accident.
    """

    def __init__(
        self,
        settings: DirectorySettings,
        clock: Callable[[], float],
        wall: Callable[[], float],
        on_gone: OnGone,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.wall = wall
        self.on_gone = on_gone
        self._peers: dict[str, PeerRecord] = {}
        self._last_epoch: dict[str, int] = {}
        self._register_ids: OrderedDict[str, tuple[str, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._peers)

    def register(
        self,
        request_id: str,
        peer_id: str,
        role: int,
        address: str,
        layout: types_pb2.KvLayout | None,
        endpoint: types_pb2.TransferEndpoint | None,
        new_id: str = "",
    ) -> PeerRecord:
        """Registers a peer under a new epoch (ending its previous epoch); idempotent by ``request_id``.

        Without ``peer_id`` the peer is named ``new_id``, else a random id (a replicated directory names
        it before the command is logged, so every replica picks the same name).
        """
        check_request_id(request_id)
        if request_id in self._register_ids:
            known_id, known_epoch = self._register_ids[request_id]
            peer = self.get(known_id)
            if peer is not None and peer.epoch == known_epoch and (not peer_id or peer_id == known_id):
                peer.expires_at = self.clock() + self.settings.peer_lease_seconds
                return peer
        if peer_id:
            check_peer_id(peer_id)
        else:
            peer_id = new_id or f"peer-{secrets.token_hex(8)}"
        if role not in types_pb2.Role.values() or role == types_pb2.ROLE_UNSPECIFIED:
            raise InvalidArgument(f"role {role} is not a valid role", field="role")
        check_text(address, "address", required=True)
        kv_layout: KvLayout | None = None
        if role in _KV_ROLES:
            if layout is None:
                raise InvalidArgument(
                    "layout is required for prefill, decode and unified peers", field="layout"
                )
            check_layout(layout)
            kv_layout = KvLayout.from_proto(layout)
        if role in _ENDPOINT_ROLES and endpoint is None:
            raise InvalidArgument("endpoint is required for prefill and decode peers", field="endpoint")
        # A unified replica that shares its prefixes (handoff.share_prefixes) has one too; others none.
        kept = endpoint if role in _ENDPOINT_ROLES or (role == types_pb2.ROLE_UNIFIED and endpoint) else None
        if kept is not None:
            check_endpoint(kept, self.settings, "endpoint")
        old = self.get(peer_id)
        if old is None and len(self._peers) >= self.settings.max_peers:
            raise CapacityExhausted(f"{len(self._peers)} peers registered", limit=self.settings.max_peers)
        epoch = max(self._last_epoch.get(peer_id, 0) + 1, int(self.wall() * 1_000_000))
        if old is not None:
            del self._peers[peer_id]
            self.on_gone(old, "restarted")
        peer = PeerRecord(
            peer_id=peer_id,
            epoch=epoch,
            role=role,
            address=address,
            layout=layout if kv_layout is not None else None,
            kv_layout=kv_layout,
            fingerprint=kv_layout.fingerprint if kv_layout is not None else "",
            endpoint=kept,
            expires_at=self.clock() + self.settings.peer_lease_seconds,
        )
        self._peers[peer_id] = peer
        self._last_epoch[peer_id] = epoch
        if len(self._last_epoch) > 4 * self.settings.max_peers:
            # Wall-clock epochs keep growing without the memory; forget peers that are gone.
            self._last_epoch = {pid: p.epoch for pid, p in self._peers.items()}
        if request_id:
            self._register_ids[request_id] = (peer_id, epoch)
            if len(self._register_ids) > self.settings.idempotency_entries:
                self._register_ids.popitem(last=False)
        return peer

    def heartbeat(
        self, request_id: str, peer_id: str, epoch: int, load: types_pb2.PeerLoad | None
    ) -> PeerRecord | None:
        """Renews the lease; None when the directory does not know this peer (it must register).

        A heartbeat is idempotent by nature (a repeat renews the same lease), so its request id is only
        checked, not remembered.
        """
        check_request_id(request_id)
        check_peer_id(peer_id)
        peer = self.get(peer_id)
        if peer is None or epoch > peer.epoch:
            return None
        if epoch < peer.epoch:
            raise _stale(peer, epoch)
        peer.expires_at = self.clock() + self.settings.peer_lease_seconds
        if load is not None:
            peer.load = load
        return peer

    def unregister(self, peer_id: str, epoch: int) -> int:
        """Removes the peer (unknown peers are a no-op); returns the rooms aborted."""
        check_peer_id(peer_id)
        peer = self.get(peer_id)
        if peer is None:
            return 0
        if epoch != peer.epoch:
            raise _stale(peer, epoch)
        del self._peers[peer_id]
        return self.on_gone(peer, "unregistered")

    def get(self, peer_id: str) -> PeerRecord | None:
        """The live peer (a lapsed lease ends it here rather than waiting for the sweeper)."""
        peer = self._peers.get(peer_id)
        if peer is not None and peer.expires_at <= self.clock():
            del self._peers[peer_id]
            _log.warning(
                "peer lease expired", peer_id=peer_id, epoch=peer.epoch, role=types_pb2.Role.Name(peer.role)
            )
            self.on_gone(peer, "lease expired")
            return None
        return peer

    def current(self, peer_id: str, epoch: int, roles: Iterable[int]) -> PeerRecord:
        """The live peer at ``epoch`` with one of ``roles``, or PEER_NOT_FOUND / STALE_EPOCH / WRONG_ROLE."""
        peer = self.get(peer_id)
        if peer is None:
            raise NotFound(f"peer {peer_id!r} is not registered", reason="PEER_NOT_FOUND", peer_id=peer_id)
        if epoch != peer.epoch:
            raise _stale(peer, epoch)
        if peer.role not in roles:
            raise FailedPrecondition(
                f"peer {peer_id!r} has role {types_pb2.Role.Name(peer.role)}",
                reason="WRONG_ROLE",
                peer_id=peer_id,
            )
        return peer

    @staticmethod
    def require_compatible(prefill: PeerRecord, decode: PeerRecord) -> None:
        """LAYOUT_MISMATCH naming each differing field unless the two layouts share a fingerprint."""
        if prefill.kv_layout is None or decode.kv_layout is None:
            raise FailedPrecondition("peer has no KV layout", reason="WRONG_ROLE")
        if prefill.fingerprint != decode.fingerprint:
            require_compatible(prefill.kv_layout, decode.kv_layout, a_name="prefill", b_name="decode")

    def sweep(self) -> int:
        """Ends every peer whose lease lapsed; returns how many."""
        now = self.clock()
        lapsed = [p.peer_id for p in self._peers.values() if p.expires_at <= now]
        for peer_id in lapsed:
            self.get(peer_id)
        return len(lapsed)

    def next_expiry(self) -> float:
        """The earliest lease end among live peers (infinity with none)."""
        return min((p.expires_at for p in self._peers.values()), default=float("inf"))

    def page(self, page_size: int, after: str, role: int, fingerprint: str) -> tuple[list[PeerRecord], str]:
        """Peers ordered by id after ``after``, filtered; returns the page and the next cursor ("" at end)."""
        self.sweep()
        ids = sorted(
            p.peer_id
            for p in self._peers.values()
            if p.peer_id > after
            and (role == types_pb2.ROLE_UNSPECIFIED or p.role == role)
            and (not fingerprint or p.fingerprint == fingerprint)
        )
        chosen = [self._peers[i] for i in ids[:page_size]]
        return chosen, (chosen[-1].peer_id if len(ids) > page_size else "")

    def by_role(self) -> dict[int, int]:
        """Live peers per role."""
        counts: dict[int, int] = {}
        for peer in self._peers.values():
            counts[peer.role] = counts.get(peer.role, 0) + 1
        return counts


def _stale(peer: PeerRecord, epoch: int) -> FailedPrecondition:
    return FailedPrecondition(
        f"epoch {epoch} of peer {peer.peer_id!r} is stale (current {peer.epoch})",
        reason="STALE_EPOCH",
        peer_id=peer.peer_id,
        epoch=epoch,
        current_epoch=peer.epoch,
    )
