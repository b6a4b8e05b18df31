"""The directory on etcd: every directory process replays one command log kept in etcd.

Why a log and not one etcd key per room: the room lifecycle has one implementation,
:class:`~xavier_services.directory.state.DirectoryState`, and a second one written as etcd transactions
would drift from it. Instead each mutating call (register, heartbeat, publish, join, begin, complete,
abort, sweep) is *proposed*: written as a command to one etcd key. etcd orders the writes (the key's
revisions), every directory process watches that key from the revision it has applied and applies each
command, in that order, to its own in-memory ``DirectoryState``. The state machine is deterministic
given the command and its time, so every replica holds the same peers and rooms, and each one fires
its listener for every change: a WatchPeerRooms feed or a waiting BeginTransfer on any directory sees
a room change proposed through any other.

* Time: a command carries its proposer's wall clock; a replica's clock is the latest command time (never
  going back), so leases lapse at the same log position everywhere. Leases end through commands: a
  call touching the room or peer, or a ``sweep`` that any directory proposes once its replica has a lease
  past due. Reads (GetRoom, ListPeers, a feed's snapshot) first wait until the replica has applied
  everything etcd holds (a linearizable read of the key's revision), so a caller that wrote through one
  directory reads its write through another.
* Replies: the proposer's own replica computes the reply (the record or the typed error) when it
  applies the command; the command names its proposer and a sequence number to find the waiting call.
* Failure: a directory that dies loses nothing (the log is in etcd); a new or restarted one loads the
  newest snapshot, replays the log after it and serves once it has caught up. While etcd is unreachable
  calls retry for ``etcd_timeout_seconds`` and then fail UNAVAILABLE; the watch resumes from the last
  applied revision.
* A command applied twice (a write retried after a lost reply) is harmless: every mutating call is
  idempotent (by request id, or by the room's state).
* Snapshots: every ``etcd_snapshot_every`` commands a replica writes its state (``etcd_snapshots.py``)
  and compacts etcd's history to the snapshot before, so the log does not grow without bound. A replica
  that fell behind a compaction reloads the newest snapshot and goes on from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from typing import Any, TypeVar

import grpc
from aetcd.rpc import kv_pb2
from aetcd.rpc import rpc_pb2 as epb
from aetcd.rpc import rpc_pb2_grpc as egrpc

from xavier_core.runtime.channels import open_channel
from xavier_core.runtime.errors import Unavailable, XavierError
from xavier_core.runtime.logging import get_logger
from xavier_core.runtime.tasks import cancel_and_wait
from xavier_services.directory.commands import Command, Register
from xavier_services.directory.config import DirectorySettings
from xavier_services.directory.etcd_commands import Arg, Entry, command_from_args, decode_entry, encode_entry
from xavier_services.directory.etcd_snapshots import SnapshotStore
from xavier_services.directory.records import RoomRecord
from xavier_services.directory.snapshot import dump_state, load_state
from xavier_services.directory.state import DirectoryState

__all__ = ["EtcdLog"]

_log = get_logger("xavier.directory.etcd")
R = TypeVar("R")


class EtcdLog:
    """One directory process's replica of the shared state, and its way to propose changes."""

    def __init__(self, settings: DirectorySettings, *, wall: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.wall = wall
        self._time = 0.0
        self._reading = False
        self.state = DirectoryState(settings, clock=self._clock, wall=self._clock)
        self.applied = 0
        """etcd revision of the last command applied to :attr:`state`."""
        self._key = settings.etcd_prefix.encode() + b"log"
        self._source = uuid.uuid4().hex
        self._seq = 0
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._syncs: list[tuple[int, asyncio.Future[None]]] = []
        self._channel: grpc.aio.Channel | None = None
        self._kv: egrpc.KVStub | None = None
        self._follower: asyncio.Task[None] | None = None
        self.reconnects = 0
        self._since_snapshot = 0
        self._snapshotting: asyncio.Task[None] | None = None
        self.snapshots = SnapshotStore(settings.etcd_prefix, self._call)
        self.snapshots_written = 0
        self.snapshot_loaded = 0
        """Revision of the snapshot this replica last loaded (0: none)."""

    def _clock(self) -> float:
        return float("-inf") if self._reading else self._time

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """A read of the replica that ends nothing: leases are seen as not yet lapsed.

        The in-memory state ends a lapsed lease on any access, reads included; here that would end it on
        this replica only (and perhaps with another cause than the command that ends it everywhere
        does, e.g. LEASE_EXPIRED before PEER_LOST). Reads stay pure; the sweeper's ``sweep`` command
        ends lapsed leases on every replica within ``sweep_interval_seconds``. The block must not await.
        """
        self._reading = True
        try:
            yield
        finally:
            self._reading = False

    async def start(self) -> None:
        """Connects, loads the newest snapshot, follows the log; returns once caught up with etcd."""
        s = self.settings
        self._channel = open_channel(",".join(s.etcd_endpoints), tls=s.etcd_tls, mesh=False)
        self._kv = egrpc.KVStub(self._channel)
        await self._restore()
        self._follower = asyncio.create_task(self._follow(), name="directory-etcd-follower")
        await self.sync()

    async def stop(self) -> None:
        await cancel_and_wait(self._follower)
        if self._snapshotting is not None:
            # A snapshot still being written would otherwise call etcd on the closed channel.
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(self._snapshotting, self.settings.etcd_timeout_seconds)
        if self._channel is not None:
            await self._channel.close()

    # --- proposing and reading --------------------------------------------------------

    async def submit(self, command: Command[R]) -> R:
        """Logs ``command`` and returns what this replica's state machine answered (or raises its error).

        A Register is given the id an id-less peer takes here, before logging, so every replica agrees.
        """
        logged: Command[Any] = command
        if isinstance(command, Register) and not command.new_id:
            logged = replace(command, new_id=f"peer-{secrets.token_hex(8)}")
        self._seq += 1
        seq = self._seq
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[seq] = fut
        value = encode_entry(Entry(logged, self.wall(), self._source, seq))
        try:
            await self._call(lambda kv, t: kv.Put(epb.PutRequest(key=self._key, value=value), timeout=t))
            answer: R = await self._bounded(fut, f"applying {command.op}")
            return answer
        finally:
            self._pending.pop(seq, None)

    async def propose(self, op: str, *args: Arg) -> Any:
        """:meth:`submit` of the command named ``op`` in the log, from its fields in stored order."""
        return await self.submit(command_from_args(op, list(args)))

    async def register_peer(self, *args: Arg) -> Any:
        """RegisterPeer from its fields in stored order (the new id left out: it is named here)."""
        return await self.propose("register", *args)

    async def sync(self) -> None:
        """Waits until every command etcd holds now is applied here (a linearizable read)."""
        resp = await self._call(lambda kv, t: kv.Range(epb.RangeRequest(key=self._key), timeout=t))
        revision = resp.kvs[0].mod_revision if resp.kvs else 0
        if self.applied >= revision:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._syncs.append((revision, fut))
        await self._bounded(fut, "catching up with etcd")

    async def _bounded(self, fut: asyncio.Future[Any], what: str) -> Any:
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.settings.etcd_timeout_seconds)
        except TimeoutError:
            raise Unavailable(
                f"directory store: {what} took over {self.settings.etcd_timeout_seconds}s"
            ) from None

    async def _call(self, fn: Callable[[egrpc.KVStub, float], Any]) -> Any:
        """``fn(kv, timeout)``, retried while etcd is unreachable, up to ``etcd_timeout_seconds``."""
        if self._kv is None:
            raise Unavailable("directory store is not started")
        deadline = time.monotonic() + self.settings.etcd_timeout_seconds
        while True:
            left = deadline - time.monotonic()
            try:
                return await fn(self._kv, max(left, 0.05))
            except grpc.aio.AioRpcError as exc:
                retry = exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                if not retry or left <= 0.1:
                    raise Unavailable(f"directory store (etcd) unreachable: {exc.details()}") from None
            await asyncio.sleep(0.1)

    # --- snapshots ---------------------------------------------------------------------

    async def _restore(self) -> bool:
        """Loads the newest snapshot if it is past what this replica applied; True if loaded."""
        found = await self.snapshots.latest(after=self.applied)
        if found is None:
            return False
        revision, data = found
        self.applied, self._time = load_state(self.state, data)
        self.snapshot_loaded = revision
        _log.info("directory snapshot loaded", revision=revision, rooms=len(self.state._rooms))
        return True

    async def _write_snapshot(self, revision: int, data: bytes) -> None:
        try:
            await self.snapshots.write(revision, data)
            self.snapshots_written += 1
        except Unavailable as exc:
            _log.warning("directory snapshot not written", revision=revision, error=str(exc))
        finally:
            self._snapshotting = None

    # --- following the log -------------------------------------------------------------

    async def _follow(self) -> None:
        while True:
            try:
                await self._watch()
            except grpc.aio.AioRpcError as exc:
                _log.warning("etcd watch broke; resuming", code=exc.code().name, applied=self.applied)
            except Unavailable as exc:
                _log.error("directory replica cannot follow the log", error=str(exc), applied=self.applied)
            self.reconnects += 1
            await asyncio.sleep(0.2)

    async def _start_revision(self) -> int:
        """Where to follow from: after what was applied; for a replica that has applied nothing, the
        log's first command (the key is never deleted), or the next revision when there is no log yet.

        Never "revision 1": etcd compaction is store-wide, so on a shared, compacted etcd the early
        revisions are gone even for a log that had none of them.
        """
        if self.applied:
            return self.applied + 1
        resp = await self._call(lambda kv, t: kv.Range(epb.RangeRequest(key=self._key), timeout=t))
        first: int = resp.kvs[0].create_revision if resp.kvs else resp.header.revision + 1
        return first

    async def _watch(self) -> None:
        if self._channel is None:
            return
        create = epb.WatchCreateRequest(key=self._key, start_revision=await self._start_revision())

        async def requests() -> AsyncIterator[epb.WatchRequest]:
            yield epb.WatchRequest(create_request=create)
            await asyncio.Event().wait()  # the watch lives as long as the request stream stays open

        stream = egrpc.WatchStub(self._channel).Watch(requests())
        async for resp in stream:
            if resp.compact_revision:
                # Fell behind a compaction: the newest snapshot is at or past it; resume from there.
                _log.warning("directory log compacted past this replica", compact=resp.compact_revision)
                if not await self._restore() or self.applied < resp.compact_revision - 1:
                    raise Unavailable("directory log compacted and no snapshot covers it")
                return
            if resp.canceled:
                return
            for event in resp.events:
                if event.type == kv_pb2.Event.PUT:
                    self._apply(event.kv.value, event.kv.mod_revision)

    def _apply(self, data: bytes, revision: int) -> None:
        if revision <= self.applied:
            return
        try:
            entry = decode_entry(data)
        except (ValueError, KeyError, TypeError) as exc:
            _log.error("skipping an unreadable directory command", revision=revision, error=str(exc))
            self.applied = revision
            return
        self._time = max(self._time, entry.time)
        command = entry.command
        result: Any = None
        error: BaseException | None = None
        try:
            result = command.apply(self.state)
            if isinstance(result, RoomRecord) and not command.live_reply:
                # The reply shows the room as this command left it (later commands may apply before the
                # caller resumes); a join's caller waits on the live record for the room to leave OPEN.
                result = copy.copy(result)
        except XavierError as exc:
            error = exc
        except Exception as exc:  # a bug: every replica hits it alike; the caller gets INTERNAL
            _log.exception("directory command failed", op=command.op, revision=revision)
            error = exc
        self.applied = revision
        self._since_snapshot += 1
        if self._since_snapshot >= self.settings.etcd_snapshot_every and self._snapshotting is None:
            self._since_snapshot = 0
            data = dump_state(self.state, revision, self._time)
            self._snapshotting = asyncio.create_task(self._write_snapshot(revision, data))
        if entry.source == self._source:
            fut = self._pending.pop(entry.seq, None)
            if fut is not None and not fut.done():
                if error is not None:
                    fut.set_exception(error)
                else:
                    fut.set_result(result)
        if self._syncs:
            due = [f for r, f in self._syncs if r <= revision]
            self._syncs = [(r, f) for r, f in self._syncs if r > revision]
            for sync in due:
                if not sync.done():
                    sync.set_result(None)
