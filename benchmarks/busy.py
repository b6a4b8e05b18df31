"""Busy Python threads beside a measurement, as SGLang's scheduler runs beside its HiCache threads.

A thread of pure Python without a pause (no I/O, no sleep) gives the GIL up only when asked, so whatever
else in the process needs the GIL waits up to a switch interval for it: `busy_python(n)` runs `n` of them
for the length of a `with` block.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["busy_python"]


def _spin(stop: threading.Event) -> None:
    n = 0
    while not stop.is_set():
        for i in range(1000):
            n += i


@contextlib.contextmanager
def busy_python(n: int) -> Iterator[None]:
    """`n` threads running Python without pause until the block ends (0: none)."""
    stop = threading.Event()
    threads = [threading.Thread(target=_spin, args=(stop,), daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join()
