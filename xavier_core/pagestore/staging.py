"""Host staging for a device KV pool: the page store client's view of pages that live on a GPU.

The store is DRAM and the client checksums every page it reads or writes on the host, so a replica whose
pool is on a GPU moves pages through a pinned host mirror of the pool's page geometry: `slots` pages of
every buffer, registered with NIXL instead of the device pool. A read lands in staging slots, crosses to
the device as it is, comes back page-major into a second pinned buffer to be verified there (one hash
call per page), and only verified pages are scattered to their device pages. A read out of a same-host store's
memory places each segment itself, so it lands page-major in that second buffer straight away: hashed as
it lands by the page loop, then crosses to the device once (`checked_rows_to_pool`; a long read in parts,
each part's verified rows queued to the device while the next part is read: `queue_rows`, `rows_to_pool`);
read first, it is hashed there while it crosses (`check_rows`, `rows_to_pool`). A write copies device pages
to slots, checksums them there and WRITEs from there. Slots are leased per operation, as a run of
consecutive slots where one is free, so concurrent reads and write-throughs share the mirror without
waiting on each other until it is full.

Device copies run on the device's default stream, the one the engine computes on: a write-through's
gather is ordered after the prefill that filled its pages, and the engine's next use of fetched pages is
ordered after their scatter. Each copy waits for its own completion before it returns (the caller runs it
off the event loop), so a slot goes back only once nothing reads or writes it; the one exception,
`queue_rows`, hands its caller what to wait for (`wait_queued`, or the `rows_to_pool` queued behind it).
torch is imported lazily: a replica with a host pool never builds a mirror.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from xavier_core.pagestore.layout import failed_pages, local_page_checksums, page_row_checksums
from xavier_core.pagestore.metrics import StepClock
from xavier_core.runtime.tasks import Background
from xavier_core.transfer.common.buffers import KvBuffer
from xavier_core.transfer.common.errors import InvalidPagesError
from xavier_core.transfer.common.stuck import on_success
from xavier_core.transfer.cuda.copy import CudaBytes

if TYPE_CHECKING:
    import torch

__all__ = ["HostStaging"]


class HostStaging:
    """A pinned host mirror of `slots` pages of every buffer of `pool` (see the module docstring)."""

    def __init__(
        self, pool: Sequence[KvBuffer], slots: int, device_lock: threading.Lock | None = None
    ) -> None:
        import torch

        if slots < 1:
            raise InvalidPagesError("host staging needs at least one slot")
        devices = {b.device for b in pool}
        if len(devices) != 1:
            raise InvalidPagesError(f"KV buffers span devices {sorted(devices)}; staging needs one")
        self.device = devices.pop()
        if self.device != "cpu" and not torch.cuda.is_available():
            raise InvalidPagesError(f"KV buffers on {self.device!r} but this process has no CUDA")
        self.slots = slots
        self._lock = device_lock
        pinned = self.device != "cpu"
        # Equal page sizes (every KV pool): one (buffers, slots, bytes) mirror, so a call's pages cross
        # the bus in one copy whatever the number of buffers.
        self._mirror: torch.Tensor | None = None
        if len({b.bytes_per_page for b in pool}) == 1:
            shape = (len(pool), slots, pool[0].bytes_per_page)
            self._mirror = torch.empty(shape, dtype=torch.uint8, pin_memory=pinned)
            self._host = list(self._mirror.unbind(0))
        else:
            self._host = [
                torch.empty((slots, b.bytes_per_page), dtype=torch.uint8, pin_memory=pinned) for b in pool
            ]
        self._pool: list[torch.Tensor] = [_view(b) for b in pool]
        self.buffers: tuple[KvBuffer, ...] = tuple(
            KvBuffer(t.data_ptr(), t.numel(), b.bytes_per_page, "cpu")
            for t, b in zip(self._host, pool, strict=True)
        )
        self._free = list(range(slots))  # sorted: leases take the lowest run that fits (`_lowest_run`)
        self.usable = slots
        """Slots not retired: the most one call may take."""
        self._freed: asyncio.Condition | None = None
        self._restoring = Background("staging-restore")  # `_restore` calls under way
        # Page-major rows for checking reads (`to_pool_checked`): a second buffer the mirror's size.
        self._rows: torch.Tensor | None = None
        if self._mirror is not None:
            self._rows = torch.empty(
                (slots, len(pool) * pool[0].bytes_per_page), dtype=torch.uint8, pin_memory=pinned
            )

    # --- slot leases (event loop) ------------------------------------------------------------------------

    async def acquire(self, n: int) -> list[int]:
        """`n` (≤ slots) free slots, waiting for others' operations to give theirs back."""
        if not 0 < n <= self.slots:
            raise InvalidPagesError(f"asked for {n} staging slots of {self.slots}")
        if self._freed is None:
            self._freed = asyncio.Condition()
        async with self._freed:
            # Slots retired meanwhile can leave fewer usable than asked: refuse then, never wait forever.
            await self._freed.wait_for(lambda: len(self._free) >= n or n > self.usable)
            if n > self.usable:
                raise InvalidPagesError(f"asked for {n} staging slots; {self.usable} are still usable")
            taken = _lowest_run(self._free, n)
            gone = set(taken)
            self._free = [s for s in self._free if s not in gone]
        return taken

    async def retire(self, slots: Sequence[int], until: asyncio.Future[None] | None = None) -> None:
        """Takes leased `slots` out of use (a transfer that may still touch them could not be cancelled)
        until `until` completes (it has ended), for good without it; waiters that now ask for more than
        is usable are refused."""
        if self._freed is None:
            self._freed = asyncio.Condition()
        async with self._freed:
            self.usable -= len(slots)
            self._freed.notify_all()
        if until is None:
            return
        back = list(slots)
        on_success(until, lambda: self._restoring.start(self._restore(back)))

    async def _restore(self, slots: list[int]) -> None:
        """Retired `slots` back in use (the transfer that could touch them has ended)."""
        assert self._freed is not None
        async with self._freed:
            self.usable += len(slots)
            self._free = list(heapq.merge(self._free, sorted(slots)))
            self._freed.notify_all()

    async def release(self, slots: Sequence[int]) -> None:
        if self._freed is None:
            self._freed = asyncio.Condition()
        async with self._freed:
            self._free = list(heapq.merge(self._free, sorted(slots)))
            self._freed.notify_all()

    # --- copies (a worker thread) ------------------------------------------------------------------------

    def to_host(self, pages: Sequence[int], slots: Sequence[int]) -> None:
        """Copies pool pages into staging slots (page i into slot i) and waits for the copy."""
        self._copy(pages, slots, into_host=True)

    def to_pool(self, slots: Sequence[int], pages: Sequence[int]) -> None:
        """Copies staging slots into pool pages (slot i into page i) and waits for the copy."""
        self._copy(pages, slots, into_host=False)

    def _copy(self, pages: Sequence[int], slots: Sequence[int], *, into_host: bool) -> None:
        import torch

        if len(pages) != len(slots):
            raise InvalidPagesError(f"{len(pages)} pool pages but {len(slots)} staging slots")
        if not pages:
            return
        dev = torch.device(self.device)
        p_idx = torch.tensor(list(pages), dtype=torch.long, device=dev)
        s_idx = torch.tensor(list(slots), dtype=torch.long)
        with self._on_device() as cuda:
            if self._mirror is not None and cuda and into_host:
                self._copy_runs(p_idx, slots)
            elif self._mirror is not None and into_host:
                gathered = torch.stack([pool.index_select(0, p_idx) for pool in self._pool])
                self._mirror.index_copy_(1, s_idx, gathered.to("cpu"))
            elif self._mirror is not None:
                self._scatter(self._to_device(slots, dev), p_idx)
            else:
                for host, pool in zip(self._host, self._pool, strict=True):
                    if into_host:
                        host.index_copy_(0, s_idx, pool.index_select(0, p_idx).to("cpu"))
                    else:
                        pool.index_copy_(0, p_idx, host.index_select(0, s_idx).to(dev))

    def to_pool_checked(
        self,
        slots: Sequence[int],
        pages: Sequence[int],
        want: Sequence[bytes],
        clock: StepClock | None = None,
    ) -> list[int]:
        """Checks the pages in staging `slots` against the checksums `want` and copies the verified head
        (the pages before the first that fails) into pool `pages`; returns the indices that failed.

        With the one-tensor mirror the slots are first copied to the pool's device as they are (the copy
        `to_pool` makes), and that copy is sent back page-major into a pinned host buffer: each page is
        then one contiguous range, hashed in one call (long pages on threads), where in the mirror it is
        one range per buffer, each its own hash update under the GIL. Only the verified head is
        scattered from the device copy into the pool, so unverified bytes never reach it. `clock`, when
        given, gets the checksum pass as `verify` and the copies as `stage_copy`."""
        import torch

        if len(pages) != len(slots) or len(want) != len(slots):
            raise InvalidPagesError(f"{len(slots)} staging slots, {len(pages)} pool pages, {len(want)} sums")
        clock = clock or StepClock()
        if self._mirror is None or self._rows is None or not slots:
            with clock.step("verify"):
                corrupt = failed_pages(local_page_checksums(self.buffers, slots), want)
            good = corrupt[0] if corrupt else len(slots)
            with clock.step("stage_copy"):
                self.to_pool(slots[:good], pages[:good])
            return corrupt
        dev = torch.device(self.device)
        rows = self._page_rows(slots)
        with clock.step("stage_copy"), self._on_device() as cuda:
            moved = self._to_device(slots, dev)
            rows.copy_(moved.permute(1, 0, 2).reshape(len(slots), -1), non_blocking=cuda)
        # Hashed without the device lock: the engine computes meanwhile; `moved` is this call's own.
        with clock.step("verify"):
            corrupt = failed_pages(page_row_checksums(rows.numpy()), want)
        good = corrupt[0] if corrupt else len(slots)
        if good:
            p_idx = torch.tensor(list(pages[:good]), dtype=torch.long, device=dev)
            with clock.step("stage_copy"), self._on_device():
                self._scatter(moved[:, :good], p_idx)
        return corrupt

    # --- reads that land page-major (a same-host store's memory, read by this process) ------------------

    @property
    def rows_base(self) -> int | None:
        """Address of the page-major row buffer (slot s's page at `rows_base + s * page_bytes`, its
        segments one after another in buffer order: what `page_row_checksums` hashes), where a read that
        can place each segment where it likes lands; None without the one-tensor mirror."""
        return None if self._rows is None else int(self._rows.data_ptr())

    def moved_rows(self, n: int) -> torch.Tensor:
        """A (n, page bytes) buffer on the pool's device for one call's checked rows (`check_rows`),
        allocated under the device lock (an allocation may reach the driver, which a graph capture of
        another thread must not see)."""
        import torch

        assert self._rows is not None
        with self._lock or contextlib.nullcontext():
            return torch.empty((n, self._rows.shape[1]), dtype=torch.uint8, device=torch.device(self.device))

    def check_rows(
        self,
        slots: Sequence[int],
        want: Sequence[bytes],
        moved: torch.Tensor,
        at: int,
        clock: StepClock,
    ) -> list[int]:
        """Checks the pages that landed page-major in the rows at `slots` against `want` and copies the
        rows, as they are, to `moved[at : at + len(slots)]` (the call's own device buffer, which the pool
        never sees before `rows_to_pool`); returns the indices that failed. One hash call per page and one
        DMA per run of slots: no trip to the device and back to make the pages page-major, as the
        mirror's `to_pool_checked` takes.

        On a GPU the DMAs are queued first and the pages hashed while they move: both only read the
        pinned rows, and the copy lands in the call's own buffer, so the check costs the fetch only what
        it takes beyond the copy. The copy is waited for (under the device lock, as every wait here)
        before this returns or raises: the rows' slots go back to the mirror only once nothing reads
        them."""
        if len(want) != len(slots):
            raise InvalidPagesError(f"{len(slots)} staging slots but {len(want)} sums")
        if not slots:
            return []
        moving = self.queue_rows(slots, moved, at, clock)
        try:
            with clock.step("verify"):
                return failed_pages(page_row_checksums(self._page_rows(slots, copy=True).numpy()), want)
        finally:
            self.wait_queued(moving, clock)

    def queue_rows(
        self, slots: Sequence[int], moved: torch.Tensor, at: int, clock: StepClock
    ) -> torch.cuda.Event | None:
        """Queues the copy of the rows at `slots` to `moved[at : at + len(slots)]` (the call's own device
        buffer: `moved_rows`), one DMA per run of slots, on the device's default stream under the device
        lock, and returns without waiting for it: on a GPU an event recorded after it, for `wait_queued`
        (a later `rows_to_pool`, behind it on the same stream, waits for it too); None where the copy has
        ended already (a host pool) or there was nothing to copy. The rows' slots must not go back to the
        mirror before the copy has ended: it reads them."""
        import torch

        if not slots:
            return None
        dev = torch.device(self.device)
        stream = torch.cuda.default_stream(dev) if dev.type == "cuda" else None
        with clock.step("stage_copy"), self._lock or contextlib.nullcontext(), torch.cuda.stream(stream):
            self._rows_to(moved, at, slots, non_blocking=stream is not None)
            if stream is None:
                return None
            queued = torch.cuda.Event()  # type: ignore[no-untyped-call]
            queued.record(stream)
        return queued

    def wait_queued(self, queued: torch.cuda.Event | None, clock: StepClock) -> None:
        """Waits, under the device lock as every wait here, for the copies `queue_rows` queued up to the
        one that gave `queued` (None: nothing to wait for)."""
        if queued is None:
            return
        with clock.step("stage_copy"), self._lock or contextlib.nullcontext():
            queued.synchronize()

    def rows_to_pool(self, moved: torch.Tensor, pages: Sequence[int], clock: StepClock) -> None:
        """Scatters the first `len(pages)` checked rows of `moved` into pool `pages` (row i into page i),
        each buffer's segment of every row in one copy, and waits for it (and so for every copy queued
        into `moved` before it: `queue_rows`, on the same stream)."""
        if not pages:
            return
        p_idx = self._page_index(pages)
        with clock.step("stage_copy"), self._on_device():
            self._scatter_rows(moved, p_idx)

    def checked_rows_to_pool(self, slots: Sequence[int], pages: Sequence[int], clock: StepClock) -> None:
        """Moves the rows at the first `len(pages)` of `slots`, checked already as they landed there (a
        read that hashed each page in passing: `DirectArena.read_checked`), into pool `pages` (row of
        `slots[i]` into page i): one DMA per run of slots into a buffer of this call on the device, then
        each buffer's segment of every row in one copy; waits for both, so the slots may go back."""
        if not pages:
            return
        moved = self.moved_rows(len(pages))
        p_idx = self._page_index(pages)
        with clock.step("stage_copy"), self._on_device() as gpu:
            self._rows_to(moved, 0, slots[: len(pages)], non_blocking=gpu)
            self._scatter_rows(moved, p_idx)

    def _rows_to(self, moved: torch.Tensor, at: int, slots: Sequence[int], *, non_blocking: bool) -> None:
        """The rows at `slots` into `moved[at : at + len(slots)]`, one copy (a DMA from the pinned rows, on a
        GPU) per run of consecutive slots, on the current stream; the caller holds the device lock."""
        assert self._rows is not None
        for first, start, length in _slot_runs(slots):
            moved[at + first : at + first + length].copy_(
                self._rows[start : start + length], non_blocking=non_blocking
            )

    def _page_index(self, pages: Sequence[int]) -> torch.Tensor:
        import torch

        return torch.tensor(list(pages), dtype=torch.long, device=torch.device(self.device))

    def _scatter_rows(self, moved: torch.Tensor, p_idx: torch.Tensor) -> None:
        """Row i of `moved` (page-major) into pool page `p_idx[i]`, each buffer's segment in one copy."""
        width = self._pool[0].shape[1]
        for b, pool in enumerate(self._pool):
            pool.index_copy_(0, p_idx, moved[: p_idx.shape[0], b * width : (b + 1) * width])

    @contextlib.contextmanager
    def _on_device(self) -> Iterator[bool]:
        """Device work queued inside runs on the device's default stream (the engine's: see the module
        docstring) under the device lock, and has finished when the block ends; yields whether the device
        is a GPU (a copy may then be queued asynchronously)."""
        import torch

        dev = torch.device(self.device)
        stream = torch.cuda.default_stream(dev) if dev.type == "cuda" else None
        with self._lock or contextlib.nullcontext(), torch.cuda.stream(stream):
            yield stream is not None
            if stream is not None:
                stream.synchronize()

    def _page_rows(self, slots: Sequence[int], copy: bool = False) -> torch.Tensor:
        """A (len(slots), page bytes) pinned host buffer for a page-major copy of `slots`: the rows of
        the mirror-sized page buffer at those slots when they are one run (leased to this call alone, so
        calls at once never share rows), else a buffer of its own (with `copy`, holding their rows)."""
        import torch

        assert self._rows is not None
        first = slots[0]
        if list(slots) == list(range(first, first + len(slots))):
            return self._rows[first : first + len(slots)]
        if copy:
            return self._rows.index_select(0, torch.tensor(list(slots), dtype=torch.long))
        return torch.empty(
            (len(slots), self._rows.shape[1]), dtype=torch.uint8, pin_memory=self.device != "cpu"
        )

    def _to_device(self, slots: Sequence[int], dev: torch.device) -> torch.Tensor:
        """The mirror's `slots` as a (buffers, n, bytes) tensor on `dev`. On a GPU each run of
        consecutive slots of each buffer crosses the bus as one asynchronous DMA from the pinned mirror
        (no pageable bounce, no host-side gather); the caller synchronises."""
        import torch

        assert self._mirror is not None
        if dev.type != "cuda":
            return self._mirror.index_select(1, torch.tensor(list(slots), dtype=torch.long)).to(dev)
        moved = torch.empty(
            (len(self._pool), len(slots), self._mirror.shape[2]), dtype=torch.uint8, device=dev
        )
        for b in range(len(self._pool)):
            for first, start, length in _slot_runs(slots):
                moved[b, first : first + length].copy_(
                    self._mirror[b, start : start + length], non_blocking=True
                )
        return moved

    def _scatter(self, moved: torch.Tensor, p_idx: torch.Tensor) -> None:
        for b, pool in enumerate(self._pool):
            pool.index_copy_(0, p_idx, moved[b])

    def _copy_runs(self, p_idx: torch.Tensor, slots: Sequence[int]) -> None:
        """A VRAM pool into the pinned mirror: the pages are gathered on the GPU, and each run of
        consecutive slots of each buffer crosses the bus as one asynchronous DMA into the mirror."""
        import torch

        assert self._mirror is not None
        gathered = torch.stack([pool.index_select(0, p_idx) for pool in self._pool])
        for b in range(len(self._pool)):
            for first, start, length in _slot_runs(slots):
                self._mirror[b, start : start + length].copy_(
                    gathered[b, first : first + length], non_blocking=True
                )


def _slot_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first index in the call, first slot, length) of each run of consecutive slots."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            first, start, length = runs[-1]
            runs[-1] = (first, start, length + 1)
        else:
            runs.append((i, slot, 1))
    return runs


def _lowest_run(free: list[int], n: int) -> list[int]:
    """`n` slots of the sorted `free`: the lowest run of `n` consecutive ones, else the `n` lowest.

    A lease of consecutive slots lets a store run travel as one descriptor per segment (the mirror is
    buffer-major, so consecutive slots are one contiguous range per buffer, like a run of store slots),
    and lets each copy to or from the pool be one DMA per buffer."""
    if len(free) < n:
        return free[:n]
    ids = np.asarray(free, dtype=np.int64)
    # Sorted and distinct: n slots from `at` are consecutive exactly when the last is n - 1 past the first.
    fits = np.flatnonzero(ids[n - 1 :] - ids[: len(ids) - n + 1] == n - 1)
    at = int(fits[0]) if fits.size else 0
    return free[at : at + n]


def _view(buf: KvBuffer) -> torch.Tensor:
    """The buffer's pages as a (num_pages, bytes_per_page) uint8 tensor over the buffer's own memory."""
    import ctypes

    import torch

    rows = (buf.num_pages, buf.bytes_per_page)
    size = buf.num_pages * buf.bytes_per_page
    if buf.device == "cpu":
        raw = (ctypes.c_char * size).from_address(buf.addr)
        return torch.frombuffer(raw, dtype=torch.uint8).view(rows)
    return torch.as_tensor(CudaBytes(buf.addr, size), device=buf.device).view(rows)
