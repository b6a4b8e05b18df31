"""Prometheus view of the store, read at scrape time (no counter to keep in step with the state)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from xavier_core.runtime.metrics import get_registry
from xavier_services.pagestore.store import Counters, PageStore

_COUNTERS = ("hits", "misses", "evictions", "checksum_failures", "leases_expired", "reservations_dropped")


class StoreCollector(Collector):
    """``xavier_pagestore_*``: totals over namespaces (namespaces are not labels: tenants are unbounded)."""

    def __init__(self, store: PageStore) -> None:
        self.store = store
        self._registered = False

    def register(self) -> None:
        get_registry().register(self)
        self._registered = True

    def unregister(self) -> None:
        if self._registered:
            get_registry().unregister(self)
            self._registered = False

    def collect(self) -> Iterator[Metric]:
        namespaces = list(self.store.namespaces.values())  # the loop may add one while a scrape runs
        totals = Counters()
        for ns in namespaces:
            for name in _COUNTERS:
                setattr(totals, name, getattr(totals, name) + getattr(ns.counters, name))
        for name in _COUNTERS:
            yield CounterMetricFamily(
                f"xavier_pagestore_{name}",
                f"Page store {name.replace('_', ' ')} (pages).",
                getattr(totals, name),
            )
        arena = self.store.arena
        gauges = {
            "pages": ("Committed pages stored.", sum(ns.committed for ns in namespaces)),
            "bytes": (
                "Bytes of committed pages.",
                sum(ns.committed * ns.geometry.page_bytes for ns in namespaces),
            ),
            "leases": ("Live read and write leases.", self.store.live_leases()),
            "reserved_pages": (
                "Slots reserved for uncommitted writes.",
                sum(ns.reserved for ns in namespaces),
            ),
            "pinned_pages": ("Pages pinned by read leases.", sum(ns.pinned for ns in namespaces)),
            "capacity_bytes": ("Arena capacity.", arena.capacity_bytes),
            "namespaces": ("Namespaces in use.", len(namespaces)),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"xavier_pagestore_{name}", doc, value)
