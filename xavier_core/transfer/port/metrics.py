"""Prometheus view of a transfer port, read from its stats at scrape time (no second bookkeeping):
`xavier_transfers_by_transport{role,transport}` (counter), `xavier_transfer_notifications_ignored{role,why}`
(counter), `xavier_transfer_peers_warmed{role}` (counter), `xavier_transfer_run_length_pages{role}`
(histogram of the page runs pulls moved: how scattered the decode's pages really are), and the staging
slab: `xavier_staging_bytes_in_use{role}` (gauge) and `xavier_staging_fallbacks{role}` (counter)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from xavier_core.transfer.port.transport import RUN_BUCKETS


class PortCollector(Collector):
    """Reads `stats()` of a `KvPort` (a callable, so a port made later is seen too)."""

    def __init__(self, role: str, stats: Callable[[], dict[str, Any] | None]) -> None:
        self._role = role
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        s = self._stats()
        if s is None:
            return
        by = CounterMetricFamily(
            "xavier_transfers_by_transport", "Completed KV pulls by transport.", labels=["role", "transport"]
        )
        fails = CounterMetricFamily(
            "xavier_transfer_failures_by_transport",
            "Failed KV pulls by transport.",
            labels=["role", "transport"],
        )
        for transport, totals in s["by_transport"].items():
            by.add_metric([self._role, transport], totals["transfers"])
            fails.add_metric([self._role, transport], totals["failures"])
        yield by
        yield fails
        ignored = CounterMetricFamily(
            "xavier_transfer_notifications_ignored",
            "Read-end notifications a source ignored: for a room it no longer holds (unknown_room: a late "
            "one, after the room ended otherwise), without the room's read token (bad_token), or dropped "
            "by the test-only fault hook (injected).",
            labels=["role", "why"],
        )
        for why, count in s["notifications_ignored"].items():
            ignored.add_metric([self._role, why], count)
        yield ignored
        warmed = CounterMetricFamily(
            "xavier_transfer_peers_warmed",
            "Peers this port connected to ahead of their first transfer (see KvPort.warm).",
            labels=["role"],
        )
        warmed.add_metric([self._role], s.get("peers_warmed", 0))
        yield warmed
        staging = s.get("staging")
        if staging is not None:
            used = GaugeMetricFamily(
                "xavier_staging_bytes_in_use", "Staging slab bytes held by rooms.", labels=["role"]
            )
            used.add_metric([self._role], staging["bytes_in_use"])
            yield used
            fallbacks = CounterMetricFamily(
                "xavier_staging_fallbacks",
                "Staged transfers that went as NIXL page runs (no free slab chunk, or slabs differ).",
                labels=["role"],
            )
            fallbacks.add_metric([self._role], staging["fallbacks"])
            yield fallbacks
        runs = s["run_lengths"]
        cumulative, buckets = 0, []
        for label, count in zip([*map(str, RUN_BUCKETS), "+Inf"], runs["buckets"].values(), strict=True):
            cumulative += count
            buckets.append((label, cumulative))
        hist = HistogramMetricFamily(
            "xavier_transfer_run_length_pages",
            "Lengths (pages) of the contiguous page runs KV pulls moved.",
            labels=["role"],
        )
        hist.add_metric([self._role], buckets, sum_value=runs["pages"])
        yield hist


def register_port_metrics(role: str, stats: Callable[[], dict[str, Any] | None]) -> None:
    """Registers a port's collector with the process registry (one port per process)."""
    from xavier_core.runtime import get_registry

    get_registry().register(PortCollector(role, stats))
