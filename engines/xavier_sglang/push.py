"""The prefill's WRITE of one chunk, whichever way it goes: a NIXL WRITE, or a CUDA IPC copy into a
decode on this host (`XavierSettings.cuda_ipc`).

A NIXL WRITE costs a few microseconds per descriptor, one per page run per buffer: tens of milliseconds
for a prompt whose pages are scattered. Through CUDA IPC the prefill maps the decode's pool once per
decode epoch and one fused kernel copies every page of every buffer (`xavier_core.transfer.cuda.copy`);
the chunk's WRITTEN notification then goes over NIXL once the copy's CUDA event has completed, so the
decode sees it after the bytes, as with a NIXL WRITE. The notification is sent by a thread of the hub
(`IpcNotifier`) that waits for each copy's event in issue order, not by the prefill's next poll, which
comes only after its next forward pass. `SourceRoom` polls both kinds alike.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from xavier_core.transfer.nixl._raw import XferState

if TYPE_CHECKING:
    from xavier_core.transfer.cuda.copy import CopyHandle

__all__ = ["IpcNotifier", "IpcWrite", "Write"]

log = logging.getLogger(__name__)


class Write(Protocol):
    """One WRITE of a room's chunk as its room polls it."""

    error: str | None

    @property
    def in_flight(self) -> bool:
        """True while the WRITE may still read the prefill's pages or write the decode's."""
        ...

    def poll(self) -> XferState: ...


class IpcWrite:
    """A chunk copied through CUDA IPC: in flight until `IpcNotifier` saw the copy's event complete and
    `notify` sent the chunk's WRITTEN (DONE), or could not (ERR: the decode is gone)."""

    def __init__(self, copy: CopyHandle, notify: Callable[[], bool]) -> None:
        self._copy = copy
        self._notify = notify
        self._state: XferState = "PROC"
        self.error: str | None = None

    @property
    def in_flight(self) -> bool:
        return self._state == "PROC"

    def poll(self) -> XferState:
        return self._state

    def complete(self) -> None:
        """Waits for the copy (on the notifier's thread), then sends its notification."""
        try:
            self._copy.wait()
        except Exception as exc:  # a CUDA error: the bytes may not be there
            self.error = f"CUDA IPC copy failed: {type(exc).__name__}: {exc}"
            self._state = "ERR"
            return
        if self._notify():
            self._state = "DONE"
        else:
            self.error = "the pages were copied but the decode could not be notified"
            self._state = "ERR"


class IpcNotifier:
    """One daemon thread per hub: completes `IpcWrite`s in the order they were issued (they run on one
    CUDA stream, so in that order too). Waiting on an event releases the GIL."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[IpcWrite | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="xavier-sglang-ipc", daemon=True)
        self._thread.start()

    def submit(self, write: IpcWrite) -> IpcWrite:
        self._queue.put(write)
        return write

    def _run(self) -> None:
        while (write := self._queue.get()) is not None:
            try:
                write.complete()
            except Exception:  # never let one write stop the thread every later one needs
                log.exception("completing a CUDA IPC write failed")

    def close(self, timeout_s: float = 10.0) -> None:
        """Completes what was submitted, then stops the thread."""
        self._queue.put(None)
        self._thread.join(timeout_s)
