"""RoomFeed: one WatchPeerRooms stream per peer, instead of one stream or poll per room.

The directory sends every change of every room the peer is a member of, batched; the feed keeps each
room's latest state (bounded) so a waiter that arrives after the change still sees it. After a
(re)connect the snapshot lists only live rooms, so rooms someone waits on that are missing from it ended
while the stream was down: they are fetched once with GetRoom.
"""

from __future__ import annotations

import asyncio
import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from xavier.v1 import directory_service_pb2 as dpb

from xavier_core.runtime.errors import NotFound, XavierError
from xavier_core.runtime.logging import get_logger
from xavier_core.runtime.tasks import cancel_and_wait

from .client import TERMINAL_ROOM_STATES, DirectoryClient

log = get_logger(__name__)

# States after which a decode may have read the source (BeginTransfer refuses an ended room).
_READ_STATES = frozenset((dpb.ROOM_STATE_TRANSFERRING, dpb.ROOM_STATE_COMPLETED))


@dataclass
class RoomView:
    """What the feed knows of one room."""

    state: int = dpb.ROOM_STATE_UNSPECIFIED
    may_read: bool = False  # it passed TRANSFERRING: a read may have started
    declined: bool = False  # its decode said it never posted a read
    end_cause: int = dpb.ROOM_END_CAUSE_UNSPECIFIED
    room: dpb.Room | None = None  # the message that set `state`
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class RoomFeed:
    """Latest room states of one peer, fed by a single directory stream that reconnects on failure.

    Runs on one event loop: call everything there, except `latest` (a plain read).
    """

    def __init__(
        self,
        client: DirectoryClient,
        identity: Callable[[], tuple[str, int]],
        capacity: int = 65536,
        max_backoff: float = 1.0,
    ) -> None:
        self._client = client
        self._identity = identity
        self._capacity = capacity
        self._max_backoff = max_backoff
        self._views: OrderedDict[int, RoomView] = OrderedDict()
        self._waiting: dict[int, int] = {}  # room id -> number of waiters
        self._task: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="room-feed")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    def latest(self, room_id: int) -> dpb.Room | None:
        """The latest message of a room (from the stream or `apply`), None if none came. A plain read of
        the feed's table, so a synchronous caller on another thread may use it."""
        view = self._views.get(room_id)
        return None if view is None else view.room

    def forget(self, room_id: int) -> None:
        """Drops a room nobody waits on any more."""
        if room_id not in self._waiting:
            self._views.pop(room_id, None)

    async def outcome(self, room_id: int, timeout: float) -> tuple[int, bool]:
        """(The terminal state, whether a read may have started) once the room gets there.

        On `timeout` (or if the room is unknown to the directory) the answer is (UNSPECIFIED, True): the
        caller must then assume a read may still run.
        """
        view = await self._wait_until(room_id, lambda v: v.state in TERMINAL_ROOM_STATES, timeout)
        if view is None:
            log.warning("room outcome timed out", room_id=room_id)
            return dpb.ROOM_STATE_UNSPECIFIED, True
        return view.state, view.may_read

    async def read_declined(self, room_id: int, timeout: float) -> bool:
        """True once the room's decode says it never posted a read (False after `timeout`)."""
        return await self._wait_until(room_id, lambda v: v.declined, timeout) is not None

    async def _wait_until(
        self, room_id: int, done: Callable[[RoomView], bool], timeout: float
    ) -> RoomView | None:
        self._waiting[room_id] = self._waiting.get(room_id, 0) + 1
        view = self._view(room_id)
        try:
            async with asyncio.timeout(timeout):
                while not done(view):
                    view.changed.clear()
                    await view.changed.wait()
                    view = self._view(room_id)
            return view
        except TimeoutError:
            return None
        finally:
            left = self._waiting[room_id] - 1
            if left:
                self._waiting[room_id] = left
            else:
                del self._waiting[room_id]

    # -- internals ----------------------------------------------------------------------------------------

    def _view(self, room_id: int) -> RoomView:
        view = self._views.get(room_id)
        if view is None:
            view = self._views[room_id] = RoomView()
            while len(self._views) > self._capacity:
                old, _ = self._views.popitem(last=False)
                if old in self._waiting:  # never evict a room someone waits on
                    self._views[old] = RoomView()
                    break
        return view

    def apply(self, room: dpb.Room) -> None:
        """Records a room as the stream or an RPC's answer shows it (an answer may come before the stream's
        message). A terminal state is final."""
        view = self._view(room.room_id)
        if room.read_declined and not view.declined:
            # The reader's own word that it never read: may come after the room ended.
            view.declined, view.may_read = True, False
            view.changed.set()
        if view.state in TERMINAL_ROOM_STATES:
            return
        view.state, view.room = room.state, room
        view.may_read = (view.may_read or room.state in _READ_STATES) and not view.declined
        view.end_cause = room.end_cause
        view.changed.set()

    async def _resync(self, live: set[int]) -> None:
        """Fetches waited-on rooms the snapshot lacks: they ended while the stream was down."""
        for room_id in [r for r in self._waiting if r not in live]:
            view = self._views.get(room_id)
            if view is not None and view.state in TERMINAL_ROOM_STATES:
                continue
            try:
                self.apply(await self._client.get_room(room_id))
            except NotFound:
                gone = dpb.Room(
                    room_id=room_id,
                    state=dpb.ROOM_STATE_EXPIRED,
                    end_cause=dpb.ROOM_END_CAUSE_LEASE_EXPIRED,
                    end_detail="the directory no longer knows the room",
                )
                self.apply(gone)
            except XavierError as err:
                log.info("room resync failed", room_id=room_id, error=str(err))

    async def _run(self) -> None:
        delay = 0.05
        while True:
            peer_id, epoch = self._identity()
            try:
                first = True
                async for batch in self._client.watch_peer_rooms(peer_id, epoch):
                    for room in batch:
                        self.apply(room)
                    if first:
                        first, delay = False, 0.05
                        self.connected.set()
                        await self._resync({r.room_id for r in batch})
            except XavierError as err:
                log.info("room feed broke; reconnecting", error=str(err), peer_id=peer_id, epoch=epoch)
            self.connected.clear()
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, self._max_backoff)
