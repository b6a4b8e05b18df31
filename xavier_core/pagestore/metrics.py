"""Client-side counters: per client (for callers and tests) and process-wide Prometheus metrics."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter

from xavier_core.metrics_once import made_once


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
    """READs posted (one per piece of a store call of a fetch that hit: `reading`), NIXL or direct."""
    direct_reads: int = 0
    """Those of them read straight out of the store's memory (a store on this host), not NIXL READs."""
    leased_lookups_used: int = 0
    """Store calls of fetches made under a leased lookup's lease (`exists(lease=True)`), with no GetPages."""
    holder_pages: int = 0
    """Hit pages copied from the replica that wrote them (`fetch`'s `from_holder`) instead of READ."""
    read_descriptors: int = 0
    """Descriptors those READs carried: one per stretch contiguous on both sides, per segment."""
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
    reads: Counter
    fetch_seconds: Counter


def _make_client_metrics(reg: CollectorRegistry) -> ClientMetrics:
    p = "xavier_pagestore_client_"
    return ClientMetrics(
        Counter(p + "lookups", "Prefix lookups asked of the page store.", registry=reg),
        Counter(
            p + "hit_pages",
            "Pages fetched from the page store: READ and verified, or copied from the replica that wrote "
            "them.",
            registry=reg,
        ),
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
        Counter(
            p + "transfer_bytes",
            "Bytes moved by READs and WRITEs (NIXL, or read straight out of a same-host store's memory).",
            ("op",),
            registry=reg,
        ),
        Counter(
            p + "transfer_descriptors",
            "Descriptors posted, NIXL or direct (a stretch of pages contiguous on both sides, per segment).",
            ("op",),
            registry=reg,
        ),
        Counter(
            p + "reads",
            "Store calls' reads of fetched pages, by path: direct (out of a same-host store's memory), nixl, "
            "or holder (copied from the pool of the replica that wrote them, no READ).",
            ("path",),
            registry=reg,
        ),
        Counter(
            p + "fetch_seconds",
            "Seconds prefix fetches spent per step (FETCH_STEPS); overlapped steps each count.",
            ("step",),
            registry=reg,
        ),
    )


_client_metrics = made_once(_make_client_metrics)


def client_metrics() -> ClientMetrics:
    """The process's page store client metrics (created once; every client of the process adds to them).
    Made on first use: the engine times its fetch steps through this module (StepClock), and the engine
    imports nothing of the gRPC runtime (tests/runtime/test_domain_errors.py)."""
    return _client_metrics()


FETCH_STEPS = (
    "get_pages",  # the GetPages round trip: lookup and lease in one
    "endpoint",  # the store's NIXL endpoint, once per store instance
    "allocate",  # local pool pages for the hits (the caller's allocator)
    "stage_slots",  # leasing slots of the host mirror (a device pool)
    "read",  # READs (NIXL, or out of a same-host store's memory), posted to the last one done
    "verify",  # checksums of the fetched pages
    "read_checked",  # a same-host read, each page checked as it lands: "read" and "verify" in one
    "holder",  # asking the replica that wrote the pages for them and copying them from its pool
    "holder_ask",  # of "holder": finding the writer and its SharePrefix round trip (pin and publish)
    "holder_copy",  # of "holder": the copy out of the writer's pool, to the read's end
    "stage_copy",  # copies between the mirror and the pool (a device pool)
    "worker",  # the worker-thread hop around READ, verification and copies, less those steps
    "fetch",  # the whole fetch, every step above included
    "local_match",  # the engine's own: its page keys and local prefix-cache match, before the fetch
    "register",  # the engine's own: fetched pages registered in its prefix cache, the rest given back
)
"""Steps of `xavier_pagestore_client_fetch_seconds{step}`: the client's, then those an engine adds."""


def fetch_step_seconds() -> dict[str, float]:
    """This process's `xavier_pagestore_client_fetch_seconds` so far, per step (a caller that fetches
    one call at a time reads one fetch's steps as the difference of two readings)."""
    out: dict[str, float] = {}
    for metric in client_metrics().fetch_seconds.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                out[sample.labels["step"]] = sample.value
    return out


@dataclass
class StepClock:
    """Seconds per step of one fetch, added to the process's metric once the fetch ends (`flush`).

    One clock is written by one thread at a time: the event loop, or the one worker it waits for."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def flush(self) -> None:
        counter = client_metrics().fetch_seconds
        for name, seconds in self.seconds.items():
            counter.labels(name).inc(seconds)
        self.seconds.clear()
