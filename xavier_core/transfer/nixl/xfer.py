"""A posted NIXL READ: polled to completion, released exactly once, cancelled past its timeout."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from xavier_core.transfer.nixl._raw import RawAgent, XferState

log = logging.getLogger(__name__)


class Transfer:
    """A posted READ. Poll it until it is not PROC; its NIXL handle is released once it ends."""

    def __init__(
        self,
        raw: RawAgent,
        lock: threading.RLock,
        handle: object,
        nbytes: int,
        descs: int,
        timeout_s: float,
        on_release: Callable[[Transfer], None],
    ) -> None:
        self._raw = raw
        self._lock = lock
        self._on_release = on_release
        self._handle: object | None = handle
        self.nbytes = nbytes
        self.descriptor_count = descs
        self.started = time.monotonic()
        self.finished: float | None = None
        self._deadline = self.started + timeout_s
        self._timeout_s = timeout_s
        self.error: str | None = None
        self._state: XferState = "PROC"

    @property
    def state(self) -> XferState:
        """The last polled state (no NIXL call)."""
        return self._state

    @property
    def in_flight(self) -> bool:
        """True while NIXL may still touch the pages of this READ."""
        return self._handle is not None

    def poll(self) -> XferState:
        """Checks the READ (and drives it forward); a READ past its timeout is cancelled and ends ERR."""
        with self._lock:
            if self._handle is None:
                return self._state
            try:
                state = self._raw.check(self._handle)
            except Exception as exc:  # nixlRemoteDisconnectError and friends: the peer is gone
                self.error = f"{type(exc).__name__}: {exc}"
                state = "ERR"
            if state == "PROC" and time.monotonic() > self._deadline:
                if self._cancel():
                    self.error = f"timed out after {self._timeout_s:.1f}s"
                    self._finish("ERR")
                return self._state
            self._settle(state)
            return self._state

    def release(self) -> bool:
        """Ends the READ now: cancels it if still PROC. False if NIXL refused (still in flight)."""
        with self._lock:
            if self._handle is None:
                return True
            if self._cancel():
                self.error = self.error or "cancelled"
                self._finish("ERR")
            return self._handle is None

    def _settle(self, state: XferState) -> None:
        if state == "PROC":
            return
        if state == "ERR" and self.error is None:
            self.error = "NIXL reported a transfer error"
        if not self._cancel():
            log.warning("NIXL refused to release a finished transfer handle; keeping it")
            return
        self._finish(state)

    def _cancel(self) -> bool:
        if self._handle is None:
            return True
        try:
            self._raw.release(self._handle)
        except Exception as exc:
            log.warning("releasing transfer handle failed: %s: %s", type(exc).__name__, exc)
            return False
        self._on_release(self)
        self._handle = None
        return True

    def _finish(self, state: XferState) -> None:
        self._state = state
        self.finished = time.monotonic()
