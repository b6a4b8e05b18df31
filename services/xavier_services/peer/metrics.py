"""Prometheus gauges of an engine host, read from its stats at scrape time (no second bookkeeping)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from xavier.v1 import types_pb2

from xavier_core.runtime import get_registry


class PeerCollector(Collector):
    """`xavier_pages{state}`, `xavier_rooms_active`, `xavier_requests{state}`, transfer counters and the
    engine's own counts (`xavier_engine_counts{name}`, `EngineStats.extra`)."""

    def __init__(
        self,
        role: str,
        engine_stats: Callable[[], types_pb2.EngineStats],
        rooms_active: Callable[[], int],
        transfer: Callable[[], types_pb2.TransferStats],
        engine_counts: Callable[[], Mapping[str, int]],
    ) -> None:
        self._role = role
        self._engine_stats = engine_stats
        self._engine_counts = engine_counts
        self._rooms_active = rooms_active
        self._transfer = transfer

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._engine_stats()
        pages = GaugeMetricFamily(
            "xavier_pages", "KV pages of the engine pool by state.", labels=["role", "state"]
        )
        for state, value in (
            ("total", s.pages_total),
            ("free", s.pages_free),
            ("pinned", s.pages_pinned),
            ("parked", s.pages_parked),
            ("quarantined", s.pages_quarantined),
        ):
            pages.add_metric([self._role, state], value)
        yield pages
        reqs = GaugeMetricFamily("xavier_requests", "Engine requests by queue.", labels=["role", "state"])
        reqs.add_metric([self._role, "running"], s.running)
        reqs.add_metric([self._role, "waiting"], s.waiting)
        yield reqs
        rooms = GaugeMetricFamily("xavier_rooms_active", "Rooms this peer holds pages for.", labels=["role"])
        rooms.add_metric([self._role], self._rooms_active())
        yield rooms
        counts = GaugeMetricFamily(
            "xavier_engine_counts",
            "The engine's own counts: the reference engine's steps, decode graphs captured, prefill chunks "
            "run as decode rows, prefix-cache evictions, ...",
            labels=["role", "name"],
        )
        for name, value in sorted(self._engine_counts().items()):
            counts.add_metric([self._role, name], value)
        yield counts
        t = self._transfer()
        for name, doc, value in (
            ("xavier_transfer_bytes", "KV bytes moved by this peer.", t.bytes),
            ("xavier_transfer_seconds", "Seconds spent in KV transfers.", t.seconds),
            ("xavier_transfers", "Completed KV transfers.", t.transfers),
            ("xavier_transfer_failures", "Failed KV transfers.", t.failures),
        ):
            c = CounterMetricFamily(name, doc, labels=["role"])
            c.add_metric([self._role], value)
            yield c


def register_peer_metrics(collector: PeerCollector) -> None:
    get_registry().register(collector)
