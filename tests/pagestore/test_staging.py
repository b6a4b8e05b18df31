"""The host mirror a GPU pool's store traffic passes through, on host pools: copies both ways, slot leases."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from xavier_core.pagestore.layout import local_page_checksums, page_row_checksums
from xavier_core.pagestore.metrics import StepClock
from xavier_core.pagestore.staging import HostStaging
from xavier_core.transfer.common.buffers import KvBuffer
from xavier_core.transfer.common.errors import InvalidPagesError

pytest.importorskip("torch")


@pytest.mark.parametrize("sizes", [(64, 64, 64), (64, 128, 32)])
def test_pages_go_to_slots_and_back_bitwise(sizes: tuple[int, ...]) -> None:
    rng = np.random.default_rng(3)
    pool = [rng.integers(0, 256, 20 * s, dtype=np.uint8) for s in sizes]
    out = [np.zeros_like(a) for a in pool]
    staging = HostStaging(
        [KvBuffer(a.ctypes.data, a.nbytes, s, "cpu") for a, s in zip(pool, sizes, strict=True)], 6
    )
    back = HostStaging(
        [KvBuffer(a.ctypes.data, a.nbytes, s, "cpu") for a, s in zip(out, sizes, strict=True)], 6
    )
    pages, slots = [7, 2, 19, 3], [5, 0, 2, 1]
    staging.to_host(pages, slots)
    for buf, a, s in zip(staging.buffers, pool, sizes, strict=True):
        mirror = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * buf.nbytes).from_address(buf.addr))
        for p, slot in zip(pages, slots, strict=True):
            assert bytes(mirror[slot * s : (slot + 1) * s]) == bytes(a[p * s : (p + 1) * s])
    # The mirror's bytes, moved into another pool through its own mirror's addresses.
    for src, dst in zip(staging.buffers, back.buffers, strict=True):
        np.ctypeslib.ctypes.memmove(dst.addr, src.addr, src.nbytes)
    back.to_pool(slots, [0, 1, 2, 3])
    for a, b, s in zip(pool, out, sizes, strict=True):
        for p, q in zip(pages, [0, 1, 2, 3], strict=True):
            assert bytes(b[q * s : (q + 1) * s]) == bytes(a[p * s : (p + 1) * s])
        assert not b[4 * s :].any()
    with pytest.raises(InvalidPagesError):
        staging.to_host([1, 2], [0])


async def test_slot_leases_wait_for_each_other() -> None:
    pool = np.zeros(8 * 64, np.uint8)
    staging = HostStaging([KvBuffer(pool.ctypes.data, pool.nbytes, 64, "cpu")], 4)
    first = await staging.acquire(3)
    second = asyncio.ensure_future(staging.acquire(2))
    await asyncio.sleep(0.05)
    assert not second.done()  # 1 slot free, 2 wanted
    await staging.release(first)
    got = await second
    assert len(set(got)) == 2 and set(got) <= {0, 1, 2, 3}
    await staging.release(got)
    assert sorted(staging._free) == [0, 1, 2, 3]
    with pytest.raises(InvalidPagesError):
        await staging.acquire(5)


async def test_retired_slots_are_never_lent_and_waiters_are_refused() -> None:
    pool = np.zeros(8 * 64, np.uint8)
    staging = HostStaging([KvBuffer(pool.ctypes.data, pool.nbytes, 64, "cpu")], 4)
    stuck = await staging.acquire(2)
    waiting = asyncio.ensure_future(staging.acquire(3))
    await asyncio.sleep(0.05)
    await staging.retire(stuck)  # 2 usable slots left: a wait for 3 could never end
    with pytest.raises(InvalidPagesError, match="2 are still usable"):
        await waiting
    assert sorted(await staging.acquire(2)) == [2, 3]
    assert staging.usable == 2


async def test_retired_slots_come_back_once_their_transfer_ends() -> None:
    pool = np.zeros(8 * 64, np.uint8)
    staging = HostStaging([KvBuffer(pool.ctypes.data, pool.nbytes, 64, "cpu")], 4)
    stuck = await staging.acquire(2)
    ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    await staging.retire(stuck, until=ended)
    assert staging.usable == 2 and sorted(await staging.acquire(2)) == [2, 3]
    waiting = asyncio.ensure_future(staging.acquire(2))  # only the retired ones could serve it
    await asyncio.sleep(0.05)
    assert not waiting.done()
    ended.set_result(None)
    assert sorted(await asyncio.wait_for(waiting, 5)) == stuck and staging.usable == 4


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_a_vram_pool_crosses_in_runs_of_slots_bitwise() -> None:
    """A VRAM pool (equal page sizes: one pinned mirror): gathered and scattered on the GPU, each run of
    consecutive slots one DMA; runs, gaps and single slots all land where they should."""
    import torch

    per_page, pages_in_pool = 256, 40
    gen = torch.Generator().manual_seed(5)
    pool = [
        torch.randint(0, 256, (pages_in_pool * per_page,), generator=gen, dtype=torch.uint8).cuda()
        for _ in range(6)
    ]
    out = [torch.zeros_like(t) for t in pool]
    buffers = [KvBuffer(t.data_ptr(), t.numel(), per_page, "cuda:0") for t in pool]
    staging = HostStaging(buffers, 16)
    back = HostStaging([KvBuffer(t.data_ptr(), t.numel(), per_page, "cuda:0") for t in out], 16)
    pages = [7, 2, 19, 3, 30, 31, 0, 12]
    slots = [4, 5, 6, 0, 9, 10, 11, 15]  # runs 4-6, 0, 9-11, 15
    staging.to_host(pages, slots)
    for buf, t in zip(staging.buffers, pool, strict=True):
        mirror = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * buf.nbytes).from_address(buf.addr))
        host = t.cpu().numpy()
        for p, slot in zip(pages, slots, strict=True):
            assert bytes(mirror[slot * per_page : (slot + 1) * per_page]) == bytes(
                host[p * per_page : (p + 1) * per_page]
            )
    for src, dst in zip(staging.buffers, back.buffers, strict=True):
        np.ctypeslib.ctypes.memmove(dst.addr, src.addr, src.nbytes)
    targets = [1, 2, 3, 10, 11, 12, 20, 39]
    back.to_pool(slots, targets)
    for a, b in zip(pool, out, strict=True):
        ha, hb = a.cpu().numpy(), b.cpu().numpy()
        for p, q in zip(pages, targets, strict=True):
            assert bytes(hb[q * per_page : (q + 1) * per_page]) == bytes(
                ha[p * per_page : (p + 1) * per_page]
            )
        untouched = sorted(set(range(pages_in_pool)) - set(targets))
        assert not any(hb[q * per_page : (q + 1) * per_page].any() for q in untouched)


_DEVICES = ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("sizes", [(256,) * 6, (64, 128, 32)], ids=["mirror", "per-buffer"])
@pytest.mark.parametrize(
    "slots", [[4, 5, 6, 7, 8, 9, 10], [12, 3, 11, 13, 15, 0, 1]], ids=["run", "scattered"]
)
def test_a_checked_scatter_moves_only_the_verified_head(
    device: str, sizes: tuple[int, ...], slots: list[int]
) -> None:
    import torch

    if device != "cpu" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(9)
    src = [torch.randint(0, 256, (40, s), generator=gen, dtype=torch.uint8).to(device) for s in sizes]
    dst = [torch.zeros((40, s), dtype=torch.uint8, device=device) for s in sizes]

    def kv(ts: list[torch.Tensor]) -> list[KvBuffer]:
        return [KvBuffer(t.data_ptr(), t.numel(), t.shape[1], str(t.device)) for t in ts]

    staging, back = HostStaging(kv(src), 16), HostStaging(kv(dst), 16)
    pages, dest = [7, 2, 19, 3, 33, 0, 38], [1, 9, 10, 11, 25, 26, 27]
    staging.to_host(pages, slots)
    for a, b in zip(staging.buffers, back.buffers, strict=True):
        np.ctypeslib.ctypes.memmove(b.addr, a.addr, a.nbytes)
    want = local_page_checksums(staging.buffers, slots)
    assert back.to_pool_checked(slots, dest, [*want[:4], bytes(16), *want[5:]]) == [4]
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[dest[:4]].cpu(), s[pages[:4]].cpu())
        assert not d[dest[4:]].any()  # the failed page and the rest never reach the pool
    assert back.to_pool_checked(slots, dest, want) == []
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[dest].cpu(), s[pages].cpu())
    with pytest.raises(InvalidPagesError):
        back.to_pool_checked(slots, dest, want[:3])


def _landed_rows(device: str, slots: list[int], seed: int) -> tuple[list[Any], HostStaging, Any]:
    """A pool of four 256-byte buffers on `device` (zeros) behind staging of 16 slots, and random pages
    landed page-major in the staging rows at `slots` (as a same-host read lands them): the pool's
    buffers, the staging and the pages, a (len(slots), page bytes) tensor."""
    import torch

    if device != "cpu" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    sizes = (256,) * 4  # the one-tensor mirror: the layout whose same-host reads land page-major
    dst = [torch.zeros((32, s), dtype=torch.uint8, device=device) for s in sizes]
    staging = HostStaging([KvBuffer(t.data_ptr(), t.numel(), t.shape[1], str(t.device)) for t in dst], 16)
    assert staging.rows_base is not None
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randint(0, 256, (len(slots), sum(sizes)), generator=gen, dtype=torch.uint8)
    rows = np.ctypeslib.as_array(
        (np.ctypeslib.ctypes.c_uint8 * (16 * sum(sizes))).from_address(staging.rows_base)
    ).reshape(16, sum(sizes))
    for i, s in enumerate(slots):
        rows[s] = pages[i].numpy()
    return dst, staging, pages


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("slots", [[3, 4, 5, 6, 7, 8], [9, 2, 11, 0, 14, 5]], ids=["run", "scattered"])
def test_rows_checked_while_they_move_reach_the_pool_only_as_the_verified_head(
    device: str, slots: list[int]
) -> None:
    """Pages that landed page-major in the staging rows go to the call's device buffer while they are
    hashed (two pieces, as `read_in_pieces` checks them); only the head before the first bad page is
    scattered into the pool, and the rows' bytes are the pool's pages, buffer by buffer."""
    import torch

    dst, staging, pages = _landed_rows(device, slots, 3)
    want = page_row_checksums(pages.numpy())
    want[4] = bytes(16)
    moved = staging.moved_rows(len(slots))
    clock = StepClock()
    bad = staging.check_rows(slots[:3], want[:3], moved, 0, clock)
    bad += [3 + i for i in staging.check_rows(slots[3:], want[3:], moved, 3, clock)]
    assert bad == [4]
    assert torch.equal(moved.cpu(), pages)  # every row crossed as it was, the bad one too
    targets = [20, 1, 30, 7, 8, 9]
    staging.rows_to_pool(moved, targets[: bad[0]], clock)
    for b, pool in enumerate(dst):
        got = pool.cpu()
        assert torch.equal(got[targets[:4]], pages[:4, b * 256 : (b + 1) * 256])
        assert not got[targets[4:]].any()  # the failed page and the one after it never reach the pool
    assert clock.seconds["verify"] > 0 and clock.seconds["stage_copy"] > 0


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("slots", [[3, 4, 5, 6, 7, 8], [9, 2, 11, 0, 14, 5]], ids=["run", "scattered"])
def test_rows_queued_part_by_part_reach_the_pool_exactly(device: str, slots: list[int]) -> None:
    """Rows checked as they landed (a read in parts) are queued to the call's device buffer a part at a
    time without waiting (on a GPU each queueing gives what to wait for, and the wait ends the copies);
    one scatter of the verified head then puts each row into its pool page, buffer by buffer."""
    import torch

    dst, staging, pages = _landed_rows(device, slots, 4)
    moved = staging.moved_rows(len(slots))
    clock = StepClock()
    queued = [staging.queue_rows(slots[lo : lo + 2], moved, lo, clock) for lo in (0, 2)]
    assert staging.queue_rows([], moved, 4, clock) is None  # nothing to copy: nothing to wait for
    assert [q is not None for q in queued] == [device != "cpu"] * 2
    staging.wait_queued(queued[-1], clock)
    assert all(q is None or q.query() for q in queued)
    assert torch.equal(moved[:4].cpu(), pages[:4])
    queued.append(staging.queue_rows(slots[4:], moved, 4, clock))
    targets = [20, 1, 30, 7, 8, 9]
    staging.rows_to_pool(moved, targets[:5], clock)  # the head of five: the last part's first row only
    assert all(q is None or q.query() for q in queued)  # the scatter's wait ended the copy before it
    for b, pool in enumerate(dst):
        got = pool.cpu()
        assert torch.equal(got[targets[:5]], pages[:5, b * 256 : (b + 1) * 256])
        assert not got[targets[5]].any()
    assert clock.seconds["stage_copy"] > 0 and "verify" not in clock.seconds
