"""Arguments of the fused page-copy kernel, checked on the CPU: a numpy model of the kernel runs each plan
over a byte array standing in for device memory, so the index math is covered without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from xavier_core.transfer.common.buffers import KvBuffer
from xavier_core.transfer.common.errors import InvalidPagesError, InvalidSourceError, LayoutError
from xavier_core.transfer.cuda.copy import copy_pages
from xavier_core.transfer.cuda.copy_plan import CopyPlan, PoolView, plan_copy
from xavier_core.transfer.cuda.ipc import PoolExport, host_id

ANCHOR = 1 << 20  # where the fake memory starts; the kernel's anchor tensor sits here


def _layout(bpps: list[int], pages: int, gap: int, start: int) -> PoolView:
    bases, addr = [], start
    for bpp in bpps:
        bases.append(addr)
        addr += bpp * pages + gap
    return PoolView(tuple(bases), tuple(bpps), pages, 0)


def _run(plan: CopyPlan, mem: np.ndarray) -> None:
    """What the kernel does, program by program, with `mem[0]` at address ANCHOR."""
    words = mem.view({8: np.int64, 4: np.int32, 2: np.int16, 1: np.uint8}[plan.elem_bytes])
    n = plan.src_pages.size
    for pid in range(plan.grid):
        chunk, pair, buf = pid % plan.chunks, (pid // plan.chunks) % n, pid // plan.chunks // n
        start = chunk * plan.block
        s = plan.src_off[buf] + plan.src_pages[pair] * plan.page_elems + start
        d = plan.dst_off[buf] + plan.dst_pages[pair] * plan.page_elems + start
        assert s % plan.align == 0 and d % plan.align == 0
        width = min(plan.block, plan.page_elems - start)
        words[d : d + width] = words[s : s + width]


@pytest.mark.parametrize(
    ("bpps", "gap", "elem", "align", "block", "chunks"),
    [
        ([4096] * 6, 256, 8, 2, 512, 1),  # 0.5B-like pages: 16-byte vectors of int64
        ([32768] * 4, 512, 8, 2, 2048, 2),  # 7B-like pages: two programs each
        ([30] * 3, 2, 2, 1, 16, 1),  # odd pages: 2-byte elements, masked tail
        ([24] * 2, 8, 8, 1, 4, 1),  # 8-byte aligned only
    ],
)
def test_plan_matches_a_reference_copy(
    bpps: list[int], gap: int, elem: int, align: int, block: int, chunks: int
) -> None:
    pages, n = 20, 9
    src = _layout(bpps, pages, gap, ANCHOR + 64)
    dst = _layout(bpps, pages, gap, src.bases[-1] + bpps[-1] * pages + gap)
    total = dst.bases[-1] + bpps[-1] * pages - ANCHOR
    mem = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    want = mem.copy()
    rng = np.random.default_rng(1)
    s, d = rng.choice(pages, n, replace=False), rng.choice(pages, n, replace=False)
    for sb, db, bpp in zip(src.bases, dst.bases, bpps, strict=True):
        for i, j in zip(s, d, strict=True):
            lo_s, lo_d = sb - ANCHOR + i * bpp, db - ANCHOR + j * bpp
            want[lo_d : lo_d + bpp] = mem[lo_s : lo_s + bpp]
    (plan,) = plan_copy(src, dst, s, d, ANCHOR)
    assert (plan.elem_bytes, plan.align, plan.block, plan.chunks) == (elem, align, block, chunks)
    assert plan.grid == n * len(bpps) * chunks and plan.nbytes == n * sum(bpps)
    _run(plan, mem)
    assert np.array_equal(mem, want)


def test_mixed_page_sizes_and_split_launches() -> None:
    src = _layout([4096, 4096, 2048], 50, 0, ANCHOR)
    dst = _layout([4096, 4096, 2048], 50, 0, ANCHOR + (1 << 24))
    plans = plan_copy(src, dst, list(range(10)), list(range(10, 20)), ANCHOR)
    assert [p.page_elems * p.elem_bytes for p in plans] == [2048, 4096]
    assert [p.src_off.size for p in plans] == [1, 2]
    parts = plans[1].split(4)
    assert [p.src_pages.size for p in parts] == [4, 4, 2]
    assert np.array_equal(np.concatenate([p.dst_pages for p in parts]), np.arange(10, 20))
    assert plan_copy(src, dst, [], [], ANCHOR) == []


def test_bad_arguments_raise_typed_errors() -> None:
    src = _layout([4096] * 2, 8, 0, ANCHOR)
    dst = _layout([4096] * 2, 8, 0, ANCHOR + (1 << 20))
    with pytest.raises(InvalidPagesError, match="count mismatch"):
        plan_copy(src, dst, [1, 2], [1], ANCHOR)
    with pytest.raises(InvalidPagesError, match="outside the pool"):
        plan_copy(src, dst, [8], [1], ANCHOR)
    with pytest.raises(InvalidPagesError, match="twice"):
        plan_copy(src, dst, [1, 2], [3, 3], ANCHOR)
    with pytest.raises(InvalidPagesError, match="non-negative"):
        plan_copy(src, dst, [-1], [3], ANCHOR)
    with pytest.raises(LayoutError, match="buffer count"):
        plan_copy(src, _layout([4096], 8, 0, ANCHOR), [1], [1], ANCHOR)
    with pytest.raises(LayoutError, match="bytes per page"):
        plan_copy(src, _layout([4096, 2048], 8, 0, ANCHOR), [1], [1], ANCHOR)
    with pytest.raises(LayoutError, match="anchor"):
        plan_copy(src, dst, [1], [1], ANCHOR + 8)
    with pytest.raises(LayoutError, match="one page size per buffer"):
        PoolView((ANCHOR,), (), 8, 0)


def test_pool_view_from_buffers() -> None:
    bufs = [KvBuffer(ANCHOR, 4096 * 10, 4096, "cuda:1"), KvBuffer(ANCHOR * 2, 4096 * 9, 4096, "cuda:1")]
    view = PoolView.from_buffers(bufs)
    assert view.num_pages == 9 and view.device == 1 and view.bases == (ANCHOR, ANCHOR * 2)
    with pytest.raises(LayoutError, match="cuda:N"):
        PoolView.from_buffers([KvBuffer(ANCHOR, 4096, 4096, "cpu")])
    with pytest.raises(LayoutError, match="span devices"):
        PoolView.from_buffers([*bufs, KvBuffer(ANCHOR, 4096, 4096, "cuda:0")])


def test_pool_export_round_trip_and_malformed_input() -> None:
    export = PoolExport(
        host_id(), 42, "GPU-x", (bytes(range(64)),), ((0, 0, 8192, 4096), (0, 8192, 8192, 4096))
    )
    assert PoolExport.from_bytes(export.to_bytes()) == export
    for blob in (
        b"not json",
        b'{"format": 1}',
        export.to_bytes().replace(b'"format": 1', b'"format": 9'),
        export.to_bytes().replace(b"[0, 8192, 8192, 4096]", b"[3, 8192, 8192, 4096]"),
        export.to_bytes().replace(bytes(range(64)).hex().encode(), b"00"),
        b" " * (2 << 20),
    ):
        with pytest.raises(InvalidSourceError):
            PoolExport.from_bytes(blob)


def test_imported_pools_are_copied_only_by_the_kernel_on_their_device() -> None:
    local = _layout([4096] * 2, 8, 0, ANCHOR)
    imported = PoolView((ANCHOR * 4, ANCHOR * 5), (4096, 4096), 8, 1, imported=True)
    with pytest.raises(LayoutError, match="needs the Triton copy"):
        copy_pages(imported, local, [1], [1], engine="torch")
    with pytest.raises(LayoutError, match="mapped on cuda:1, not cuda:0"):
        copy_pages(imported, local, [1], [1], engine="triton")
