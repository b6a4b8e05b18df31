"""A fetch READs in pieces, each checked as it lands: bytes stay exact, a corrupt page in a later piece cuts
the hit there (and is dropped from the store), and a READ that fails or sticks mid-fetch ends as a miss
only once every posted piece has ended, with the pool pages or staging slots kept out as before."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

from tests.pagestore.support import PAGE_BYTES, buffers, chain, make_pool, ns_stats, page_digest, scribble
from tests.support.procs import ServiceProc
from xavier_core.pagestore import ClientSettings, PageNamespace, PageStoreClient, reading
from xavier_core.pagestore.connection import StoreConnection, StorePeer, TransferStuck
from xavier_core.pagestore.layout import Span
from xavier_core.pagestore.metrics import StepClock, client_metrics
from xavier_core.pagestore.reading import cut_spans, piece_bounds, read_in_pieces
from xavier_core.transfer.common.errors import PeerError

PIECE = 2 * PAGE_BYTES
"""Two pages a piece: a 7-page fetch is 4 READs."""


def test_pieces_cover_the_pages_in_order_and_spans_are_cut_at_their_bounds() -> None:
    assert piece_bounds(5, 10, 20) == [(0, 2), (2, 4), (4, 5)]
    assert piece_bounds(5, 10, 0) == [(0, 5)]  # 0: one READ for the whole call
    assert piece_bounds(3, 100, 10) == [(0, 1), (1, 2), (2, 3)]  # at least one page a piece
    spans = [Span(1000, 8, 5, 3), Span(2000, 8, 0, 4)]
    assert cut_spans(spans, 0, 7) == spans
    assert cut_spans(spans, 2, 5) == [Span(1000, 8, 7, 1), Span(2000, 8, 0, 2)]
    assert cut_spans(spans, 3, 4) == [Span(2000, 8, 0, 1)]
    assert cut_spans(spans, 5, 5) == []


class _Wire:
    """A connection whose READs take 1 s each and a clock that moves only when something takes time."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def post(self, op: str, store: object, rows: object) -> Any:
        return SimpleNamespace(state="DONE", in_flight=False)

    def settle(self, op: str, xfer: object, rows: object, pages: int) -> None:
        self.now += 1.0


def test_the_read_step_is_the_wires_time_and_leaves_the_checks_out(monkeypatch: pytest.MonkeyPatch) -> None:
    wire = _Wire()
    monkeypatch.setattr(reading, "time", wire)

    def verify(lo: int, hi: int, clock: StepClock) -> list[int]:
        if threading.current_thread() is threading.main_thread():  # the verify threads run beside it
            wire.now += 10.0  # a check takes 10 s
        clock.add("verify", 10.0)
        return []

    for pieces, read_s in ((1, 1.0), (3, 3.0)):
        clock = StepClock()
        rows = np.zeros((1, 3), dtype=np.uint64)
        conn, store = cast(StoreConnection, wire), cast(StorePeer, None)
        bad = read_in_pieces(conn, store, [(k, k + 1, rows) for k in range(pieces)], verify, clock)
        # The last piece's check runs on this thread after the last byte landed: "verify" only, not "read".
        assert bad == [] and clock.seconds == {"read": read_s, "verify": 10.0 * pieces}, pieces
        wire.now = 0.0


def _reader(store: ServiceProc, staged: bool, pool: list[Any]) -> PageStoreClient:
    settings = ClientSettings(read_piece_bytes=PIECE, stage_host_pool=staged, staging_pages=16)
    return PageStoreClient(store.address, buffers(pool), settings)


@pytest.mark.integration
@pytest.mark.parametrize("staged", [False, True])
async def test_a_read_in_pieces_is_bitwise_and_posts_one_read_per_piece(
    store: ServiceProc, staged: bool
) -> None:
    pool = make_pool(61)
    writer = PageStoreClient(store.address, buffers(pool))
    reader_pool = make_pool(None)
    reader = _reader(store, staged, reader_pool)
    read_s = client_metrics().fetch_seconds.labels("read")
    try:
        ns = PageNamespace(f"fp-pieces-{staged}")
        keys = chain(ns.contract_fingerprint, "", 1, 7)
        assert await writer.write(ns, keys, list(range(7))) == 7
        before = read_s._value.get()
        assert await reader.lookup_and_fetch(ns, keys, list(range(20, 27))) == 7
        assert page_digest(reader_pool, list(range(20, 27))) == page_digest(pool, list(range(7)))
        assert reader.counters.reads == 4  # pieces of 2, 2, 2 and 1 pages
        assert read_s._value.get() > before  # the fetch's steps reach the metric
        if reader.staging is not None:
            assert len(reader.staging._free) == reader.staging.slots
    finally:
        await writer.close()
        await reader.close()


@pytest.mark.integration
@pytest.mark.parametrize("staged", [False, True])
async def test_a_corrupt_page_in_a_later_piece_cuts_the_hit_there(store: ServiceProc, staged: bool) -> None:
    pool = make_pool(62)
    writer = PageStoreClient(store.address, buffers(pool))
    vandal = PageStoreClient(store.address, buffers(make_pool(63)))
    reader_pool = make_pool(None)
    reader = _reader(store, staged, reader_pool)
    try:
        fp = f"fp-pieces-corrupt-{staged}"
        ns = PageNamespace(fp)
        keys = chain(fp, "", 2, 7)
        assert await writer.write(ns, keys, list(range(7))) == 7
        await scribble(store.address, vandal, fp, keys, 5)  # page 5, in the third piece
        assert await reader.lookup_and_fetch(ns, keys, list(range(20, 27))) == 5
        assert page_digest(reader_pool, list(range(20, 25))) == page_digest(pool, list(range(5)))
        assert reader.counters.corrupt_pages == 1  # only page 5: page 6, after it, verified
        await reader.flush()
        (st,) = ns_stats(store.address, fp)
        assert st.checksum_failures == 1 and st.pages == 6  # the corrupt page was dropped
        if reader.staging is not None:
            assert len(reader.staging._free) == reader.staging.slots
    finally:
        for c in (writer, vandal, reader):
            await c.close()


@pytest.mark.integration
@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("fault", ["failed", "stuck"])
async def test_a_read_failing_mid_fetch_waits_for_every_piece_and_is_a_miss(
    store: ServiceProc, monkeypatch: pytest.MonkeyPatch, staged: bool, fault: str
) -> None:
    pool = make_pool(64)
    writer = PageStoreClient(store.address, buffers(pool))
    reader_pool = make_pool(None)  # held: NIXL reads into its memory
    reader = _reader(store, staged, reader_pool)
    posted: list[Any] = []
    ended: list[Any] = []
    real_post, real_settle = reader.conn.post, reader.conn.settle

    def post(*a: Any) -> Any:
        xfer = real_post(*a)
        posted.append(xfer)
        return xfer

    def settle(op: Any, xfer: Any, *a: Any) -> None:
        real_settle(op, xfer, *a)
        ended.append(xfer)
        if len(ended) == 2:  # the second piece: after the first was handed to its check
            raise TransferStuck("still in flight") if fault == "stuck" else PeerError("READ ended ERR")

    monkeypatch.setattr(reader.conn, "post", post)
    monkeypatch.setattr(reader.conn, "settle", settle)
    try:
        fp = f"fp-pieces-{fault}-{staged}"
        ns = PageNamespace(fp)
        keys = chain(fp, "", 3, 7)
        assert await writer.write(ns, keys, list(range(7))) == 7
        got = await reader.fetch(ns, keys, lambda n: list(range(20, 20 + n)))
        assert got.hit == 0 and reader.counters.errors == 1
        assert len(posted) == 3 and not any(x.in_flight for x in posted)  # every posted READ ended
        assert got.stuck == (fault == "stuck" and not staged)  # a stuck READ's pool pages stay out
        if reader.staging is not None:  # slots a stuck READ may touch are retired, the rest come back
            out = 7 if fault == "stuck" else 0
            assert reader.staging.usable == reader.staging.slots - out
            assert len(reader.staging._free) == reader.staging.slots - out
        await reader.flush()
    finally:
        await writer.close()
        await reader.close()
