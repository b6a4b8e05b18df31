"""The machinery under `KvPort`: its one NIXL thread, the live work that thread polls, and the hand-off
of what ended to the asyncio loop.

All NIXL calls of a process run on one dedicated thread (`NixlThread`): the agent is not shared across
threads, and no NIXL call ever blocks the asyncio loop. While any source is published or any read is
live, that thread also polls NIXL between calls, every `poll_interval`: notifications (which also drive
progress without a busy-spinning progress thread), the state of each published source, of each live
NIXL read, CUDA IPC copy and staged read. It hands results to the asyncio loop only when something
ended, so a poll costs the loop nothing. With nothing live but a read-end notification that may still
be leaving (`NOTIF_FLUSH_S` after one was sent), it polls every `FLUSH_POLL_S` instead.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, TypeVar

from xavier.v1 import types_pb2

from xavier_core.runtime.logging import get_logger
from xavier_core.runtime.tasks import Background
from xavier_core.transfer.common.buffers import KvBuffer
from xavier_core.transfer.common.errors import TransferError
from xavier_core.transfer.common.stuck import released_when
from xavier_core.transfer.nixl.agent import NixlAgent
from xavier_core.transfer.nixl.rooms import KvManager, KvPoll, KvReceiver, KvSender, done_notif, fail_notif
from xavier_core.transfer.nixl.thread import NixlThread

if TYPE_CHECKING:
    from xavier_core.transfer.cuda.copy import CopyHandle
    from xavier_core.transfer.port.transport import IpcPeers
    from xavier_core.transfer.staged.read import StagedRead

T = TypeVar("T")
log = get_logger(__name__)

DEFAULT_POLL_INTERVAL_S = 0.0005
# A standalone notification (a decline, a failed read's "fail") leaves only when this side's NIXL worker
# progresses: the thread keeps polling this long after sending one, even with nothing else live.
NOTIF_FLUSH_S = 1.0
# How often the thread polls while only such a notification may be on its way. A read's "done" leaves
# with a progress call right behind it, so the flush mostly catches a straggler; a decline or a "fail"
# waits at most this long for its poll, and its source takes notifications in only at its own poll
# anyway (every 5 ms by default, `handoff.source_poll_interval_seconds`). Polling a decode at its 0.5 ms
# read interval for the whole second after every read, which under load is all the time, made its NIXL
# thread about ten polls per request, each a call into NIXL and a wake-up contending for the GIL: a third
# of that thread's CPU on a zero-compute mesh.
FLUSH_POLL_S = 0.005
# Test-only fault injection: "1" makes this process's sources discard every reader "done" notification.
DROP_DONE_ENV = "XAVIER_FAULT_DROP_DONE_NOTIFICATIONS"
# Test-only as well: a file path; while that file exists, this process's READs are never seen to end.
STUCK_READS_ENV = "XAVIER_FAULT_STUCK_READS"

_Ended = list[tuple["asyncio.Future[KvPoll]", KvPoll]]


@dataclass
class TransferTotals:
    bytes: int = 0
    seconds: float = 0.0
    transfers: int = 0
    failures: int = 0

    def to_pb(self) -> types_pb2.TransferStats:
        return types_pb2.TransferStats(
            bytes=self.bytes, seconds=self.seconds, transfers=self.transfers, failures=self.failures
        )


@dataclass
class IpcCopy:
    """A CUDA IPC copy in flight, owned by the NIXL thread until its event completes."""

    room: str
    token: str
    peer: str
    done: asyncio.Future[KvPoll]
    aborted: bool = False
    tell: bool = True  # tell the source how the copy ended (not a silent pull's: `KvPort.pull`)


class ReadEnd(StrEnum):
    """How the read of a published source ended, as the source heard it (the reader's NIXL notification,
    or the sender's own state). The values are the words the port has always answered, so a comparison
    with "done" or "fail" holds, and ``NONE`` is falsy."""

    DONE = "done"
    """The reader read every page."""
    FAILED = "fail"
    """The read failed or was declined: no read touches the pages any more."""
    NONE = ""
    """No word (yet): the wait timed out, or the room is not published here."""


@dataclass
class Published:
    sender: KvSender
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: ReadEnd = ReadEnd.NONE
    cleared: bool = False
    """The NIXL thread forgot the sender when the reader's word came (`PortCore._tick`): once the reader
    has said how its read ended, marking the room complete or failed changes nothing, so `unpublish`
    has nothing left for that thread."""


class PortCore:
    """The NIXL thread, the agent and manager on it, and the tables of live work it polls."""

    def __init__(
        self,
        agent_name: str,
        buffers: Sequence[KvBuffer],
        page_size: int,
        poll_interval: float,
        device_lock: threading.Lock | None,
        read_end_agent: bool = True,
    ) -> None:
        self._buffers = list(buffers)
        # Owned by the NIXL thread: sources not yet reported ended, and live reads with their futures.
        self._senders: dict[int, KvSender] = {}
        self._reads: dict[KvReceiver, asyncio.Future[KvPoll]] = {}
        self._copies: dict[CopyHandle, IpcCopy] = {}
        self._staged: dict[StagedRead, asyncio.Future[KvPoll]] = {}
        self._ipc: IpcPeers | None = None
        self._flush_until = 0.0
        self._poll_interval = poll_interval
        self._loop: asyncio.AbstractEventLoop | None = None
        self._settling: Callable[[], bool] = lambda: False  # the agent's, once the thread has made it
        self._thread = NixlThread(self._tick, self._busy, self._interval, device_lock)
        self.agent: NixlAgent = self._thread.submit(
            functools.partial(NixlAgent, agent_name, self._buffers, read_end_agent=read_end_agent)
        ).result()
        self._settling = self.agent.notifier_settling
        self.manager = KvManager(self.agent, self._buffers, page_size)
        # Fault-injection hook for tests/faults (a lost NIXL "done" notification); see KvManager.
        self.manager.drop_done_notifications = os.environ.get(DROP_DONE_ENV, "") == "1"
        self.manager.stuck_reads = os.environ.get(STUCK_READS_ENV, "")  # tests/faults, as well
        # Owned by the asyncio loop: published rooms, and rooms whose publication is under way.
        self._published: dict[int, Published] = {}
        self._publishing: set[int] = set()
        self.stuck_rooms: dict[int, asyncio.Future[None]] = {}
        """Rooms whose pull failed with its read still running at the park timeout (`KvPort.take_stuck`),
        each with a future that completes once that read has ended (`reap`)."""
        self._reapers = Background("kv-port-reap")

    def reap(self, room_id: int, ended: Callable[[], Awaitable[object]]) -> None:
        """Remembers a stuck room; `ended()` returns once its read can no longer touch the pages, and
        then the room's future completes (its pages may go back into use)."""
        self.stuck_rooms[room_id] = released_when(ended, self._reapers.start, f"KV read of room {room_id}")

    async def stop_reaping(self) -> None:
        """Stops waiting for stuck reads (the port closes: their pages stay out of use)."""
        await self._reapers.cancel()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs `fn(*args)` on the NIXL thread."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return await asyncio.wrap_future(self._thread.submit(fn, *args))

    def _busy(self) -> bool:
        live = self._senders or self._reads or self._copies or self._staged
        # While the read-end agent's endpoint to a new peer may still be setting up, its first "done"
        # moves only when polled.
        return bool(live) or time.monotonic() < self._flush_until or self._settling()

    def _interval(self) -> float:
        """On the NIXL thread: `poll_interval` while work is live (or the read-end agent settles), else
        (only a notification may still be leaving) `FLUSH_POLL_S`, if that is longer."""
        if self._senders or self._reads or self._copies or self._staged or self._settling():
            return self._poll_interval
        return max(self._poll_interval, FLUSH_POLL_S)

    def flush_notifs(self) -> None:
        """On the NIXL thread, after something may have sent a notification: keep polling a while."""
        self._flush_until = time.monotonic() + NOTIF_FLUSH_S

    def _tick(self) -> None:
        """On the NIXL thread: one NIXL poll, then what it ended, handed to the loop in one call."""
        self.manager.progress()
        ended: list[tuple[int, ReadEnd, bool]] = []
        for room_id, sender in list(self._senders.items()):
            state, in_flight = sender.peek()
            if not in_flight:
                del self._senders[room_id]
                # The reader's word came (its state is final): forget the room here, unless slab chunks
                # wait for its unpublishing, so that unpublishing it needs no hop to this thread.
                cleared = not self._stages(room_id)
                if cleared:
                    sender.clear()
                ended.append((room_id, ReadEnd.DONE if state == KvPoll.SUCCESS else ReadEnd.FAILED, cleared))
        reads: _Ended = []
        for receiver, fut in list(self._reads.items()):
            state = receiver.poll()
            if state in (KvPoll.SUCCESS, KvPoll.FAILED):
                reads.append((fut, state))
                del self._reads[receiver]
                if state == KvPoll.SUCCESS:
                    receiver.clear()  # nothing is in flight: forgotten here, not in one more hop
                # The receiver told the source how it ended, the "done" maybe by the read-end agent, whose
                # send moves only while this thread polls: keep polling a while, or, with no read left,
                # that "done" could wait for the next read (under load one was still unsent at exit).
                self.flush_notifs()
        reads.extend(self._finished_copies())
        reads.extend(self._stepped_staged())
        if (ended or reads) and self._loop is not None:
            self._loop.call_soon_threadsafe(self._deliver, ended, reads)

    def _stepped_staged(self) -> _Ended:
        """On the NIXL thread: staged reads stepped once; those that ended told the source already."""
        out: _Ended = []
        for read, fut in list(self._staged.items()):
            state = read.step()
            if state in (KvPoll.SUCCESS, KvPoll.FAILED):
                del self._staged[read]
                self.flush_notifs()
                out.append((fut, state))
        return out

    def _finished_copies(self) -> _Ended:
        """On the NIXL thread: copies whose CUDA event completed; only now is the source told (I1)."""
        out: _Ended = []
        for handle, copy in list(self._copies.items()):
            if not handle.is_done():
                continue
            del self._copies[handle]
            if copy.tell:
                make = fail_notif if copy.aborted else done_notif
                try:
                    self.agent.notify_read_end(copy.peer, make(copy.room, copy.token))
                except TransferError as err:
                    log.info("read-end notification not delivered", room=copy.room, error=str(err))
                self.flush_notifs()
            out.append((copy.done, KvPoll.FAILED if copy.aborted else KvPoll.SUCCESS))
        if self._ipc is not None:
            self._ipc.collect()
        return out

    def _stages(self, room_id: int) -> bool:
        """On the NIXL thread: whether a published room holds staging slab chunks (none without a slab)."""
        return False

    def _deliver(self, ended: list[tuple[int, ReadEnd, bool]], reads: _Ended) -> None:
        for room_id, outcome, cleared in ended:
            pub = self._published.get(room_id)
            if pub is not None and not pub.ended.is_set():
                pub.outcome = outcome
                pub.cleared = cleared
                pub.ended.set()
        for fut, state in reads:
            if not fut.done():
                fut.set_result(state)
