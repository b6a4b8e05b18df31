"""One NIXL agent per process: registered KV buffers, cached peers, READs of page lists.

Progress: agents run without NIXL's progress thread by default (it busy-spins a core). Then NIXL moves
a transfer forward only inside calls on the two agents involved:

- the reading side drives its READ by `Transfer.poll()`;
- the side being read must call `notifications()` (the KV manager's `progress()`) regularly while any of
  its pages may be read: a READ stays PROC until the source polls, and its latency is the source's
  polling interval.

Every call returns at once; a READ that stays PROC past its timeout is cancelled and reported ERR, and a
dead peer surfaces as ERR on the next poll or as `PeerError` from the next call.

Read-end notifications: a READ that carries a notification, and any READ posted behind a notification
on the same endpoint, ends only once the source's NIXL worker has progressed (UCX answers it under
NIXL's peer error handling), so a pull would take up to the source's polling interval. An agent made
with `read_end_agent` (the default) therefore keeps a second agent of its own, with no memory
registered, that connects to each peer as it is added and sends `notify_read_end`'s messages; READs
then carry none and end as soon as their bytes have moved.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from xavier_core.transfer.common import runs
from xavier_core.transfer.common.buffers import KvBuffer
from xavier_core.transfer.common.errors import InvalidPagesError, LayoutError, PeerError, StaleEpochError
from xavier_core.transfer.common.peers import split_peer_key
from xavier_core.transfer.nixl import prepped
from xavier_core.transfer.nixl._raw import MemType, Op, RawAgent, XferState
from xavier_core.transfer.nixl.xfer import Transfer

log = logging.getLogger(__name__)

DEFAULT_TRANSFER_TIMEOUT_S = 30.0
NOTIFIER_MOVE_S = 0.002
"""Least time between two polls of the second agent by `notifications()`: its sends complete at once on
an endpoint already set up (each send also polls it once), so polling it at a decode's every tick would
only cost CPU."""
NOTIFIER_SETTLE_S = 1.0
"""How long after the second agent connects to a peer its first sends may wait for that endpoint to be
set up, which only polling moves (`notifier_settling`)."""


def device_mem(device: str) -> tuple[MemType, int]:
    """NIXL memory type and device id of a torch-style device string ("cpu", "cuda", "cuda:N")."""
    if device == "cpu":
        return "DRAM", 0
    if device == "cuda":
        return "VRAM", 0
    if device.startswith("cuda:") and device[5:].isdigit():
        return "VRAM", int(device[5:])
    raise LayoutError(f"unsupported KV buffer device {device!r} (expected cpu or cuda:N)")


def _num_pages(buffers: Sequence[KvBuffer]) -> int:
    return min(b.num_pages for b in buffers)


def check_buffers(buffers: Sequence[KvBuffer], what: str) -> MemType:
    """Validates a buffer list and returns its single memory type."""
    if not buffers:
        raise LayoutError(f"{what}: no KV buffers")
    mems = {device_mem(b.device)[0] for b in buffers}
    if len(mems) != 1:
        raise LayoutError(f"{what}: buffers mix memory types {sorted(mems)}")
    for i, b in enumerate(buffers):
        if b.addr <= 0 or b.bytes_per_page <= 0 or b.nbytes < b.bytes_per_page:
            raise LayoutError(f"{what}: buffer {i} is invalid ({b})")
    return mems.pop()


@dataclass
class _Peer:
    name: str
    # Prepared lists of the peer's buffer sets (one per set of remote buffers a transfer named).
    prepped: dict[tuple[KvBuffer, ...], prepped.PreppedSide] = field(default_factory=dict)


def register_buffers(raw: RawAgent, buffers: Sequence[KvBuffer], mem: MemType) -> object:
    """Registers `buffers` (already checked to be of memory type `mem`) with `raw`; returns the
    registration handle to deregister later."""
    regions = np.array([(b.addr, b.nbytes, device_mem(b.device)[1]) for b in buffers], dtype=np.uint64)
    return raw.register(regions, mem)


class NixlAgent:
    """This process's NIXL agent. Thread-safe: every NIXL call is serialised by `lock`."""

    def __init__(
        self,
        name: str,
        buffers: Sequence[KvBuffer],
        progress_thread: bool = False,
        *,
        backend: str = "UCX",
        transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
        read_end_agent: bool = True,
    ) -> None:
        self.mem = check_buffers(buffers, "local")
        self.buffers = tuple(buffers)
        self._local_pages = _num_pages(self.buffers)
        self.name = name
        self.transfer_timeout_s = transfer_timeout_s
        self.lock = threading.RLock()
        self.raw = RawAgent(name, progress_thread, backend)
        self._reg: object | None = register_buffers(self.raw, buffers, self.mem)
        self._metadata = self.raw.metadata()
        self._extra: list[object] = []  # registrations beside the KV buffers (a staging slab)
        self._peers: dict[str, _Peer] = {}
        self._live: set[Transfer] = set()
        self._local_prepped: prepped.PreppedSide | None = None  # made at the first prepared transfer
        # Sends read-end notifications apart from the READs' endpoints (see the module's docstring);
        # peer key -> the peer's name as this second agent knows it.
        self._notifier = RawAgent(f"{name}.notify", progress_thread, backend) if read_end_agent else None
        self._notifier_peers: dict[str, str] = {}
        self._notifier_moved = 0.0  # when `notifications()` last moved the second agent's sends
        self._notifier_connected = float("-inf")  # when the second agent last connected to a peer

    @property
    def notifies_apart(self) -> bool:
        """True when read-end notifications leave from the second agent: READs then carry none."""
        return self._notifier is not None

    def metadata(self) -> bytes:
        """This agent's NIXL metadata (exchanged once per epoch through the directory)."""
        return self._metadata

    def regions(self) -> list[tuple[int, int, str]]:
        """Registered regions as (base address, length, device)."""
        return [(b.addr, b.nbytes, b.device) for b in self.buffers]

    def register_extra(self, buffers: Sequence[KvBuffer], what: str = "extra region") -> MemType:
        """Registers a group of buffers beside the KV buffers (a staging slab, an engine's aux slots;
        deregistered by `close`) and retakes the metadata, so one blob describes every group: call
        before the metadata is handed to peers. Returns the group's memory type."""
        mem = check_buffers(buffers, what)
        with self.lock:
            self._extra.append(register_buffers(self.raw, buffers, mem))
            self._metadata = self.raw.metadata()
        return mem

    def add_peer(self, peer_key: str, metadata: bytes) -> str:
        """Loads a peer's metadata once per key and returns its agent name.

        With keys made by `peer_key(id, epoch)`, older epochs of the same id are dropped first, and
        an epoch older than a loaded one raises `StaleEpochError`.
        """
        with self.lock:
            peer = self._peers.get(peer_key)
            if peer is not None:
                return peer.name
            parsed = split_peer_key(peer_key)
            if parsed is not None:
                peer_id, epoch = parsed
                newer = [k for k, e in self._epochs(peer_id) if e > epoch]
                if newer:
                    raise StaleEpochError(f"peer {peer_key!r} is older than loaded {newer[0]!r}")
                self.drop_peer_id_epochs_except(peer_id, epoch)
            try:
                name = self.raw.add_remote(metadata)
            except Exception as exc:
                raise PeerError(f"cannot load metadata of peer {peer_key!r}: {exc}") from exc
            self._peers[peer_key] = _Peer(name)
            self._connect_notifier(peer_key, metadata)
            return name

    def _connect_notifier(self, peer_key: str, metadata: bytes) -> None:
        """Loads the peer into the second agent and connects to it now, while the first READ runs; a peer
        the second agent cannot load is told through this agent (`notify_read_end`)."""
        if self._notifier is None:
            return
        try:
            name = self._notifier.add_remote(metadata)
            self._notifier.connect(name)
        except Exception as exc:
            log.warning("read-end notifications to %s go through the main agent: %s", peer_key, exc)
            return
        self._notifier_peers[peer_key] = name
        self._notifier_connected = time.monotonic()

    def notifier_settling(self) -> bool:
        """True for `NOTIFIER_SETTLE_S` after the second agent connected to a peer: its owner keeps
        calling `notifications()` meanwhile, so a first send queued behind that endpoint's set-up
        goes out even if nothing else happens."""
        return time.monotonic() - self._notifier_connected < NOTIFIER_SETTLE_S

    def peer_keys(self) -> list[str]:
        with self.lock:
            return list(self._peers)

    def drop_peer(self, peer_key: str) -> None:
        """Forgets a peer; its remote agent is unloaded once no other key names it. Idempotent."""
        with self.lock:
            peer = self._peers.pop(peer_key, None)
            if peer is None:
                return
            self._release_prepped(peer.prepped.values())
            self._drop_notifier_peer(peer_key)
            if any(p.name == peer.name for p in self._peers.values()):
                return
            try:
                self.raw.remove_remote(peer.name)
            except Exception as exc:
                log.warning("removing remote agent %s failed: %s", peer.name, exc)

    def _drop_notifier_peer(self, peer_key: str) -> None:
        name = self._notifier_peers.pop(peer_key, None)
        if self._notifier is None or name is None or name in self._notifier_peers.values():
            return
        try:
            self._notifier.remove_remote(name)
        except Exception as exc:
            log.warning("removing remote agent %s from the read-end agent failed: %s", name, exc)

    def drop_peer_id_epochs_except(self, peer_id: str, epoch: int) -> list[str]:
        """Drops every cached epoch of `peer_id` other than `epoch`; returns the dropped keys."""
        with self.lock:
            stale = [k for k, e in self._epochs(peer_id) if e != epoch]
            for k in stale:
                self.drop_peer(k)
            return stale

    def _epochs(self, peer_id: str) -> list[tuple[str, int]]:
        """(key, epoch) of every cached key of `peer_id`."""
        found = ((k, split_peer_key(k)) for k in self._peers)
        return [(k, p[1]) for k, p in found if p is not None and p[0] == peer_id]

    def read(
        self,
        peer_key: str,
        remote_buffers: Sequence[KvBuffer],
        src_page_ids: Sequence[int] | npt.NDArray[np.integer],
        dst_page_ids: Sequence[int] | npt.NDArray[np.integer],
        notif: bytes = b"",
        mode: runs.Mode = "coalesced",
        timeout_s: float | None = None,
    ) -> Transfer:
        """READs remote pages `src_page_ids[i]` into local pages `dst_page_ids[i]` for every buffer.

        `notif` reaches the peer's `notifications()` once the READ has completed.
        """
        return self._transfer(
            "READ", peer_key, remote_buffers, src_page_ids, dst_page_ids, notif, mode, timeout_s
        )

    def write(
        self,
        peer_key: str,
        remote_buffers: Sequence[KvBuffer],
        src_page_ids: Sequence[int] | npt.NDArray[np.integer],
        dst_page_ids: Sequence[int] | npt.NDArray[np.integer],
        notif: bytes = b"",
        mode: runs.Mode = "coalesced",
        timeout_s: float | None = None,
    ) -> Transfer:
        """WRITEs local pages `src_page_ids[i]` into the peer's pages `dst_page_ids[i]` for every buffer,
        with the checks and descriptors of `read`; `notif` reaches the peer once the bytes are there."""
        return self._transfer(
            "WRITE", peer_key, remote_buffers, dst_page_ids, src_page_ids, notif, mode, timeout_s
        )

    def _transfer(
        self,
        op: Op,
        peer_key: str,
        remote_buffers: Sequence[KvBuffer],
        remote_page_ids: Sequence[int] | npt.NDArray[np.integer],
        local_page_ids: Sequence[int] | npt.NDArray[np.integer],
        notif: bytes,
        mode: runs.Mode,
        timeout_s: float | None,
    ) -> Transfer:
        """One READ (remote pages into local ones) or WRITE (local pages into remote ones) of the KV
        buffers, page `remote_page_ids[i]` paired with `local_page_ids[i]`; the written side's ids must
        not repeat."""
        with self.lock:  # held from the prepared list's lookup to its use: `drop_peer` releases it
            key = tuple(remote_buffers)
            peer = self._peers.get(peer_key)
            side = peer.prepped.get(key) if peer is not None and mode == "coalesced" else None
            if side is None:  # a prepared side's buffers were checked when it was prepared
                remote_mem = check_buffers(remote_buffers, f"peer {peer_key}")
                _check_layout(remote_buffers, self.buffers, "KV")
            remote = runs.as_page_array(remote_page_ids)
            local = runs.as_page_array(local_page_ids)
            remote_side, local_side = (
                ("destination", "source") if op == "WRITE" else ("source", "destination")
            )
            remote_pages = _num_pages(remote_buffers) if side is None else side.num_pages
            _check_range(remote, remote_pages, f"KV {remote_side}")
            _check_range(local, self._local_pages, f"KV {local_side}")
            if not prepped.all_distinct(remote if op == "WRITE" else local):
                raise InvalidPagesError("KV destination page ids repeat")
            if remote.size != local.size:
                raise InvalidPagesError(
                    f"page count mismatch: source has {remote.size} pages, destination {local.size}"
                )
            if side is None and mode == "coalesced" and prepped.preparable(key, remote_pages):
                side = self._prep_remote(peer_key, peer, key, remote_pages, remote_mem)
            if side is not None:
                return self._post_prepped(peer_key, side, remote, local, notif, timeout_s, op)
        table = runs.descriptors(
            [b.addr for b in remote_buffers],
            [b.addr for b in self.buffers],
            [b.bytes_per_page for b in self.buffers],
            remote,
            local,
            mode,
        )
        per_buffer = table.shape[0] // len(self.buffers)
        local_list = _dlist(table[:, 1], table[:, 2], self.buffers, per_buffer)
        remote_list = _dlist(table[:, 0], table[:, 2], remote_buffers, per_buffer)
        return self._post_read(
            peer_key, local_list, self.mem, remote_list, remote_mem, table, notif, timeout_s, f"KV {op}", op
        )

    def _prep_remote(
        self, peer_key: str, peer: _Peer | None, key: tuple[KvBuffer, ...], num_pages: int, mem: MemType
    ) -> prepped.PreppedSide | None:
        """Makes `peer`'s prepared list of `key` (and the local one, the first time), under `lock`, for a
        transfer that found none; None when the local pool is too large to prepare. `PeerError` when
        the peer is unknown or NIXL refuses."""
        if peer is None:
            raise PeerError(f"unknown peer {peer_key!r} (add_peer first)")
        local_pages = self._local_pages
        if not prepped.preparable(self.buffers, local_pages):
            return None
        try:
            if self._local_prepped is None:
                self._local_prepped = prepped.prep_side(
                    self.raw, "", self.buffers, local_pages, self.mem, _devices(self.buffers)
                )
            side = prepped.prep_side(self.raw, peer.name, key, num_pages, mem, _devices(key))
        except Exception as exc:
            raise PeerError(f"cannot prepare descriptors of peer {peer_key!r}: {exc}") from exc
        peer.prepped[key] = side
        return side

    def _post_prepped(
        self,
        peer_key: str,
        side: prepped.PreppedSide,
        remote: npt.NDArray[np.int64],
        local: npt.NDArray[np.int64],
        notif: bytes,
        timeout_s: float | None,
        op: Op,
    ) -> Transfer:
        """Posts one READ (or WRITE) of pages by index into the prepared lists (under `lock`)."""
        mine = self._local_prepped
        if mine is None:
            raise PeerError("no prepared local descriptor list")  # prepared with every remote side
        ridx, lidx = side.indices(remote), mine.indices(local)
        descs = prepped.stretch_count(remote, local) * len(self.buffers)
        nbytes = local.size * sum(b.bytes_per_page for b in self.buffers)
        try:
            handle, state = self.raw.read_prepped(op, mine.handle, lidx, side.handle, ridx, notif)
        except Exception as exc:
            raise PeerError(f"KV {op} with peer {peer_key!r} failed: {type(exc).__name__}: {exc}") from exc
        return self._track(handle, state, nbytes, descs, timeout_s)

    def _release_prepped(self, sides: Iterable[prepped.PreppedSide]) -> None:
        for side in sides:
            try:
                self.raw.release_prepped(side.handle)
            except Exception as exc:
                log.warning("releasing a prepared descriptor list failed: %s", exc)

    def read_ranges(
        self,
        peer_key: str,
        remote_device: str,
        local_device: str,
        table: npt.NDArray[np.uint64],
        notif: bytes = b"",
        timeout_s: float | None = None,
    ) -> Transfer:
        """READs byte ranges of registered memory, one descriptor per `table` row (remote address, local
        address, length): slab chunks, whose bounds the caller has checked against both slabs."""
        remote_mem, remote_dev = device_mem(remote_device)
        local_mem, local_dev = device_mem(local_device)
        n = table.shape[0]
        local = np.stack((table[:, 1], table[:, 2], np.full(n, local_dev, dtype=np.uint64)), axis=1)
        remote = np.stack((table[:, 0], table[:, 2], np.full(n, remote_dev, dtype=np.uint64)), axis=1)
        return self._post_read(
            peer_key, local, local_mem, remote, remote_mem, table, notif, timeout_s, "staged READ"
        )

    def _post_read(
        self,
        peer_key: str,
        local: npt.NDArray[np.uint64],
        local_mem: MemType,
        remote: npt.NDArray[np.uint64],
        remote_mem: MemType,
        table: npt.NDArray[np.uint64],
        notif: bytes,
        timeout_s: float | None,
        what: str,
        op: Op = "READ",
    ) -> Transfer:
        """Posts one READ (or WRITE) of descriptor lists built from `table` (rows: remote, local, length)."""
        with self.lock:
            peer = self._peers.get(peer_key)
            if peer is None:
                raise PeerError(f"unknown peer {peer_key!r} (add_peer first)")
            try:
                handle, state = self.raw.read(local, local_mem, remote, remote_mem, peer.name, notif, op)
            except Exception as exc:
                raise PeerError(f"{what} with peer {peer_key!r} failed: {type(exc).__name__}: {exc}") from exc
            return self._track(handle, state, int(table[:, 2].sum()), table.shape[0], timeout_s)

    def _track(
        self, handle: object, state: XferState, nbytes: int, descs: int, timeout_s: float | None
    ) -> Transfer:
        """A posted handle as a live `Transfer` (under `lock`), settled at once if it already ended."""
        timeout = self.transfer_timeout_s if timeout_s is None else timeout_s
        xfer = Transfer(self.raw, self.lock, handle, nbytes, descs, timeout, self._live.discard)
        self._live.add(xfer)
        xfer._settle(state)
        return xfer

    def live_transfers(self) -> int:
        """Transfers posted by this agent whose NIXL handles are not released yet."""
        with self.lock:
            return len(self._live)

    def notifications(self) -> list[tuple[str, bytes]]:
        """New notifications as (sender agent name, message). Calling this also drives progress."""
        with self.lock:
            got = self.raw.notifs()
            now = time.monotonic()
            if self._notifier is not None and now - self._notifier_moved >= NOTIFIER_MOVE_S:
                self._notifier_moved = now
                self._notifier.notifs()  # it receives none: this moves its sends forward
        return [(who, m) for who, msgs in got.items() for m in msgs]

    def send_notif(self, peer_key: str, msg: bytes) -> None:
        """Sends a standalone notification; `PeerError` if the peer is unknown or gone."""
        with self.lock:
            peer = self._peers.get(peer_key)
            if peer is None:
                raise PeerError(f"unknown peer {peer_key!r}")
            try:
                self.raw.send_notif(peer.name, msg)
            except Exception as exc:
                raise PeerError(f"notification to {peer_key!r} failed: {type(exc).__name__}") from exc

    def notify_read_end(self, peer_key: str, msg: bytes) -> None:
        """Sends a read's end (done or failed) to the source: from the second agent when this agent has
        one and it reaches the peer (it posts no READ, so the message queues behind none and no READ
        queues behind it), else as `send_notif`. `PeerError` if the peer is unknown or gone."""
        with self.lock:
            name = self._notifier_peers.get(peer_key)
            if self._notifier is not None and name is not None:
                try:
                    self._notifier.send_notif(name, msg)
                    self._notifier.notifs()
                    return
                except Exception as exc:  # the main agent says whether the peer is gone
                    log.info("read-end agent could not notify %s, trying the main agent: %s", peer_key, exc)
            self.send_notif(peer_key, msg)

    def close(self) -> None:
        """Cancels live READs, unloads peers and deregisters the buffers. Idempotent."""
        with self.lock:
            for xfer in list(self._live):
                xfer.release()
            for key in list(self._peers):
                self.drop_peer(key)
            if self._local_prepped is not None:
                self._release_prepped([self._local_prepped])
                self._local_prepped = None
            while self._extra:
                self.raw.deregister(self._extra.pop())
            if self._reg is not None:
                try:
                    self.raw.deregister(self._reg)
                finally:
                    self._reg = None

    def __enter__(self) -> NixlAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_layout(remote: Sequence[KvBuffer], local: Sequence[KvBuffer], label: str) -> None:
    if len(remote) != len(local):
        raise LayoutError(f"{label} buffer count differs: peer {len(remote)}, local {len(local)}")
    for i, (r, mine) in enumerate(zip(remote, local, strict=True)):
        if r.bytes_per_page != mine.bytes_per_page:
            raise LayoutError(
                f"{label} buffer {i}: bytes_per_page differs "
                f"(peer {r.bytes_per_page}, local {mine.bytes_per_page})"
            )


def _check_range(pages: npt.NDArray[np.int64], limit: int, side: str) -> None:
    if pages.size and int(pages.max()) >= limit:
        raise InvalidPagesError(f"{side} page {int(pages.max())} is outside the pool ({limit} pages)")


def _devices(buffers: Sequence[KvBuffer]) -> list[int]:
    return [device_mem(b.device)[1] for b in buffers]


def _dlist(
    addrs: npt.NDArray[np.uint64], nbytes: npt.NDArray[np.uint64], buffers: Sequence[KvBuffer], per: int
) -> npt.NDArray[np.uint64]:
    devs = np.repeat(np.array([device_mem(b.device)[1] for b in buffers], dtype=np.uint64), per)
    return np.ascontiguousarray(np.stack((addrs, nbytes, devs), axis=1))
