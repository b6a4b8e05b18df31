"""READs and WRITEs through prepared descriptor lists: bytes, descriptor counts, checks on a prepared
side, a peer's next epoch, and pools too large to prepare (two real NIXL agents in this process)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest

from xavier_core.transfer import InvalidPagesError, KvBuffer, NixlAgent
from xavier_core.transfer.nixl import prepped
from xavier_core.transfer.nixl.xfer import Transfer

BUFFERS, PAGES, BPP = 6, 32, 256


def _pool(seed: int | None) -> tuple[list[np.ndarray], list[KvBuffer]]:
    rng = np.random.default_rng(seed)
    arrays = [
        rng.integers(0, 256, PAGES * BPP, dtype=np.uint8)
        if seed is not None
        else np.zeros(PAGES * BPP, np.uint8)
        for _ in range(BUFFERS)
    ]
    return arrays, [KvBuffer(a.ctypes.data, a.nbytes, BPP, "cpu") for a in arrays]


@pytest.fixture
def pair() -> Iterator[tuple[NixlAgent, NixlAgent, list[np.ndarray], list[np.ndarray], list[KvBuffer]]]:
    src_arrays, src_bufs = _pool(7)
    dst_arrays, dst_bufs = _pool(None)
    src = NixlAgent(f"prep-src-{os.getpid()}", src_bufs)
    dst = NixlAgent(f"prep-dst-{os.getpid()}", dst_bufs)
    dst.add_peer("src@1", src.metadata())
    try:
        yield src, dst, src_arrays, dst_arrays, src_bufs
    finally:
        dst.close()
        src.close()


def _finish(xfer: Transfer, src: NixlAgent) -> None:
    for _ in range(100_000):
        if xfer.poll() != "PROC":
            break
        src.notifications()  # the side being read drives progress too
    assert xfer.state == "DONE", xfer.error


def _pages(arrays: list[np.ndarray], pages: list[int]) -> list[bytes]:
    return [a.reshape(PAGES, BPP)[pages].tobytes() for a in arrays]


SRC = [3, 4, 5, 9, 20, 21, 0]
DST = [10, 11, 12, 13, 2, 3, 31]  # stretches on both sides: (3-5 -> 10-12), 9, (20-21 -> 2-3), 0


def test_prepared_read_moves_the_pages_and_counts_merged_stretches(pair) -> None:  # type: ignore[no-untyped-def]
    src, dst, src_arrays, dst_arrays, src_bufs = pair
    xfer = dst.read("src@1", src_bufs, SRC, DST, b"done")
    _finish(xfer, src)
    assert _pages(dst_arrays, DST) == _pages(src_arrays, SRC)
    assert xfer.descriptor_count == 4 * BUFFERS
    assert xfer.nbytes == len(SRC) * BPP * BUFFERS
    assert dst.live_transfers() == 0


def test_prepared_side_still_refuses_bad_pages(pair) -> None:  # type: ignore[no-untyped-def]
    src, dst, _, _, src_bufs = pair
    _finish(dst.read("src@1", src_bufs, [0], [0]), src)  # prepares both sides
    with pytest.raises(InvalidPagesError, match="repeat"):
        dst.read("src@1", src_bufs, [1, 2], [5, 5])
    with pytest.raises(InvalidPagesError, match="outside the pool"):
        dst.read("src@1", src_bufs, [PAGES], [0])
    with pytest.raises(InvalidPagesError, match="outside the pool"):
        dst.read("src@1", src_bufs, [0], [PAGES])
    with pytest.raises(InvalidPagesError, match="page count mismatch"):
        dst.read("src@1", src_bufs, [0, 1], [0])
    assert dst.live_transfers() == 0


def test_write_through_prepared_lists(pair) -> None:  # type: ignore[no-untyped-def]
    src, dst, src_arrays, dst_arrays, src_bufs = pair
    for i, a in enumerate(dst_arrays):
        a[:] = (np.arange(a.size) * (i + 3)).astype(np.uint8)
    xfer = dst.write("src@1", src_bufs, [6, 7], [30, 31], b"")
    _finish(xfer, src)
    assert _pages(src_arrays, [30, 31]) == _pages(dst_arrays, [6, 7])
    assert xfer.descriptor_count == BUFFERS


def test_next_epoch_of_a_peer_reads_after_the_old_lists_are_released(pair) -> None:  # type: ignore[no-untyped-def]
    src, dst, src_arrays, dst_arrays, src_bufs = pair
    _finish(dst.read("src@1", src_bufs, [1], [1]), src)
    dst.add_peer("src@2", src.metadata())  # drops epoch 1 and its prepared list
    assert dst.peer_keys() == ["src@2"]
    _finish(dst.read("src@2", src_bufs, [8, 9], [16, 17]), src)
    assert _pages(dst_arrays, [1, 16, 17]) == _pages(src_arrays, [1, 8, 9])


def test_pool_too_large_to_prepare_reads_per_transfer(pair, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    src, dst, src_arrays, dst_arrays, src_bufs = pair
    monkeypatch.setattr(prepped, "MAX_PREPPED_DESCRIPTORS", BUFFERS * PAGES - 1)
    xfer = dst.read("src@1", src_bufs, SRC, DST, b"done")
    _finish(xfer, src)
    assert _pages(dst_arrays, DST) == _pages(src_arrays, SRC)
    assert xfer.descriptor_count == 4 * BUFFERS


def test_per_page_mode_keeps_one_descriptor_per_page(pair) -> None:  # type: ignore[no-untyped-def]
    src, dst, src_arrays, dst_arrays, src_bufs = pair
    xfer = dst.read("src@1", src_bufs, SRC, DST, b"", mode="per_page")
    _finish(xfer, src)
    assert _pages(dst_arrays, DST) == _pages(src_arrays, SRC)
    assert xfer.descriptor_count == len(SRC) * BUFFERS
