"""The engine's store seam in one process (real store process, real NIXL): a request that goes away while
its prefix is being fetched leaves no page behind, an abort during the fetch ends it as aborted, and pool
pages a READ might still write into are never handed out again."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.pagestore.engines import prompt
from tests.support.procs import ServiceProc
from xavier_core.engine.api import AbortEvent, Sampling, TokenEvent
from xavier_core.engine.errors import RequestAbortedError
from xavier_core.engine.reference import ReferenceEngine
from xavier_core.engine.store_link import OUTPUT_BATCH_PAGES
from xavier_core.engine.tiny import make_tiny
from xavier_core.pagestore import ClientSettings, PageStoreClient
from xavier_core.pagestore.connection import HolderStuck, TransferStuck

pytestmark = pytest.mark.integration

GREEDY = Sampling(max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("models") / "tiny-qwen2", "qwen2")


@pytest.fixture
async def engine(model: Path, store: ServiceProc) -> AsyncIterator[ReferenceEngine]:
    eng = ReferenceEngine.load(model, num_pages=300, max_running=4)
    # A deadline well past the 0.2 s after which the tests abort, even on a loaded machine.
    client = PageStoreClient(store.address, eng.kv_buffers(), ClientSettings(rpc_timeout_s=3.0))
    eng.use_page_store(client, "fp-seam")
    try:
        yield eng
    finally:
        await client.close()
        await eng.close()


def _all_free(eng: ReferenceEngine) -> bool:
    s = eng.stats()
    return s.pages_free == s.pages_total and s.pages_pinned == 0 and s.running == s.waiting == 0


async def _settle(eng: ReferenceEngine) -> None:
    """Waits for pages to come back (a stalled fetch returns them at its RPC deadline)."""
    for _ in range(1000):
        if _all_free(eng):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"pages still held: {eng.stats()}")


async def test_abort_during_a_stalled_fetch(engine: ReferenceEngine, store: ServiceProc) -> None:
    # Connected first: a stopped store then holds each RPC until its deadline (an unconnected channel
    # would fail at once on the missing HTTP/2 handshake).
    assert engine._store is not None
    await engine._store.client.exists(engine._store.namespace(""), [b"k" * 32])
    store.proc.send_signal(signal.SIGSTOP)
    try:
        stream = engine.generate("seam-abort", prompt(1, 200), GREEDY)
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.2)
        await engine.abort("seam-abort")
        assert isinstance(await first, AbortEvent)
        task = asyncio.ensure_future(engine.prefill("seam-abort-p", prompt(2, 200), GREEDY))
        await asyncio.sleep(0.2)
        await engine.abort("seam-abort-p")
        with pytest.raises(RequestAbortedError):
            await task
    finally:
        store.proc.send_signal(signal.SIGCONT)
    await _settle(engine)


async def test_caller_gone_during_a_fetch_leaves_no_pages(
    engine: ReferenceEngine, store: ServiceProc
) -> None:
    tokens = prompt(3, 400)
    events = [ev async for ev in engine.generate("seam-warm", tokens, GREEDY)]  # written through
    assert all(isinstance(ev, TokenEvent) for ev in events)
    await engine._store.client.flush()  # type: ignore[union-attr]
    engine._cache.clear()  # with the local cache empty, the next request fetches from the store
    # A caller cancelled mid-fetch: the fetch finishes on its own and its pages go back.
    task = asyncio.ensure_future(engine.prefill("seam-cancel", [*tokens, 5], GREEDY))
    for _ in range(400):
        if engine._store is not None and engine._store.is_fetching("seam-cancel"):
            break
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    def fetched() -> int:
        stats = engine.stats().store
        return stats.hit_pages if stats is not None else 0

    for _ in range(1000):  # the fetch runs to its end without its caller
        if fetched() >= len(tokens) // 16:
            break
        await asyncio.sleep(0.01)
    assert fetched() == len(tokens) // 16
    await _settle(engine)
    # What it fetched went into the local cache: the next request finds it there.
    res = await engine.prefill("seam-after", [*tokens, 6], GREEDY)
    assert res.cached_tokens >= len(tokens) - 16 and res.cached_tokens_store == 0
    engine.release_pages("seam-after")
    await _settle(engine)


async def _stuck_miss(
    engine: ReferenceEngine, monkeypatch: pytest.MonkeyPatch, seed: int, ended: Callable[[], bool] | None
) -> int:
    """A prompt written through, then asked again with every store READ ending stuck (NIXL refused to
    cancel it; `ended` asks again): served as a miss. Returns the prompt's full pages."""
    tokens = prompt(seed, 400)
    events = [ev async for ev in engine.generate(f"seam-{seed}-warm", tokens, GREEDY)]  # written through
    assert all(isinstance(ev, TokenEvent) for ev in events)
    assert engine._store is not None
    client = engine._store.client
    await client.flush()
    engine._cache.clear()
    # A READ posted and then waited for, as over NIXL (a same-host read checked as it lands cannot stick).
    client.settings = dataclasses.replace(client.settings, check_while_reading=False)
    real = client.conn.settle

    def stuck(*a: Any) -> None:
        real(*a)
        raise TransferStuck("READ still in flight", ended)

    monkeypatch.setattr(client.conn, "settle", stuck)
    res = await engine.prefill(f"seam-{seed}", [*tokens, 5], GREEDY)
    assert res.cached_tokens == 0
    engine.release_pages(f"seam-{seed}")
    await client.flush()  # its write-through holds its computed pages until the store answers
    engine._cache.clear()
    return len(tokens) // 16


async def test_pages_of_a_stuck_read_are_never_reused(
    engine: ReferenceEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    pages = await _stuck_miss(engine, monkeypatch, 4, None)
    s = engine.stats()
    assert s.running == s.waiting == s.pages_pinned == 0
    # Every page is back but the READ's: out of the pool for good, never handed to another request.
    assert s.pages_total - s.pages_free == pages


async def test_pages_of_a_stuck_read_come_back_once_it_has_ended(
    engine: ReferenceEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same stuck READ, but one NIXL lets go of when asked again (`TransferStuck.ended`): its pages
    stay out of use until then, and then they are the pool's again."""
    let_go = asyncio.Event()
    pages = await _stuck_miss(engine, monkeypatch, 5, let_go.is_set)
    s = engine.stats()
    assert s.pages_total - s.pages_free == pages  # held while the READ may still write
    let_go.set()
    await _settle(engine)


async def test_a_generating_request_writes_its_output_through_in_batches(
    engine: ReferenceEngine, store: ServiceProc
) -> None:
    """Prompt pages at the prompt's end, then every OUTPUT_BATCH_PAGES full output pages while the request
    runs (so a replica that dies mid-answer has written most of it), and the rest when it finishes."""
    client = engine._store.client if engine._store is not None else None
    assert client is not None
    ids = prompt(77, 40)  # 2 full pages and 8 tokens
    before = dataclasses.replace(client.counters)
    batch, out = OUTPUT_BATCH_PAGES, 2 * OUTPUT_BATCH_PAGES * 16 + 60
    stream = engine.generate("out-pages", ids, Sampling(max_tokens=out, ignore_eos=True), cache_salt="out")
    tokens = [ev async for ev in stream]
    assert len(tokens) == out and all(isinstance(ev, TokenEvent) for ev in tokens)
    await client.flush()
    full = (len(ids) + out - 1) // 16  # the last token's KV is never computed
    output_pages = full - len(ids) // 16
    # One write for the prompt, one per full batch (each leaves as its last page fills), one for the rest.
    assert client.counters.writes - before.writes == 1 + output_pages // batch + (output_pages % batch > 0)
    assert client.counters.pages_written - before.pages_written == full
    await _settle(engine)


async def test_pages_of_a_stuck_copy_from_the_holder_come_back_once_it_ends(
    engine: ReferenceEngine, model: Path, store: ServiceProc
) -> None:
    """A copy from the replica that wrote the pages (`share`) still running after it failed keeps the
    fetch's pages out of use until the copy's end is told (`HolderStuck.released`), then they go back."""
    writer = ReferenceEngine.load(model, num_pages=300, max_running=4)
    client = PageStoreClient(store.address, writer.kv_buffers(), holder=("writer", 1))
    writer.use_page_store(client, "fp-seam")
    ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    asked: list[tuple[str, int]] = []

    async def stuck(holder: tuple[str, int], *_: Any) -> int:
        asked.append(holder)
        raise HolderStuck("copy from writer: still in flight after the park timeout", ended)

    tokens = prompt(6, 400)
    try:
        events = [ev async for ev in writer.generate("w", tokens, GREEDY)]  # written through
        assert all(isinstance(ev, TokenEvent) for ev in events)
        await client.flush()
        assert engine._store is not None
        engine._store.share = stuck
        res = await engine.prefill("seam-holder-stuck", [*tokens, 5], GREEDY)  # served as a miss
        assert res.cached_tokens == 0 and asked == [("writer", 1)]
        engine.release_pages("seam-holder-stuck")
        await engine._store.client.flush()
        engine._cache.clear()
        assert engine.stats().pages_total - engine.stats().pages_free == len(tokens) // 16  # held
        ended.set_result(None)  # the copy has ended
        await _settle(engine)
    finally:
        await client.close()
        await writer.close()


async def test_written_pages_stand_within_the_pool_share_then_come_back(
    model: Path, store: ServiceProc
) -> None:
    """A sharing engine's write-through keeps its pages (`stand_s`, plus the slack) while at most
    `stand_share` of the pool stands: a write that would pass it stands nothing, its pages back at once."""
    writer = ReferenceEngine.load(model, num_pages=100, max_running=4)
    client = PageStoreClient(store.address, writer.kv_buffers(), holder=("writer", 1))

    async def share(*_: Any) -> int:
        return 0

    writer.use_page_store(client, "fp-stand", share, stand_s=0.5, stand_share=0.3)  # 30 pages may stand
    link = writer._store
    assert link is not None
    try:
        # 20 full prompt pages a request: the second would pass 30; once the first's have come back, the
        # third stands again.
        for seed, standing in ((7, 20), (8, 20), (9, 20)):
            events = [ev async for ev in writer.generate(f"w{seed}", prompt(seed, 328), GREEDY)]
            assert all(isinstance(ev, TokenEvent) for ev in events)
            await client.flush()
            s = writer.stats()
            assert (link.standing, s.pages_total - s.pages_free) == (standing, standing), seed
            if seed == 8:
                await _settle(writer)  # the first write's pages stop standing and come back
                assert link.standing == 0
        await _settle(writer)
        assert link.standing == 0
    finally:
        await client.close()
        await writer.close()
