"""The store records which replica wrote each page (`PutPagesRequest.holder`) and tells a reader the holder
of the first hit page and how many leading hit pages share it (`GetPagesResponse.holder`, `holder_pages`)."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import pytest
from xavier.v1 import page_store_service_pb2 as pb
from xavier.v1 import types_pb2

from tests.pagestore.support import (
    BPP,
    NBUF,
    buffers,
    chain,
    make_pool,
    page_digest,
    raw_release,
    start_store,
    stats,
    stub,
)
from tests.support.procs import ServiceProc
from xavier_core.pagestore import ClientSettings, PageNamespace, PageStoreClient
from xavier_core.pagestore.client import FromHolder, InOrder, Standing, holder_standing
from xavier_core.pagestore.connection import HolderStuck
from xavier_core.runtime.errors import from_rpc_error

pytestmark = pytest.mark.integration


def _get(address: str, fp: str, keys: list[bytes], request_id: str | None = None) -> pb.GetPagesResponse:
    ch, s = stub(address)
    with ch:
        req = pb.GetPagesRequest(
            request_id=request_id or uuid.uuid4().hex,
            namespace=pb.PageNamespace(contract_fingerprint=fp),
            keys=keys,
            segment_bytes=[BPP] * NBUF,
        )
        resp: pb.GetPagesResponse = s.GetPages(req, timeout=5)
        return resp


def _put_request(fp: str, keys: list[bytes], **fields: Any) -> pb.PutPagesRequest:
    """A PutPages of `keys` in namespace `fp`, with the test's geometry and a fresh request id."""
    return pb.PutPagesRequest(
        request_id=uuid.uuid4().hex,
        namespace=pb.PageNamespace(contract_fingerprint=fp),
        keys=keys,
        segment_bytes=[BPP] * NBUF,
        **fields,
    )


def _holder_of(address: str, fp: str, keys: list[bytes]) -> tuple[int, tuple[str, int] | None, int]:
    """(hit_count, holder, holder_pages) of one GetPages, its lease released."""
    got = _get(address, fp, keys)
    if got.lease_id:
        assert raw_release(address, got.lease_id).released
    holder = (got.holder.peer_id, got.holder.epoch) if got.HasField("holder") else None
    return got.hit_count, holder, got.holder_pages


async def test_a_put_with_a_holder_is_told_to_readers_and_replayed_alike(store: ServiceProc) -> None:
    fp = "fp-holder-one"
    keys = chain(fp, "", 1, 5)
    pool = make_pool(41)  # a client keeps only the buffers' addresses: the arrays must outlive it
    writer = PageStoreClient(store.address, buffers(pool), holder=("a", 3))
    try:
        assert await writer.write(PageNamespace(fp), keys, [0, 1, 2, 3, 4]) == 5
    finally:
        await writer.close()
    first = _get(store.address, fp, keys, request_id="holder-replay")
    try:
        assert first.hit_count == 5
        assert (first.holder.peer_id, first.holder.epoch, first.holder_pages) == ("a", 3, 5)
        # A retried GetPages (same request id) gets the very same answer, holder included.
        assert _get(store.address, fp, keys, request_id="holder-replay") == first
    finally:
        assert raw_release(store.address, first.lease_id).released
    # A longer chain hits the stored prefix only; the holder covers those hits.
    assert _holder_of(store.address, fp, chain(fp, "", 1, 7)) == (5, ("a", 3), 5)


async def test_two_writers_the_run_stops_where_the_holder_changes(store: ServiceProc) -> None:
    fp = "fp-holder-two"
    ns = PageNamespace(fp)
    keys = chain(fp, "", 2, 6)
    pool = make_pool(42)
    client = PageStoreClient(store.address, buffers(pool))
    try:
        client.holder = ("a", 1)  # set after construction, as a replica does once it has registered
        assert await client.write(ns, keys[:3], [0, 1, 2]) == 3
        client.holder = ("b", 1)
        assert await client.write(ns, keys, [0, 1, 2, 3, 4, 5]) == 3  # the first half is stored already
    finally:
        await client.close()
    assert _holder_of(store.address, fp, keys) == (6, ("a", 1), 3)
    assert _holder_of(store.address, fp, keys[3:]) == (3, ("b", 1), 3)


async def test_same_peer_other_epoch_is_another_holder(store: ServiceProc) -> None:
    fp = "fp-holder-epoch"
    ns = PageNamespace(fp)
    keys = chain(fp, "", 3, 4)
    pool = make_pool(43)
    client = PageStoreClient(store.address, buffers(pool), holder=("a", 1))
    try:
        assert await client.write(ns, keys[:1], [0]) == 1
        client.holder = ("a", 2)  # registered again: it holds nothing it wrote before
        assert await client.write(ns, keys, [0, 1, 2, 3]) == 3
    finally:
        await client.close()
    assert _holder_of(store.address, fp, keys) == (4, ("a", 1), 1)
    assert _holder_of(store.address, fp, keys[1:]) == (3, ("a", 2), 3)


async def test_a_put_without_holder_leaves_none_and_a_rewrite_takes_its_writers(store: ServiceProc) -> None:
    fp = "fp-holder-none"
    ns = PageNamespace(fp)
    keys = chain(fp, "", 4, 4)
    pool = make_pool(44)
    anonymous = PageStoreClient(store.address, buffers(pool))
    named = PageStoreClient(store.address, buffers(pool), holder=("a", 1))
    try:
        assert await anonymous.write(ns, keys, [0, 1, 2, 3]) == 4
        assert _holder_of(store.address, fp, keys) == (4, None, 0)
        got = _get(store.address, fp, keys)
        assert not got.HasField("holder") and got.holder_pages == 0
        # A reader names page 0 corrupt: the store drops it, and the next writer's put stores it again.
        assert raw_release(store.address, got.lease_id, [0]).released
        assert await named.write(ns, keys, [0, 1, 2, 3]) == 1
        assert _holder_of(store.address, fp, keys) == (4, ("a", 1), 1)
        got = _get(store.address, fp, keys)
        assert raw_release(store.address, got.lease_id, [0]).released
        assert await anonymous.write(ns, keys, [0, 1, 2, 3]) == 1
        assert _holder_of(store.address, fp, keys) == (4, None, 0)
    finally:
        await anonymous.close()
        await named.close()


@pytest.mark.parametrize("peer_id", ["", "p" * 300], ids=["empty", "300 characters"])
def test_a_bad_holder_is_refused_and_the_store_keeps_serving(store: ServiceProc, peer_id: str) -> None:
    fp = "fp-holder-bad"
    keys = chain(fp, "", 5, 2)

    def put(holder: pb.PageHolder) -> pb.PutPagesResponse:
        resp: pb.PutPagesResponse = s.PutPages(_put_request(fp, keys, holder=holder), timeout=5)
        return resp

    ch, s = stub(store.address)
    with ch:
        with pytest.raises(grpc.RpcError) as info:
            put(pb.PageHolder(peer_id=peer_id, epoch=1))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        err = from_rpc_error(info.value)
        assert err.reason == "INVALID_ARGUMENT" and err.metadata["field"] == "holder.peer_id"
        # Nothing was reserved; a holder of the longest allowed peer id is taken.
        ok = put(pb.PageHolder(peer_id="p" * 256, epoch=1))
        assert list(ok.reserved_indices) == [0, 1]
        assert raw_release(store.address, ok.lease_id).released


Asked = list[tuple[tuple[str, int], int, list[int]]]


def _recorder(asked: Asked) -> FromHolder:
    """A `from_holder` that notes what it is asked and copies nothing (the store's READ follows)."""

    async def ask(holder: tuple[str, int], at: int, pages: list[int], _stands: Standing | None) -> int:
        asked.append((holder, at, pages))
        return 0

    return ask


async def test_a_fetch_asks_the_holder_only_for_a_call_whose_hits_are_all_its(store: ServiceProc) -> None:
    fp = "fp-holder-fetch"
    ns = PageNamespace(fp)
    keys = chain(fp, "", 6, 5)
    pool = make_pool(46)
    writer = PageStoreClient(store.address, buffers(pool), holder=("a", 3))
    reader_pool = make_pool(None)
    reader = PageStoreClient(store.address, buffers(reader_pool))
    asked: Asked = []
    ask = _recorder(asked)
    try:
        miss = await reader.fetch(ns, keys, InOrder([10, 11, 12, 13, 14]), from_holder=ask)
        assert (miss.hit, asked) == (0, [])
        assert await writer.write(ns, keys[:2], [0, 1]) == 2
        writer.holder = None
        assert await writer.write(ns, keys[:4], [0, 1, 2, 3]) == 2
        # Four hits, the holder wrote two: not all the call's pages are its, so the store is READ.
        got = await reader.fetch(ns, keys, InOrder([10, 11, 12, 13, 14]), from_holder=ask)
        assert (got.hit, got.stuck, asked) == (4, False, [])
        assert page_digest(reader_pool, [10, 11, 12, 13]) == page_digest(pool, [0, 1, 2, 3])
        # A short allocation takes one page, which the holder wrote: it is asked for that one.
        short = await reader.fetch(ns, keys, lambda n: [20], from_holder=ask)
        assert (short.hit, asked) == (1, [(("a", 3), 0, [20])])
        # No holder on the first hit page: nobody is asked, even though later pages have one.
        assert (await reader.fetch(ns, keys[2:], InOrder([10, 11, 12]), from_holder=ask)).hit == 2
        assert len(asked) == 1
    finally:
        await writer.close()
        await reader.close()


async def test_a_fetch_asks_the_holder_per_store_call_with_its_keys_offset(tmp_path: Path) -> None:
    """A store that takes 2 keys a call: each call whose hits are all one writer's asks that writer, with
    the index of the call's first key among the fetch's keys; a call of two writers asks nobody."""
    svc = start_store(tmp_path, max_keys_per_call="2")
    fp = "fp-holder-calls"
    ns = PageNamespace(fp)
    keys = chain(fp, "", 7, 7)
    pool, reader_pool = make_pool(47), make_pool(None)
    writer = PageStoreClient(svc.address, buffers(pool), holder=("a", 1))
    reader = PageStoreClient(svc.address, buffers(reader_pool))
    asked: Asked = []
    try:
        # A client learns the store's batch limit from its first call that reaches the store's endpoint.
        assert await writer.write(ns, keys[:2], [0, 1]) == 2
        assert await writer.write(ns, keys[:5], [0, 1, 2, 3, 4]) == 3
        assert (await reader.fetch(ns, keys[:2], InOrder([10, 11]))).hit == 2
        writer.holder = ("b", 1)
        assert await writer.write(ns, keys, [0, 1, 2, 3, 4, 5, 6]) == 2
        # Calls of keys 0-1, 2-3 (a's), 4-5 (a's, then b's: nobody asked), 6 (b's).
        got = await reader.fetch(ns, keys, InOrder(list(range(10, 17))), from_holder=_recorder(asked))
        assert got.hit == 7
        assert asked == [(("a", 1), 0, [10, 11]), (("a", 1), 2, [12, 13]), (("b", 1), 6, [16])]
        assert page_digest(reader_pool, list(range(10, 17))) == page_digest(pool, list(range(7)))
        asked.clear()
        got = await reader.fetch(ns, keys[5:], InOrder([10, 11]), from_holder=_recorder(asked))
        assert (got.hit, asked) == (2, [(("b", 1), 0, [10, 11])])
    finally:
        await writer.close()
        await reader.close()
        assert svc.stop() == 0


async def test_a_fetch_copies_from_the_holder_or_reads_what_it_could_not(store: ServiceProc) -> None:
    """`fetch(from_holder=...)`: all pages copied means no READ and the lease released unread; fewer (here
    none, after scribbling into the pages) means the store's READ, whose bytes are what the pool gets."""
    fp = "fp-holder-copy"
    ns = PageNamespace(fp)
    keys = chain(fp, "", 8, 4)
    pool, reader_pool = make_pool(48), make_pool(None)
    writer = PageStoreClient(store.address, buffers(pool), holder=("a", 7))
    reader = PageStoreClient(store.address, buffers(reader_pool))
    asked: list[tuple[tuple[str, int], int, list[int]]] = []

    async def copies(holder: tuple[str, int], at: int, pages: list[int], _stands: Standing | None) -> int:
        asked.append((holder, at, pages))
        for p in pages:  # what the writer's pool holds, as its port would have copied it
            for src, dst in zip(pool, reader_pool, strict=True):
                dst[p * BPP : (p + 1) * BPP] = src[(p - 10) * BPP : (p - 9) * BPP]
        return len(pages)

    async def fails(holder: tuple[str, int], at: int, pages: list[int], _stands: Standing | None) -> int:
        for p in pages:
            for dst in reader_pool:
                dst[p * BPP : (p + 1) * BPP] = 0xEE
        return 0

    try:
        assert await writer.write(ns, keys, [0, 1, 2, 3]) == 4
        got = await reader.fetch(ns, keys, InOrder([10, 11, 12, 13]), from_holder=copies)
        assert (got.hit, got.stuck) == (4, False)
        assert asked == [(("a", 7), 0, [10, 11, 12, 13])]
        assert (reader.counters.reads, reader.counters.holder_pages) == (0, 4)
        assert page_digest(reader_pool, [10, 11, 12, 13]) == page_digest(pool, [0, 1, 2, 3])
        await reader.flush()
        assert stats(store.address).leases == 0  # released, unread

        for dst in reader_pool:
            dst[:] = 0
        got = await reader.fetch(ns, keys, InOrder([10, 11, 12, 13]), from_holder=fails)
        assert got.hit == 4 and reader.counters.reads == 1 and reader.counters.holder_pages == 4
        assert page_digest(reader_pool, [10, 11, 12, 13]) == page_digest(pool, [0, 1, 2, 3])
    finally:
        await writer.close()
        await reader.close()


async def test_a_holder_copy_still_running_after_it_failed_marks_the_pages_unsafe(store: ServiceProc) -> None:
    """The copy from the holder lands in the fetch's pool pages themselves, staged client or not: one that
    was still running at its park timeout ends the fetch with the pages marked unsafe, the store unread,
    and hands on where the copy's end will be told."""
    fp = "fp-holder-stuck"
    ns = PageNamespace(fp)
    keys = chain(fp, "", 8, 3)
    pool = make_pool(48)
    writer = PageStoreClient(store.address, buffers(pool), holder=("a", 1))
    pools = [make_pool(None), make_pool(None)]
    readers = [
        PageStoreClient(store.address, buffers(pools[0])),
        PageStoreClient(store.address, buffers(pools[1]), ClientSettings(stage_host_pool=True)),
    ]

    ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # where the copy's end is told

    async def stuck(holder: tuple[str, int], at: int, pages: list[int], _stands: Standing | None) -> int:
        raise HolderStuck("copy from a: still in flight after the park timeout", ended)

    try:
        assert await writer.write(ns, keys, [0, 1, 2]) == 3
        for reader in readers:
            got = await reader.fetch(ns, keys, InOrder([10, 11, 12]), from_holder=stuck)
            assert (got.hit, got.stuck, got.released) == (0, True, ended)
            assert reader.counters.errors == 1 and reader.counters.reads == 0  # the store was not READ
        staging = readers[1].staging
        assert staging is not None and staging.usable == staging.slots  # no slot was taken, none retired
        # Nothing was read and the lease went back: the pages stay whole in the store for the next reader.
        assert (await readers[0].fetch(ns, keys, InOrder([20, 21, 22]))).hit == 3
        assert page_digest(pools[0], [20, 21, 22]) == page_digest(pool, [0, 1, 2])
    finally:
        for c in (writer, *readers):
            await c.close()


def _standing_of(address: str, fp: str, keys: list[bytes]) -> tuple[list[int], int]:
    """(pool pages the holder's pages stand at, ms left) of one GetPages, its lease released."""
    got = _get(address, fp, keys)
    if got.lease_id:
        assert raw_release(address, got.lease_id).released
    return [r.first_page + i for r in got.holder_page_runs for i in range(r.count)], got.holder_standing_ms


async def _until_not_standing(address: str, fp: str, keys: list[bytes]) -> None:
    for _ in range(200):  # a bounded wait for the store's clock to pass the standing
        if not _standing_of(address, fp, keys)[0]:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the pages still stand")


async def test_pages_that_stand_are_handed_to_readers_with_their_pool_pages_until_they_stop(
    store: ServiceProc,
) -> None:
    fp = "fp-holder-standing"
    ns = PageNamespace(fp)
    keys = chain(fp, "", 9, 6)
    pool, reader_pool = make_pool(49), make_pool(None)
    writer = PageStoreClient(store.address, buffers(pool), holder=("a", 2))
    reader = PageStoreClient(store.address, buffers(reader_pool))
    asked: list[tuple[int, list[int], Standing | None]] = []

    async def ask(holder: tuple[str, int], at: int, pages: list[int], stands: Standing | None) -> int:
        asked.append((at, pages, stands))
        return 0

    try:
        # Pool pages 5, 6, 7 and 9 stand for 0.3 s; the next put of the same holder stands for 60 s.
        assert await writer.write(ns, keys[:4], [5, 6, 7, 9], stand_s=0.3) == 4
        assert await writer.write(ns, keys, [5, 6, 7, 9, 1, 2], stand_s=60) == 2
        sent = time.monotonic()
        ids, left = _standing_of(store.address, fp, keys[4:])
        assert ids == [1, 2] and 59_000 < left <= 60_000
        got = await reader.fetch(ns, keys[4:], InOrder([30, 31]), from_holder=ask)
        assert got.hit == 2 and len(asked) == 1  # read from the store after the ask copied nothing
        at, pages, stands = asked[0]
        assert (at, pages) == (0, [30, 31]) and stands is not None and stands.pages == [1, 2]
        assert sent + 59 < stands.deadline <= time.monotonic() + 60
        # A short allocation: the standing pages of the pages it took.
        asked.clear()
        assert (await reader.fetch(ns, keys[4:], lambda n: [40], from_holder=ask)).hit == 1
        assert asked[0][2] is not None and asked[0][2].pages == [1]
        # Once the first put's pages stop standing, a run holding any of them stands nowhere; the holder
        # is still named, to be asked.
        await _until_not_standing(store.address, fp, keys)
        assert _holder_of(store.address, fp, keys) == (6, ("a", 2), 6)
        assert _standing_of(store.address, fp, keys[4:])[0] == [1, 2]
        asked.clear()
        assert (await reader.fetch(ns, keys, InOrder(list(range(30, 36))), from_holder=ask)).hit == 6
        assert [s for *_, s in asked] == [None]
        assert page_digest(reader_pool, list(range(30, 36))) == page_digest(pool, [5, 6, 7, 9, 1, 2])
    finally:
        await writer.close()
        await reader.close()


async def test_a_put_without_a_holder_or_standing_stands_nowhere(store: ServiceProc) -> None:
    fp = "fp-holder-no-standing"
    ns = PageNamespace(fp)
    keys = chain(fp, "", 10, 3)
    pool = make_pool(50)
    client = PageStoreClient(store.address, buffers(pool))
    try:
        assert await client.write(ns, keys[:1], [0], stand_s=60) == 1  # no holder: nothing can stand
        client.holder = ("a", 1)
        assert await client.write(ns, keys, [0, 1, 2]) == 2  # a holder, no standing
    finally:
        await client.close()
    got = _get(store.address, fp, keys[1:])
    assert raw_release(store.address, got.lease_id).released
    assert (got.holder_pages, list(got.holder_page_runs), got.holder_standing_ms) == (2, [], 0)
    assert _standing_of(store.address, fp, keys) == ([], 0)


@pytest.mark.parametrize(
    ("runs", "seconds", "holder", "field"),
    [
        ([(0, 2)], 5.0, False, "holder"),
        ([(0, 1)], 5.0, True, "holder_page_runs"),
        ([(0, 2), (4, 0)], 5.0, True, "holder_page_runs"),
        ([(0, 2)], 0.0, True, "holder_standing_seconds"),
        ([(0, 2)], 601.0, True, "holder_standing_seconds"),
        ([], 5.0, True, "holder_standing_seconds"),
    ],
    ids=["no holder", "too few pages", "an empty run", "no seconds", "too long", "seconds alone"],
)
def test_bad_standing_is_refused_by_field_and_reserves_nothing(
    store: ServiceProc, runs: list[tuple[int, int]], seconds: float, holder: bool, field: str
) -> None:
    fp = "fp-holder-bad-standing"
    keys = chain(fp, "", 11, 2)
    req = _put_request(
        fp,
        keys,
        holder_page_runs=[types_pb2.PageRun(first_page=f, count=c) for f, c in runs],
        holder_standing_seconds=seconds,
    )
    if holder:
        req.holder.CopyFrom(pb.PageHolder(peer_id="a", epoch=1))
    ch, s = stub(store.address)
    with ch:
        with pytest.raises(grpc.RpcError) as info:
            s.PutPages(req, timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert from_rpc_error(info.value).metadata["field"] == field
        req.request_id = uuid.uuid4().hex  # the same put, well formed, is taken: nothing was reserved before
        req.holder.CopyFrom(pb.PageHolder(peer_id="a", epoch=1))
        req.ClearField("holder_page_runs")
        req.holder_page_runs.append(types_pb2.PageRun(first_page=0, count=2))
        req.holder_standing_seconds = 5.0
        ok = s.PutPages(req, timeout=5)
        assert list(ok.reserved_indices) == [0, 1]
        assert raw_release(store.address, ok.lease_id).released


def test_a_store_answer_whose_standing_does_not_add_up_is_not_used() -> None:
    """The client takes the pool pages of a GetPages answer only when they cover its holder pages."""

    def answer(runs: list[tuple[int, int]], holder_pages: int, ms: int = 5000) -> pb.GetPagesResponse:
        return pb.GetPagesResponse(
            holder_pages=holder_pages,
            holder_page_runs=[types_pb2.PageRun(first_page=f, count=c) for f, c in runs],
            holder_standing_ms=ms,
        )

    got = holder_standing(answer([(7, 2), (3, 1)], 3), 2, sent=100.0)
    assert got == Standing([7, 8], 105.0)  # the first n, due `holder_standing_ms` after the call was sent
    assert holder_standing(answer([(7, 2)], 3), 2, sent=0.0) is None  # fewer than the holder's pages
    assert holder_standing(answer([(7, 2), (9, 0)], 2), 2, sent=0.0) is None  # an empty run
    assert holder_standing(answer([(7, 2)], 2), 3, sent=0.0) is None  # fewer than the call took
    assert holder_standing(answer([(7, 2)], 2, ms=0), 2, sent=0.0) is None  # no time left
    assert holder_standing(answer([], 2), 2, sent=0.0) is None
