"""The one thread a process's NIXL calls run on, polling NIXL between calls while anything is live."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from xavier_core.runtime.logging import get_logger

T = TypeVar("T")
log = get_logger(__name__)

_Job = tuple[Callable[..., Any], tuple[Any, ...], "concurrent.futures.Future[Any]"]


class NixlThread:
    """Runs submitted calls in order on one thread; polls with `tick` between them while `busy()`, every
    `interval()` seconds (asked before each wait, so the owner may poll faster while work is live).

    `lock`, when given, is held around every call and tick: a caller that captures CUDA graphs on the
    same device passes its lock so no NIXL call overlaps a capture.
    """

    def __init__(
        self,
        tick: Callable[[], None],
        busy: Callable[[], bool],
        interval: Callable[[], float],
        lock: threading.Lock | None = None,
    ) -> None:
        self._tick, self._busy, self._interval, self._lock = tick, busy, interval, lock
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name="xavier-nixl", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((fn, args, fut))
        return fut

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def _locked(self, fn: Callable[..., T], *args: Any) -> T:
        if self._lock is None:
            return fn(*args)
        with self._lock:
            return fn(*args)

    def _main(self) -> None:
        last = time.monotonic()
        while True:
            busy = self._busy()
            poll = self._interval()
            try:
                job = self._jobs.get(timeout=max(0.0, last + poll - time.monotonic()) if busy else None)
            except queue.Empty:
                pass  # time to poll
            else:
                if job is None:
                    return
                fn, args, fut = job
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(self._locked(fn, *args))
                    except BaseException as err:  # handed to the caller
                        fut.set_exception(err)
            if self._busy() and time.monotonic() - last >= self._interval():
                last = time.monotonic()
                try:
                    self._locked(self._tick)
                except Exception:
                    log.exception("NIXL poll failed")
