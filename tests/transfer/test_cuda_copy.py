"""Fused GPU page copy: bitwise page equality for random placements, across devices and processes.

Run lengths 1, 4 and one contiguous run; in one process from cuda:0 to cuda:1 (peer access; one GPU:
within cuda:0), and across two processes through CUDA IPC, the importer pulling from the exporter's pool.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import Connection

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from xavier_core.transfer.common.buffers import KvBuffer  # noqa: E402
from xavier_core.transfer.common.errors import StaleEpochError  # noqa: E402
from xavier_core.transfer.cuda.copy import copy_pages, triton_available  # noqa: E402
from xavier_core.transfer.cuda.copy_plan import PoolView  # noqa: E402
from xavier_core.transfer.cuda.ipc import IpcImporter, export_pool  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

RUNS = (1, 4, 0)  # 0: one contiguous run
# (buffers, page_size, kv_heads, head_dim): 0.5B-like 4 KiB pages; 32 KiB pages (two programs per
# page); 30-byte pages (2-byte elements, masked tail).
SHAPES = ((6, 16, 2, 64), (4, 16, 8, 128), (3, 5, 1, 3))
ENGINES = ("triton", "torch")


def _devices() -> tuple[int, int]:
    return (0, 1) if torch.cuda.device_count() > 1 else (0, 0)


def _pool(shape: tuple[int, int, int, int], pages: int, device: int, seed: int | None) -> list[torch.Tensor]:
    nbuf, ps, heads, dim = shape
    dims = (pages * ps, heads, dim)
    if seed is None:
        return [torch.zeros(dims, dtype=torch.float16, device=f"cuda:{device}") for _ in range(nbuf)]
    gen = torch.Generator().manual_seed(seed)
    n = pages * ps * heads * dim * 2
    return [
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        .view(torch.float16)
        .view(dims)
        .to(f"cuda:{device}")
        for _ in range(nbuf)
    ]


def _buffers(pool: list[torch.Tensor], pages: int) -> list[KvBuffer]:
    out = []
    for t in pool:
        nbytes = t.numel() * t.element_size()
        out.append(KvBuffer(t.data_ptr(), nbytes, nbytes // pages, f"cuda:{t.device.index}"))
    return out


def _placement(n: int, pool_pages: int, run: int, rng: np.random.Generator) -> np.ndarray:
    """n distinct pages in runs of `run` consecutive ids (0: one run), runs in random order."""
    if run == 0:
        start = int(rng.integers(0, pool_pages - n + 1))
        return np.arange(start, start + n)
    runs = [np.arange(p, min(p + run, pool_pages)) for p in range(int(rng.integers(0, run)), pool_pages, run)]
    return np.concatenate([runs[i] for i in rng.permutation(len(runs))])[:n]


def _check(
    src: list[torch.Tensor], dst: list[torch.Tensor], s: np.ndarray, d: np.ndarray, pages: int
) -> None:
    s_idx = torch.from_numpy(s)
    d_idx = torch.from_numpy(d)
    untouched = torch.ones(pages, dtype=torch.bool)
    untouched[d_idx] = False
    for a, b in zip(src, dst, strict=True):
        want = a.cpu().view(torch.uint8).view(pages, -1)
        got = b.cpu().view(torch.uint8).view(pages, -1)
        assert torch.equal(got[d_idx], want[s_idx])
        assert not got[untouched].any(), "a page outside the destination list was written"


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("run", RUNS)
def test_copy_across_devices_is_bitwise_exact(
    engine: str, shape: tuple[int, int, int, int], run: int
) -> None:
    if engine == "triton" and not triton_available():
        pytest.skip("Triton is not installed")
    pages, n = 96, 40
    src_dev, dst_dev = _devices()
    src = _pool(shape, pages, src_dev, seed=run + 7)
    rng = np.random.default_rng(run)
    for run_on in {dst_dev, src_dev}:  # a pull (the default) and a push
        dst = _pool(shape, pages, dst_dev, seed=None)
        s, d = _placement(n, pages, run, rng), _placement(n, pages, run, rng)
        handle = copy_pages(
            PoolView.from_buffers(_buffers(src, pages)),
            PoolView.from_buffers(_buffers(dst, pages)),
            s,
            d,
            device=run_on,
            engine=engine,
            max_pages_per_launch=16 if run == 4 else None,
        )
        handle.wait(timeout_s=30)
        assert handle.is_done() and handle.nbytes == n * sum(b.bytes_per_page for b in _buffers(src, pages))
        _check(src, dst, s, d, pages)


def test_reuse_ordered_after_copy_without_host_wait() -> None:
    """I1: work queued after `wait_on` sees the copy finished: zeroing the pages is never undone by it."""
    shape, pages = (48, 16, 8, 128), 512
    src_dev, dst_dev = _devices()
    src = _pool(shape, pages, src_dev, seed=3)
    dst = _pool(shape, pages, dst_dev, seed=None)
    d = np.random.default_rng(0).permutation(pages)
    handle = copy_pages(
        PoolView.from_buffers(_buffers(src, pages)), PoolView.from_buffers(_buffers(dst, pages)), d, d
    )
    stream = torch.cuda.current_stream(dst_dev)
    handle.wait_on(stream)
    with torch.cuda.stream(stream):
        for t in dst:
            t.zero_()
    torch.cuda.synchronize(dst_dev)
    assert handle.is_done()
    assert all(not t.any() for t in dst)


def _exporter(conn: Connection, shape: tuple[int, int, int, int], pages: int, seed: int) -> None:
    torch.cuda.set_device(0)
    pool = _pool(shape, pages, 0, seed)
    torch.cuda.synchronize()
    conn.send(export_pool(_buffers(pool, pages)).to_bytes())
    while conn.recv() == "export":  # a new epoch of the same process re-sends its handles
        conn.send(export_pool(_buffers(pool, pages)).to_bytes())
    del pool


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed")
def test_copy_from_another_process_through_cuda_ipc() -> None:
    shape, pages, n, seed = (8, 16, 2, 64), 128, 50, 11
    dst_dev = _devices()[1]
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_exporter, args=(child, shape, pages, seed), daemon=True)
    proc.start()
    importer = IpcImporter(dst_dev)
    try:
        assert conn.poll(120), "exporter did not start"
        blob = conn.recv()
        expected = _pool(shape, pages, dst_dev, seed)
        rng = np.random.default_rng(5)
        src_view = importer.open("prefill-a", 1, blob)
        assert importer.open("prefill-a", 1, blob) is src_view  # cached per epoch
        for run in RUNS:
            dst = _pool(shape, pages, dst_dev, seed=None)
            s, d = _placement(n, pages, run, rng), _placement(n, pages, run, rng)
            handle = copy_pages(src_view, PoolView.from_buffers(_buffers(dst, pages)), s, d)
            importer.track("prefill-a", handle)
            handle.wait(timeout_s=30)
            _check(expected, dst, s, d, pages)
        conn.send("export")
        blob2 = conn.recv()
        view2 = importer.open("prefill-a", 2, blob2)  # the epoch-1 mapping is retired and unmapped
        assert importer.mapped() == {"prefill-a": 2} and importer.collect() == 0
        with pytest.raises(StaleEpochError):
            importer.open("prefill-a", 1, blob)
        dst = _pool(shape, pages, dst_dev, seed=None)
        s, d = _placement(n, pages, 4, rng), _placement(n, pages, 4, rng)
        copy_pages(view2, PoolView.from_buffers(_buffers(dst, pages)), s, d).wait(timeout_s=30)
        _check(expected, dst, s, d, pages)
    finally:
        importer.close()
        conn.send("stop")
        proc.join(30)
    assert proc.exitcode == 0
