"""An asyncio loop in a daemon thread, for synchronous SGLang code that calls Xavier's asyncio clients.

SGLang's scheduler and its cache-controller threads are synchronous; the directory and page store
clients are asyncio. Each hub or storage backend owns one `LoopThread` and hands it coroutines: the
scheduler polls the returned futures, the cache threads wait on them with a bound.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    """One event loop running forever in a daemon thread named `name`."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Runs `coro` on the loop; the caller polls or waits on the future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Runs `coro` and waits at most `timeout` seconds (`TimeoutError` after that)."""
        return self.submit(coro).result(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and self.loop.is_running()

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the loop and joins the thread. Idempotent."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
