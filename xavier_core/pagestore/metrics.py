"""Client-side counters: per client (for callers and tests) and process-wide Prometheus metrics."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client import Counter

from xavier_core.runtime.metrics import get_registry


@dataclass
class ClientCounters:
    """What one client saw, in pages unless named otherwise."""

    hit_pages: int = 0
    miss_pages: int = 0
    corrupt_pages: int = 0
    pages_written: int = 0
    writes_dropped: int = 0
    writes_failed: int = 0
    errors: int = 0
    reads: int = 0
    """NIXL READs posted (one per store call of a fetch that hit)."""
    read_descriptors: int = 0
    """NIXL descriptors those READs carried: one per stretch contiguous on both sides, per segment."""
    writes: int = 0
    """NIXL WRITEs posted."""
    write_descriptors: int = 0
    """NIXL descriptors those WRITEs carried."""


@dataclass(frozen=True)
class ClientMetrics:
    lookups: Counter
    hit_pages: Counter
    miss_pages: Counter
    corrupt_pages: Counter
    pages_written: Counter
    writes_dropped: Counter
    errors: Counter
    transfer_bytes: Counter
    transfer_descriptors: Counter


_METRICS: ClientMetrics | None = None
_LOCK = threading.Lock()


def client_metrics() -> ClientMetrics:
    """The process's page store client metrics (created once; every client of the process adds to them)."""
    global _METRICS
    with _LOCK:
        if _METRICS is None:
            reg = get_registry()
            p = "xavier_pagestore_client_"
            _METRICS = ClientMetrics(
                Counter(p + "lookups", "Prefix lookups asked of the page store.", registry=reg),
                Counter(p + "hit_pages", "Pages fetched from the page store, verified.", registry=reg),
                Counter(p + "miss_pages", "Looked-up pages not served by the store.", registry=reg),
                Counter(p + "corrupt_pages", "Fetched pages that failed their checksum.", registry=reg),
                Counter(p + "pages_written", "Pages written and committed to the store.", registry=reg),
                Counter(p + "writes_dropped", "Write-throughs dropped on a full queue.", registry=reg),
                Counter(
                    p + "errors",
                    "Store calls that failed and were served as a miss.",
                    ("op", "reason"),
                    registry=reg,
                ),
                Counter(p + "transfer_bytes", "Bytes moved with NIXL.", ("op",), registry=reg),
                Counter(
                    p + "transfer_descriptors",
                    "NIXL descriptors posted (a stretch of pages contiguous on both sides, per segment).",
                    ("op",),
                    registry=reg,
                ),
            )
        return _METRICS
