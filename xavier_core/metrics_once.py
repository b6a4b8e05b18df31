"""Metrics made on first use, once per process, by modules that import no gRPC runtime at load (the engine,
the page store client): the process registry is looked up only when the metrics are first asked for."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

_T = TypeVar("_T")


def made_once(make: Callable[[CollectorRegistry], _T]) -> Callable[[], _T]:
    """A getter of `make(registry)`: called at the first get, under a lock (two threads must not
    register the same metric twice), on the process registry; every later get returns that result."""
    lock = threading.Lock()
    made: list[_T] = []

    def get() -> _T:
        with lock:
            if not made:
                from xavier_core.runtime.metrics import get_registry

                made.append(make(get_registry()))
            return made[0]

    return get
