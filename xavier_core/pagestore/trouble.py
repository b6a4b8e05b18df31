"""Log lines about a store that is down, slow or failing, at a bounded rate.

A store that is down fails every call of every request; one line per call would flood the log of the
process that serves those requests (an SGLang scheduler's, a replica's). The first failure after a
healthy stretch is logged at once, later ones at most once per interval with the count since the last
line, and the first call that succeeds again says so once. Counting is the metrics' job
(`xavier_pagestore_client_errors{op,reason}`); these lines only say when trouble began, lasts and ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["TroubleLog"]


class TroubleLog:
    """Rate-limited failure lines of one client (thread-safe: callers on and off its event loop)."""

    def __init__(
        self, log: logging.Logger, interval_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._log = log
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failing = False
        self._last_line = 0.0
        self._since_line = 0
        self._total = 0

    def failed(self, op: str, exc: BaseException) -> None:
        """One failed call, served as a miss."""
        now = self._clock()
        with self._lock:
            self._total += 1
            self._since_line += 1
            first = not self._failing
            if not first and now - self._last_line < self._interval_s:
                return
            self._failing = True
            count, self._since_line, self._last_line = self._since_line, 0, now
        if first:
            self._log.warning("page store %s failed, served as a miss: %s", op, exc)
        else:
            self._log.warning(
                "page store still failing: %d calls served as misses since the last line (latest: %s %s)",
                count,
                op,
                exc,
            )

    def ok(self) -> None:
        """A call the store answered: ends a failing stretch with one line."""
        if not self._failing:  # the common path takes no lock
            return
        with self._lock:
            if not self._failing:
                return
            self._failing = False
            total, self._total, self._since_line = self._total, 0, 0
        self._log.warning("page store answering again after %d failed calls", total)
