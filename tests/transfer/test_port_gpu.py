"""`KvPort` GPU to GPU across two processes, with each transport (CUDA IPC, NIXL page runs, staged NIXL
through the slabs): bitwise page equality for random placements (runs of 1, 4 and one contiguous run),
the transport the port reports, and an abort while a CUDA IPC copy is in flight (the pull returns only
after the copy ended, the source hears "fail" only then, the destination pages are reusable at once, and
the event loop never stalls meanwhile).

The source (prefill-like) runs in a spawned process on cuda:0; the reader in this process on the last GPU.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from xavier.v1 import directory_service_pb2 as dpb  # noqa: E402
from xavier.v1 import types_pb2  # noqa: E402

from tests.transfer.kvpool import serve_port, spawned  # noqa: E402
from xavier_core.transfer import KvBuffer, KvPort, peer_key  # noqa: E402
from xavier_core.transfer.cuda.copy import copy_stream  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PAGES = 4096
PAGE_SIZE = 16
BUFFERS = 8  # 4 layers, K and V
HEADS, DIM = 2, 64  # 4 KiB pages (0.5B-shaped)
SRC_KEY = peer_key("gpu-src", 3)
RUNS = (1, 4, 0)  # 0: one contiguous run


def _pool(device: str, seed: int | None) -> list[Any]:
    shape = (PAGES * PAGE_SIZE, HEADS, DIM)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.float16, device=device) for _ in range(BUFFERS)]
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(shape, generator=gen, device=device).to(torch.float16) for _ in range(BUFFERS)]


def _buffers(pool: list[Any]) -> list[KvBuffer]:
    return [
        KvBuffer(
            t.data_ptr(), t.numel() * t.element_size(), t.numel() * t.element_size() // PAGES, str(t.device)
        )
        for t in pool
    ]


def _pages(pool: list[Any], pages: list[int]) -> Any:
    idx = torch.tensor(pages, device=pool[0].device)
    return torch.stack([t.view(PAGES, -1).index_select(0, idx) for t in pool]).cpu()


def _placement(n: int, run: int, rng: np.random.Generator) -> list[int]:
    if run == 0:
        first = int(rng.integers(0, PAGES - n))
        return list(range(first, first + n))
    starts = rng.permutation(PAGES // run)[: -(-n // run)] * run
    return [int(p) for s in starts for p in range(s, s + run)][:n]


async def _serve(conn: Connection, seed: int) -> None:
    torch.cuda.set_device(0)
    pool = _pool("cuda:0", seed)
    port = KvPort(f"gpu-src-{os.getpid()}", _buffers(pool), PAGE_SIZE, transport="auto")
    pages = {"pages": lambda ids: _pages(pool, ids).numpy()}
    await serve_port(conn, port, "host", wait_s=30, extra=pages)


def _source_main(conn: Connection, seed: int) -> None:
    asyncio.run(_serve(conn, seed))


class Source:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    async def call(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        if not await asyncio.to_thread(self.conn.poll, 60):
            raise TimeoutError(f"source did not answer {cmd[0]!r}")
        return self.conn.recv()

    async def publish(
        self, room: int, pages: list[int]
    ) -> tuple[dpb.SourceDescriptor, types_pb2.TransferEndpoint]:
        desc, endpoint = await self.call("publish", room, pages)
        return dpb.SourceDescriptor.FromString(desc), types_pb2.TransferEndpoint.FromString(endpoint)


@pytest.fixture(scope="module")
def source() -> Iterator[Source]:
    with spawned(_source_main, 7, start_s=120, stop_s=20) as conn:
        yield Source(conn)


def _reader_device() -> str:
    return f"cuda:{torch.cuda.device_count() - 1}"


TRANSPORTS = ("cuda_ipc", "nixl", "staged")


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_pull_is_bitwise_exact_for_scattered_and_contiguous_pages(
    source: Source, transport: str
) -> None:
    pool = _pool(_reader_device(), None)
    port = KvPort(f"gpu-dst-{transport}-{os.getpid()}", _buffers(pool), PAGE_SIZE, transport=transport)  # type: ignore[arg-type]
    rng = np.random.default_rng(11)
    try:
        for i, run in enumerate(RUNS):
            n = 257  # a partial last run
            src_pages, dst_pages = _placement(n, run, rng), _placement(n, run, rng)
            room = 1000 + 10 * RUNS.index(run) + TRANSPORTS.index(transport)
            desc, endpoint = await source.publish(room, src_pages)
            assert endpoint.cuda_ipc_pool  # a VRAM source offers CUDA IPC
            # and, under auto for a reader it cannot place, stages the room into its slab
            assert desc.staging_runs and endpoint.HasField("staging_slab")
            await port.pull(room, desc, endpoint, SRC_KEY, dst_pages, timeout=30, park_timeout=30)
            got = _pages(pool, dst_pages).numpy()
            assert np.array_equal(
                got.view(np.uint16), (await source.call("pages", src_pages)).view(np.uint16)
            )
            assert await source.call("wait", room) == "done"
            await source.call("unpublish", room, True)
            assert port.by_transport[transport].transfers == i + 1  # type: ignore[index]
        for other in set(TRANSPORTS) - {transport}:
            assert port.by_transport[other].transfers == 0  # type: ignore[index]
        assert port.staging_bytes_in_use == 0
        stats = port.stats()["run_lengths"]
        assert stats["pages"] == 3 * 257 and stats["buckets"]["1"] > 0
    finally:
        await port.close()


async def test_abort_mid_copy_waits_for_the_copy_and_never_blocks_the_loop(source: Source) -> None:
    pool = _pool(_reader_device(), None)
    port = KvPort(f"gpu-dst-abort-{os.getpid()}", _buffers(pool), PAGE_SIZE, transport="cuda_ipc")
    src_pages = list(range(PAGES))[::-1]  # every page, reversed: one copy of the whole pool
    dst_pages = list(range(PAGES))
    # The copy of the pull under test, and the ticks of the event loop while it was still running: a
    # cancelled pull waits for its copy without blocking the loop, so the loop ticks meanwhile (a pull
    # that blocked the loop on the copy would leave the count at 0).
    watched: list[Any] = []
    busy_ticks = [0]

    async def ticker() -> None:
        while True:
            await asyncio.sleep(0.001)
            if watched and not all(h.is_done() for h in watched):
                busy_ticks[0] += 1

    # One whole pull first: the copy kernel's variant for this shape is compiled now, not while the spin
    # below runs (a compile longer than the spin would let the copy finish before the cancel).
    desc, endpoint = await source.publish(1999, src_pages)
    await port.pull(1999, desc, endpoint, SRC_KEY, dst_pages, timeout=30, park_timeout=30)
    assert await source.call("wait", 1999) == "done"
    await source.call("unpublish", 1999, True)
    tick = asyncio.create_task(ticker())
    try:
        in_flight_at_cancel = 0
        for attempt in range(3):
            room = 2000 + attempt
            desc, endpoint = await source.publish(room, src_pages)
            # Keep the copy in flight: a ~1 s spin queued first on the copy stream holds it back while
            # the pull is cancelled.
            with torch.cuda.device(pool[0].device), torch.cuda.stream(copy_stream(pool[0].device.index)):
                torch.cuda._sleep(2_000_000_000)
            t0 = time.perf_counter()
            pull = asyncio.create_task(
                port.pull(room, desc, endpoint, SRC_KEY, dst_pages, timeout=30, park_timeout=30)
            )
            while not port._copies and not pull.done():  # noqa: ASYNC110 (set on the port thread)
                await asyncio.sleep(0)
            handles = list(port._copies)
            posted_s, done_at_cancel = time.perf_counter() - t0, [h.is_done() for h in handles]
            ended_first = pull.done() and repr(pull.exception() if not pull.cancelled() else "cancelled")
            watched[:], busy_ticks[0] = handles, 0
            pull.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pull
            ticks = busy_ticks[0]
            watched.clear()
            seen = (
                f"attempt {attempt}: copy posted after {posted_s:.3f} s ({len(handles)} handles), "
                f"done at the cancel {done_at_cancel}, the pull ended before the cancel: {ended_first}, "
                f"the pull ended {time.perf_counter() - t0:.3f} s after it started, "
                f"{ticks} loop ticks while its copy ran"
            )
            if handles and not any(done_at_cancel):
                in_flight_at_cancel += 1
                assert ticks > 0, f"the event loop never ran while the cancelled pull waited: {seen}"
            # The pull returned only after the copy ended: the pages may be wanted again at once.
            assert handles and all(h.is_done() for h in handles) and not port._copies, seen
            for t in pool:
                t.fill_(attempt + 1)
            torch.cuda.synchronize(pool[0].device)
            assert all(bool((t == attempt + 1).all()) for t in pool), seen  # nothing wrote them afterwards
            # The source hears how the copy ended, and only now: "fail" for a copy the cancel caught in
            # flight (it may reuse its pages); a copy that had already ended when the pull was cancelled
            # read every page, and may be told either.
            verdict = await source.call("wait", room)
            in_flight = bool(handles) and not any(done_at_cancel)
            assert verdict == "fail" if in_flight else verdict in ("done", "fail"), f"{verdict!r}: {seen}"
            await source.call("unpublish", room, False)
        assert in_flight_at_cancel > 0, "no attempt cancelled a pull while its copy was still running"
        # And a full pull right after still works, bitwise.
        desc, endpoint = await source.publish(2100, src_pages[:300])
        await port.pull(2100, desc, endpoint, SRC_KEY, dst_pages[:300], timeout=30, park_timeout=30)
        want = await source.call("pages", src_pages[:300])
        assert np.array_equal(_pages(pool, dst_pages[:300]).numpy().view(np.uint16), want.view(np.uint16))
        assert await source.call("wait", 2100) == "done"
        await source.call("unpublish", 2100, True)
    finally:
        tick.cancel()
        await port.close()
