"""KV manager, sender and receiver, modelled on SGLang's disaggregation interface (`KVPoll` states).

The source (prefill) side owns a `KvSender` per room: `init` → `send` publishes a `SourceInfo`, and the
sender is complete when the reader's NIXL notification arrives or `mark_complete()` is called by whoever
learns completion from the directory, so a lost notification never hangs a room. The reader (decode) side
owns a `KvReceiver`: `send_metadata` names the destination pages, `start` READs the source's runs.

Nothing here blocks beyond a bounded timeout. Without NIXL progress threads, callers drive progress:
the source calls `KvManager.progress()` (or `KvSender.poll()`) every few milliseconds while any room is
published; the reader calls `KvReceiver.poll()` until it leaves TRANSFERRING.
"""

from __future__ import annotations

import enum
import hmac
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from xavier_core.transfer.common.buffers import KvBuffer
from xavier_core.transfer.common.errors import LayoutError, TransferError, TransferInFlightError
from xavier_core.transfer.common.runs import Mode, as_page_array, coalesce
from xavier_core.transfer.common.source import SourceInfo
from xavier_core.transfer.nixl.agent import NixlAgent
from xavier_core.transfer.nixl.xfer import Transfer

log = logging.getLogger(__name__)

_T = TypeVar("_T")

DONE_PREFIX = b"xv1:done:"
FAIL_PREFIX = b"xv1:fail:"


class KvPoll(enum.IntEnum):
    """Room transfer states; the values are SGLang's `KVPoll` values."""

    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4


def done_notif(room: str, token: str = "") -> bytes:
    """The reader's "read ended well" notification; `token` is the source's read token."""
    return DONE_PREFIX + room.encode() + b":" + token.encode()


def fail_notif(room: str, token: str = "") -> bytes:
    """The reader's "read failed / will not come" notification."""
    return FAIL_PREFIX + room.encode() + b":" + token.encode()


class KvManager:
    """Per-process hub: the agent, the local pool, and the rooms that notifications are routed to."""

    def __init__(self, agent: NixlAgent, buffers: Sequence[KvBuffer], page_size: int) -> None:
        if tuple(buffers) != agent.buffers:
            raise LayoutError("KvManager buffers differ from the buffers the agent registered")
        if page_size < 1:
            raise LayoutError(f"page_size must be positive, got {page_size}")
        self.agent = agent
        self.buffers = tuple(buffers)
        self.page_size = page_size
        self.num_pages = min(b.num_pages for b in buffers)
        self._lock = threading.RLock()
        self._senders: dict[str, KvSender] = {}
        self._receivers: dict[str, KvReceiver] = {}
        self.notifications_dropped = 0
        self.notifications_rejected = 0  # a room's notification without that room's read token
        # Fault injection for the test suites (KvPort sets it from XAVIER_FAULT_DROP_DONE_NOTIFICATIONS):
        # a reader's "done" is discarded on arrival, as if NIXL had lost it, so the room's completion
        # through the directory must unpin the source. Never set in production.
        self.drop_done_notifications = False
        self.notifications_lost = 0
        # Fault injection likewise (XAVIER_FAULT_STUCK_READS, a file path): while that file exists, a
        # reader's READs are never seen to end, so a pull times out with its READ still "in flight" at the
        # park timeout; once it is gone they end as NIXL says. Never set in production.
        self.stuck_reads = ""
        self.bytes_read = 0
        self.read_seconds = 0.0

    def reads_stuck(self) -> bool:
        """Whether the stuck-reads fault hook holds READs in flight now."""
        return bool(self.stuck_reads) and os.path.exists(self.stuck_reads)

    def progress(self) -> int:
        """Polls NIXL notifications (this also moves reads of our pages forward) and routes them to
        senders. Returns how many notifications it handled."""
        with self._lock:
            notifs = self.agent.notifications()
            for _who, msg in notifs:
                kind, room, token = _parse(msg)
                sender = self._senders.get(room) if room is not None else None
                if sender is None:
                    self.notifications_dropped += 1
                    continue
                # Bytes, not str: compare_digest refuses non-ASCII str, and the network sends anything.
                if not hmac.compare_digest(token, sender.token.encode()):
                    # Only the reader the source's descriptor went to knows the token: anyone else who
                    # can reach this agent must not end a room (its pages would be reused mid-read).
                    self.notifications_rejected += 1
                    log.warning("room %s: notification without its read token ignored", room)
                    continue
                if kind == "done" and self.drop_done_notifications:
                    self.notifications_lost += 1
                    log.warning("room %s: done notification dropped (fault injection)", room)
                    continue
                sender._on_reader_end(kind == "done")
            return len(notifs)

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            return {
                "senders": len(self._senders),
                "receivers": len(self._receivers),
                "notifications_dropped": self.notifications_dropped,
                "notifications_rejected": self.notifications_rejected,
                "notifications_lost": self.notifications_lost,
                "bytes_read": self.bytes_read,
                "read_seconds": self.read_seconds,
            }

    def _add(self, table: dict[str, _T], room: str, obj: _T) -> None:
        with self._lock:
            if room in table and table[room] is not obj:
                raise TransferError(f"room {room!r} is already registered in this process")
            table[room] = obj

    def _remove(self, table: dict[str, _T], room: str, obj: _T) -> None:
        with self._lock:
            if table.get(room) is obj:
                del table[room]

    def _account(self, xfer: Transfer) -> None:
        with self._lock:
            self.bytes_read += xfer.nbytes
            if xfer.finished is not None:
                self.read_seconds += xfer.finished - xfer.started


def _parse(msg: bytes) -> tuple[str, str | None, bytes]:
    """(kind, room, token bytes) of a notification; room None when it is not one of ours."""
    for kind, prefix in (("done", DONE_PREFIX), ("fail", FAIL_PREFIX)):
        if msg.startswith(prefix):
            room, _, token = msg[len(prefix) :].partition(b":")
            return kind, room.decode(errors="replace"), token
    return "other", None, b""


class KvSender:
    """Source side of one room. Thread-safe; no call blocks."""

    def __init__(self, manager: KvManager, room: str) -> None:
        self.manager = manager
        self.room = room
        self._lock = threading.Lock()
        self._state = KvPoll.BOOTSTRAPPING
        self._num_pages = 0
        self._published = False
        self._reader_ended = False
        self.error: str | None = None
        # Handed to the reader inside the SourceInfo; its done/fail notifications must carry it.
        self.token = secrets.token_hex(16)
        manager._add(manager._senders, room, self)

    def init(self, num_pages: int) -> None:
        """Declares how many pages will be sent."""
        with self._lock:
            if num_pages < 1:
                raise TransferError(f"num_pages must be positive, got {num_pages}")
            self._num_pages = num_pages
            if self._state == KvPoll.BOOTSTRAPPING:
                self._state = KvPoll.WAITING_FOR_INPUT

    def send(self, page_ids: Sequence[int] | npt.NDArray[np.integer]) -> SourceInfo:
        """Publishes the pages: returns what the reader needs (carried through PublishSource)."""
        pages = as_page_array(page_ids)
        with self._lock:
            if self._state != KvPoll.WAITING_FOR_INPUT:
                raise TransferError(f"room {self.room!r}: send() in state {self._state.name}")
            if pages.size != self._num_pages:
                raise TransferError(
                    f"room {self.room!r}: init() said {self._num_pages} pages, got {pages.size}"
                )
            if int(pages.max()) >= self.manager.num_pages:
                raise TransferError(f"room {self.room!r}: page {int(pages.max())} is outside the pool")
            agent = self.manager.agent
            info = SourceInfo(agent.name, agent.metadata(), agent.buffers, tuple(coalesce(pages)), self.token)
            self._published = True
            self._state = KvPoll.TRANSFERRING
            return info

    def poll(self) -> KvPoll:
        """Drives progress (routes notifications) and returns the state."""
        self.manager.progress()
        with self._lock:
            return self._state

    def mark_complete(self) -> None:
        """Completion learned from elsewhere (the directory's COMPLETED): the reader has its bytes."""
        self._on_reader_end(True)

    def abort(self, reason: str = "aborted") -> None:
        """Fails the room. Its pages stay unsafe to reuse while `in_flight()` is True."""
        with self._lock:
            if self._state != KvPoll.SUCCESS:
                self._state = KvPoll.FAILED
                self.error = self.error or reason

    def in_flight(self) -> bool:
        """True while a reader may still be reading the published pages (no done/fail seen yet).
        After an abort the caller parks the pages until this is False or the room's lease ends."""
        self.manager.progress()
        return self.peek()[1]

    def peek(self) -> tuple[KvPoll, bool]:
        """(state, in flight) as of the last `KvManager.progress()`, without polling NIXL: a caller that
        drives progress once for many rooms reads each room with this."""
        with self._lock:
            return self._state, self._published and not self._reader_ended

    def clear(self) -> None:
        """Forgets the room; later notifications for it are dropped."""
        self.manager._remove(self.manager._senders, self.room, self)

    def _on_reader_end(self, ok: bool) -> None:
        with self._lock:
            self._reader_ended = True
            if self._state in (KvPoll.FAILED, KvPoll.SUCCESS):
                return
            self._state = KvPoll.SUCCESS if ok else KvPoll.FAILED
            if not ok:
                self.error = "the reader reported a failed transfer"


class KvReceiver:
    """Reader side of one room. Thread-safe; no call blocks beyond `wait_idle`'s timeout."""

    def __init__(self, manager: KvManager, room: str) -> None:
        self.manager = manager
        self.room = room
        self._lock = threading.RLock()
        self._state = KvPoll.BOOTSTRAPPING
        self._dest: npt.NDArray[np.int64] | None = None
        self._xfer: Transfer | None = None
        # Set while `_xfer` is a lead READ: what the page READ posted after it will read.
        self._pages_after: tuple[SourceInfo, Mode] | None = None
        self._peer_key: str | None = None
        self._token = ""
        self._notify_fail_when_idle = False
        self.error: str | None = None
        self.silent = False
        """Tell the source nothing (no notification on the READ, no done or fail after it): a source
        whose pages stand for a while whoever reads them, which waits for no reader's word."""

    def init(self) -> None:
        """Registers the room with the manager (idempotent)."""
        self.manager._add(self.manager._receivers, self.room, self)

    def send_metadata(self, dest_page_ids: Sequence[int] | npt.NDArray[np.integer]) -> None:
        """Names the destination pages (already allocated); the room then waits for its source."""
        dest = as_page_array(dest_page_ids)
        with self._lock:
            if self._state != KvPoll.BOOTSTRAPPING:
                raise TransferError(f"room {self.room!r}: send_metadata() in state {self._state.name}")
            self._dest = dest
            self._state = KvPoll.WAITING_FOR_INPUT

    def start(
        self,
        source: SourceInfo,
        peer_key: str,
        mode: Mode = "coalesced",
        lead: Callable[[], Transfer] | None = None,
    ) -> None:
        """Adds the peer if needed and posts one READ (one descriptor per run per buffer).

        `lead`, if given, posts a READ of other bytes of the same source that must land before the pages
        (an engine's per-request aux slots): the pages are read once it is DONE, so the done notification
        (carried by the page READ) still means every byte was read. A lead READ carries no notification,
        so a failure is told to the source once it has ended, whatever its end.
        """
        with self._lock:
            if self._state != KvPoll.WAITING_FOR_INPUT or self._dest is None:
                raise TransferError(f"room {self.room!r}: start() in state {self._state.name}")
            agent = self.manager.agent
            try:
                agent.add_peer(peer_key, source.metadata)
                self._peer_key, self._token = peer_key, source.token
                if source.num_pages != self._dest.size:
                    raise TransferError(
                        f"page count mismatch: source has {source.num_pages} pages, "
                        f"destination {self._dest.size}"
                    )
                if lead is None:
                    self._xfer = self._read_pages(source, mode)
                else:
                    self._pages_after = (source, mode)
                    self._xfer = lead()
            except TransferError as exc:
                self._fail(str(exc))
                return
            self._state = KvPoll.TRANSFERRING
            self._check()

    def _read_pages(self, source: SourceInfo, mode: Mode) -> Transfer:
        if self._peer_key is None or self._dest is None:
            raise TransferError(f"room {self.room!r}: no source to read")
        xfer = self.manager.agent.read(
            self._peer_key,
            source.buffers,
            source.page_ids(),
            self._dest,
            b"" if self.manager.agent.notifies_apart or self.silent else done_notif(self.room, self._token),
            mode,
        )
        self._pages_after = None
        return xfer

    def poll(self) -> KvPoll:
        """Drives the READ and returns the state."""
        with self._lock:
            if not self.manager.reads_stuck():
                self._check()
            return self._state

    def abort(self, reason: str = "aborted") -> None:
        """Fails the room at once; a READ in flight is left to end (never cancelled here), see in_flight."""
        with self._lock:
            self._check()
            if self._state in (KvPoll.SUCCESS, KvPoll.FAILED):
                return
            self._fail(reason)

    def in_flight(self) -> bool:
        """True while the READ may still write the destination pages (invariant I1)."""
        with self._lock:
            if self.manager.reads_stuck():
                return self._xfer is not None
            self._check()
            return self._xfer is not None and self._xfer.in_flight

    def wait_idle(self, timeout_s: float) -> bool:
        """Polls until no READ is in flight or `timeout_s` passes; True when idle."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)
        return True

    def clear(self) -> None:
        """Forgets the room. Refuses while a READ is in flight: wait for `in_flight()` to be False."""
        if self.in_flight():
            raise TransferInFlightError(f"room {self.room!r}: a READ may still write its pages")
        self.manager._remove(self.manager._receivers, self.room, self)

    def _check(self) -> None:
        xfer = self._xfer
        if xfer is None:
            return
        was_live = xfer.in_flight
        state = xfer.poll()
        if was_live and state == "DONE":
            self.manager._account(xfer)
        if state == "PROC":
            return
        after = self._pages_after  # set: the READ that ended was the lead READ
        if self._state == KvPoll.TRANSFERRING:
            if state == "DONE" and after is not None:
                try:
                    self._xfer = self._read_pages(*after)
                except TransferError as exc:
                    self._fail(str(exc))
                    return
                self._check()
                return
            if state == "DONE":
                self._state = KvPoll.SUCCESS
                if self.manager.agent.notifies_apart:
                    self._tell_source(done_notif(self.room, self._token), "done")
            else:
                self._fail(f"READ failed: {xfer.error}")
        if self._notify_fail_when_idle and (state == "ERR" or after is not None):
            self._notify_fail_when_idle = False
            self._send_fail()

    def _fail(self, reason: str) -> None:
        self._state, self.error = KvPoll.FAILED, reason
        log.info("room %s failed: %s", self.room, reason)
        if self._xfer is not None and self._xfer.in_flight:
            # The source may reuse its pages once told; tell it only when our READ has ended.
            self._notify_fail_when_idle = True
        elif self._xfer is None or self._xfer.state == "ERR" or self._pages_after is not None:
            self._send_fail()

    def _send_fail(self) -> None:
        self._tell_source(fail_notif(self.room, self._token), "fail")

    def _tell_source(self, msg: bytes, kind: str) -> None:
        if self._peer_key is None or self.silent:
            return
        try:
            self.manager.agent.notify_read_end(self._peer_key, msg)
        except TransferError as exc:
            log.info("room %s: %s notification not delivered: %s", self.room, kind, exc)
