"""Admission control: at most `max_inflight` requests served at once, `max_queued` waiting, FIFO.

A request over both limits is refused at once with RESOURCE_EXHAUSTED (HTTP 429 + Retry-After) rather
than queued without bound: a client told to come back later beats one whose request times out after a
minute in a queue it cannot see. A queued request that waits longer than `queue_timeout` is refused
the same way.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from xavier_core.runtime import CapacityExhausted


class Overloaded(CapacityExhausted):
    """The router's request limits are full; `retry_after_seconds` is in the metadata."""

    reason = "ROUTER_OVERLOADED"


class Admission:
    """Serving slots and a bounded FIFO queue in front of them (one event loop, no locks needed)."""

    def __init__(self, max_inflight: int, max_queued: int, queue_timeout: float, retry_after: int) -> None:
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self.queue_timeout = queue_timeout
        self.retry_after = retry_after
        self.inflight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def _refuse(self, why: str) -> Overloaded:
        return Overloaded(
            why,
            limit=self.max_inflight + self.max_queued,
            retry_after_seconds=self.retry_after,
        )

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[float]:
        """Holds a serving slot for the block; yields the seconds spent queued."""
        started = time.monotonic()
        if self.inflight >= self.max_inflight or self._waiters:
            if len(self._waiters) >= self.max_queued:
                raise self._refuse(
                    f"the router is at its limit ({self.max_inflight} in flight, {self.max_queued} queued)"
                )
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                async with asyncio.timeout(self.queue_timeout):
                    await waiter
            except BaseException as exc:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                elif waiter.done() and not waiter.cancelled():
                    self._release()  # a slot was handed over just as the wait ended: pass it on
                if isinstance(exc, TimeoutError):
                    raise self._refuse(f"no serving slot within {self.queue_timeout:g} s") from None
                raise
            # The releaser handed its slot to this waiter (inflight was not decremented for it).
        else:
            self.inflight += 1
        try:
            yield time.monotonic() - started
        finally:
            self._release()

    def _release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes straight to the next in line
                return
        self.inflight -= 1
