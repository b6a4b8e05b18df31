"""The store's state machine alone: eviction order, pins, reservations and a page dropped while pinned."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from xavier_services.pagestore.arena import Arena
from xavier_services.pagestore.config import PageStoreSettings
from xavier_services.pagestore.store import Namespace, PageStore

from xavier_core.pagestore.layout import PageGeometry

GEO = PageGeometry((1024, 1024))  # 2 KiB pages, 4 per 8 KiB chunk, 8 chunks


@pytest.fixture
def state() -> Iterator[PageStore]:
    settings = PageStoreSettings(arena_bytes=64 << 10, chunk_bytes=8 << 10)
    arena = Arena(settings.arena_bytes, settings.chunk_bytes, settings.progress_interval_seconds)
    yield PageStore(settings, arena)
    arena.close()


def _keys(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i]) * 16 for i in range(n)]


def _commit(store: PageStore, ns: Namespace, keys: list[bytes]) -> int:
    _, pages, evicted = store.put(ns, keys, 10.0)
    lease = store.write_lease(ns, pages, 10.0)
    store.begin_commit(lease.id)
    store.finish_commit(lease, [True] * len(pages))
    return evicted


def test_eviction_shortens_chains_from_the_tail_and_spares_pins(state: PageStore) -> None:
    store = state
    ns = store.create(("fp", b"s", 0), GEO)
    a, b = _keys(1, 16), _keys(2, 16)
    _commit(store, ns, a)
    _commit(store, ns, b)  # the arena holds 32 pages: full
    hits, lease = store.get(ns, a[:4], 10.0)
    assert len(hits) == 4 and lease is not None
    assert _commit(store, ns, _keys(3, 8)) == 8
    # The oldest pages were a's tail (a chain is touched tail-first): a keeps a shorter prefix, b is whole.
    assert len(store.hit_prefix(ns, a)) == 8
    assert len(store.hit_prefix(ns, b)) == 16
    store.release(lease.id, [])
    assert ns.pinned == 0 and ns.leases == 0 and ns.committed == 32


def test_full_of_pins_and_reservations_reserves_nothing(state: PageStore) -> None:
    store = state
    ns = store.create(("fp", b"s", 0), GEO)
    _, pages, _ = store.put(ns, _keys(1, 32), 10.0)
    lease = store.write_lease(ns, pages, 10.0)
    assert store.put(ns, _keys(2, 4), 10.0) == ([], [], 0)  # reserved slots are never taken
    store.release(lease.id, [])
    assert ns.counters.reservations_dropped == 32
    assert ns.reserved == 0 and len(store.arena.free_chunks) == 8  # every chunk went back


def test_page_reported_corrupt_while_another_reader_holds_it(state: PageStore) -> None:
    store = state
    ns = store.create(("fp", b"s", 0), GEO)
    keys = _keys(1, 2)
    _commit(store, ns, keys)
    _, first = store.get(ns, keys, 10.0)
    _, second = store.get(ns, keys, 10.0)
    assert first is not None and second is not None
    store.release(first.id, [1])
    assert len(store.hit_prefix(ns, keys)) == 1  # invisible at once
    page = second.pages[1]
    assert page.doomed and page.slot not in page.chunk.free  # but its slot waits for the other reader
    store.release(second.id, [])
    assert page.slot in page.chunk.free and ns.pinned == 0 and ns.counters.checksum_failures == 1


def test_expired_leases_unpin_and_free(state: PageStore) -> None:
    store = state
    ns = store.create(("fp", b"s", 0), GEO)
    keys = _keys(1, 3)
    _commit(store, ns, keys)
    store.get(ns, keys, 0.01)
    _, pages, _ = store.put(ns, _keys(2, 2), 0.01)
    store.write_lease(ns, pages, 0.01)
    assert store.sweep(now=float("inf")) == 2
    assert store.live_leases() == 0 and ns.pinned == 0 and ns.reserved == 0
    assert ns.counters.leases_expired == 2 and ns.committed == 3


def test_a_put_takes_one_run_and_holes_fill_before_anything_is_evicted(state: PageStore) -> None:
    store = state
    ns = store.create(("fp", b"s", 0), GEO)
    first = _keys(1, 4)
    _commit(store, ns, first)  # chunk 0 full
    _, lease = store.get(ns, first, 10.0)
    assert lease is not None
    store.release(lease.id, [1])  # slot 1 of chunk 0 comes free
    _, pages, _ = store.put(ns, _keys(2, 3), 10.0)
    assert [(s.first_slot, s.count) for s in store.spans(pages)] == [(0, 3)]  # a fresh chunk, one run
    assert ns.chunks.index(pages[0].chunk) == 1
    store.finish_commit(store.write_lease(ns, pages, 10.0), [True] * 3)
    assert _commit(store, ns, _keys(3, 24)) == 0  # the six free chunks, whole
    # The arena has no free chunk: a put goes to the holes (chunk 0's slot 1, chunk 1's slot 3) before
    # it evicts anything.
    _, pages, evicted = store.put(ns, _keys(4, 2), 10.0)
    assert evicted == 0
    assert [(ns.chunks.index(p.chunk), p.slot) for p in pages] == [(0, 1), (1, 3)]
    store.finish_commit(store.write_lease(ns, pages, 10.0), [True] * 2)
    assert _commit(store, ns, _keys(5, 1)) == 1  # full: now a page is evicted
