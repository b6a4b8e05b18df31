"""The staging slab on its own (no NIXL): layout, the bounded chunk allocator, gather and scatter."""

from __future__ import annotations

import numpy as np
import pytest
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from tests.transfer.kvpool import PAGES, kv_buffers, make_pool, page_bytes
from xavier_core.transfer.common.buffers import KvBuffer
from xavier_core.transfer.common.errors import InvalidSourceError, LayoutError
from xavier_core.transfer.common.slab_layout import SlabLayout
from xavier_core.transfer.common.source import SourceInfo, endpoint_proto
from xavier_core.transfer.staged.slab import Slab, View


def test_layout_cuts_whole_records_into_chunks() -> None:
    bufs = [KvBuffer(4096, 1 << 20, 1000, "cpu"), KvBuffer(8192, 1 << 20, 24, "cpu")]
    layout = SlabLayout.plan(bufs, chunk_bytes=4500, slab_bytes=50_000)
    assert layout.record_bytes == 1024 and layout.offsets == (0, 1000)
    assert layout.chunk_pages == 4 and layout.chunk_bytes == 4096 and layout.num_chunks == 12
    assert layout.chunks_for(1) == 1 and layout.chunks_for(8) == 2 and layout.chunks_for(9) == 3
    # A chunk smaller than a record still holds one.
    assert SlabLayout.plan(bufs, chunk_bytes=10, slab_bytes=10).chunk_pages == 1
    peer = SlabLayout.of_peer(bufs, KvBuffer(1 << 20, 3 * 4096 + 5, 4096, "cpu"))
    assert (peer.chunk_pages, peer.num_chunks) == (4, 3)
    for bad in (KvBuffer(1 << 20, 8192, 4000, "cpu"), KvBuffer(1 << 20, 100, 1024, "cpu")):
        with pytest.raises(InvalidSourceError, match="staging_slab"):
            SlabLayout.of_peer(bufs, bad)
    # Network input: a peer's buffers without bytes per page are refused, not divided by.
    for sizes in ((0, 0), (1000, 0), ()):
        peer_bufs = [KvBuffer(4096, 1 << 20, size, "cpu") for size in sizes]
        with pytest.raises(InvalidSourceError, match="bytes per page"):
            SlabLayout.of_peer(peer_bufs, KvBuffer(1 << 20, 8192, 4096, "cpu"))


def test_allocator_is_bounded_and_counts_fallbacks() -> None:
    slab = Slab(SlabLayout((64,), chunk_pages=2, num_chunks=4), "cpu")
    a = slab.alloc(3)
    assert a == [0, 1, 2] and slab.bytes_in_use == 3 * 128
    assert slab.alloc(2) is None and slab.fallbacks == 1
    b = slab.alloc(1)
    assert b == [3] and slab.chunks_in_use == 4
    slab.free(a)
    assert slab.alloc(2) == [0, 1]
    slab.free([0, 1, 3])
    assert slab.bytes_in_use == 0


@pytest.mark.parametrize("n", [1, 3, 4, 5, 17])
def test_gather_then_scatter_moves_exact_pages(n: int) -> None:
    rng = np.random.default_rng(n)
    src_pool, dst_pool = make_pool(5), make_pool(None)
    src_bufs, dst_bufs = kv_buffers(src_pool), kv_buffers(dst_pool)
    slab = Slab(SlabLayout.plan(src_bufs, 4 * sum(b.bytes_per_page for b in src_bufs), 1 << 22), "cpu")
    src_pages = rng.permutation(PAGES)[:n].astype(np.int64)
    dst_pages = rng.permutation(PAGES)[:n].astype(np.int64)
    chunks = slab.alloc(slab.layout.chunks_for(n))
    assert chunks is not None
    chunks = chunks[::-1]  # chunks need not be in order
    slab.gather(View.of(src_bufs), src_pages, chunks)
    # What a chunk holds is packed from its start (a READ of n records), buffer-major.
    cp, record = slab.layout.chunk_pages, slab.layout.record_bytes
    last = n - cp * (len(chunks) - 1)
    start = chunks[-1] * slab.layout.chunk_bytes
    packed = slab.memory[start : start + last * record]
    size = src_bufs[0].bytes_per_page
    assert bytes(packed[:size]) == page_bytes(src_pool, [int(src_pages[-last])])[0]
    assert bytes(packed[last * size : (last + 1) * size]) == page_bytes(src_pool, [int(src_pages[-last])])[1]
    for i, chunk in enumerate(chunks):
        assert slab.scatter(View.of(dst_bufs), dst_pages[i * cp : (i + 1) * cp], chunk) is None  # DRAM: done
    assert page_bytes(dst_pool, list(dst_pages)) == page_bytes(src_pool, list(src_pages))
    others = sorted(set(range(PAGES)) - set(dst_pages.tolist()))
    assert not any(np.frombuffer(b, np.uint8).any() for b in page_bytes(dst_pool, others))


def test_chunk_views_stay_inside_the_slab() -> None:
    slab = Slab(SlabLayout((100, 28), chunk_pages=3, num_chunks=2), "cpu")
    view = slab.chunk(1, 2)
    base = slab.buffer.addr + slab.layout.chunk_bytes
    assert view.bases == (base, base + 2 * 100) and view.num_pages == 2
    for bad in ((2, 1), (0, 4), (0, 0)):
        with pytest.raises(LayoutError):
            slab.chunk(*bad)


@pytest.mark.gpu
def test_cuda_gather_and_scatter_are_fused_and_exact() -> None:
    torch = pytest.importorskip("torch")
    from xavier_core.transfer.cuda.copy import triton_available

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pages, per_page, buffers = 512, 4096, 8
    src = [
        torch.randint(0, 256, (pages * per_page,), dtype=torch.uint8, device="cuda:0") for _ in range(buffers)
    ]
    dst = [torch.zeros(pages * per_page, dtype=torch.uint8, device="cuda:0") for _ in range(buffers)]
    bufs = [[KvBuffer(t.data_ptr(), t.numel(), per_page, "cuda:0") for t in pool] for pool in (src, dst)]
    slab = Slab(SlabLayout.plan(bufs[0], 8 * buffers * per_page, 1 << 24), "cuda:0")
    rng = np.random.default_rng(1)
    for run in (1, 4, 0):
        n = 77
        if run == 0:
            s_pages = np.arange(100, 100 + n, dtype=np.int64)
        else:
            starts = rng.permutation(pages // run)[: -(-n // run)] * run
            s_pages = np.array([s + k for s in starts for k in range(run)][:n], dtype=np.int64)
        d_pages = rng.permutation(pages)[:n].astype(np.int64)
        chunks = slab.alloc(slab.layout.chunks_for(n))
        assert chunks is not None
        slab.gather(View.of(bufs[0]), s_pages, chunks)
        cp = slab.layout.chunk_pages
        handles = [
            slab.scatter(View.of(bufs[1]), d_pages[i * cp : (i + 1) * cp], c) for i, c in enumerate(chunks)
        ]
        if triton_available():
            assert all(h is not None and h.launches == 1 for h in handles)  # one fused launch per chunk
        for h in handles:
            assert h is not None
            h.wait(30)
        slab.free(chunks)
        s_idx, d_idx = torch.from_numpy(s_pages).cuda(), torch.from_numpy(d_pages).cuda()
        for a, b in zip(src, dst, strict=True):
            assert torch.equal(a.view(pages, -1)[s_idx], b.view(pages, -1)[d_idx])


def test_staging_runs_from_the_network_are_checked_before_they_are_expanded() -> None:
    bufs = [KvBuffer(4096, 1 << 20, 1024, "cpu")]
    slab = KvBuffer(1 << 20, 4 * 4096, 4096, "cpu")  # 4 chunks of 4 pages
    endpoint = endpoint_proto("src", b"meta", bufs, "host-a", slab)

    def desc(*runs: tuple[int, int]) -> dpb.SourceDescriptor:
        return dpb.SourceDescriptor(
            page_runs=[types_pb2.PageRun(first_page=0, count=8)],
            num_pages=8,
            staging_runs=[types_pb2.PageRun(first_page=f, count=c) for f, c in runs],
        )

    info = SourceInfo.from_proto(desc((1, 1), (3, 1)), endpoint)
    assert list(info.staging_chunks()) == [1, 3]
    big = (1 << 32) - 1  # the most a run may count: expanded, 32 GB of chunk ids
    for runs in ([(0, big)], [(3, 2)], [(0, 1)], [(0, 1), (big - 1, 1)]):
        with pytest.raises(InvalidSourceError, match="staging_runs"):
            SourceInfo.from_proto(desc(*runs), endpoint)
