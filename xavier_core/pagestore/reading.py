"""The READ of one fetch call in pieces: each piece verified as soon as it lands, while the next moves.

A fetch call's pages are cut into pieces of about `PIECE_BYTES` (`ClientSettings.read_piece_bytes`);
each piece is one READ of its own descriptors (NIXL's, or one straight out of a same-host store's memory:
see `direct`), and the next piece is posted before the current one
is waited for, so the wire has no gap between pieces. A landed piece is checked (and, for a device pool,
copied to the pool) on the verify threads while later pieces are still on the wire: the checksum pass,
which once followed the whole READ, overlaps it wherever the host has cores to spare, and only the last
piece's check is left after the last byte lands (made on the calling thread: nothing moves meanwhile, and
a call of one piece, the default, takes no second thread hop). A READ may be writing into its pages
until it ends, so every piece is waited for (each has its own deadline) before this returns or raises,
whatever happened to the others.

A GPU pool's same-host read checked as it lands (the page loop, `DirectArena.read_checked`) is made in
parts instead (`read_checked_in_parts`, `ClientSettings.checked_read_part_bytes`): each part is one call
of the loop, read and hashed into the staging's page-major rows, and its verified rows are queued to the
device (`HostStaging.queue_rows`) while the next part is read, so the copy to the GPU, which followed the
whole read, leaves only the last part's behind it. The first corrupt page ends the read: its part's
verified head still crosses, and no later part is read.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from xavier_core.pagestore.connection import Posted, StoreConnection, StorePeer, TransferStuck
from xavier_core.pagestore.layout import Span, failed_pages
from xavier_core.pagestore.metrics import StepClock
from xavier_core.transfer.common.errors import PeerError

if TYPE_CHECKING:
    from xavier_core.pagestore.staging import HostStaging

__all__ = [
    "PART_BYTES",
    "PIECE_BYTES",
    "Verify",
    "cut_spans",
    "piece_bounds",
    "read_checked_in_parts",
    "read_in_pieces",
]

Rows = npt.NDArray[np.uint64]
Verify = Callable[[int, int, StepClock], list[int]]
"""Checks pages `lo:hi` of the call (and moves them to the pool if it must); returns the indices, from
`lo`, of the pages that failed; records its steps on the clock it is given (its own)."""

PIECE_BYTES = 4 << 20
"""Bytes of one piece: small enough that the check left after the last byte lands is short, large enough
that a piece's descriptors (one per segment per run) stay few against its bytes."""
PART_BYTES = 128 << 20
"""A part size for a read checked as it lands (`read_checked_in_parts`): what `cases.sh partab` sets against
one part. Not the default (`ClientSettings.checked_read_part_bytes` is 0, one part) until a GPU host
measures it: there each part's threads start in a sandboxed kernel, at a cost not yet known. Each part
past the first costs a call of the page loop: its threads started and joined, and its slowest thread's
last page waited for. On the 2-core box 500 pages of the 7B-width pool (458 MB, 2 threads) read in 50.2 /
52.9 ms whole, 53.6 / 55.5 in 4 calls, 54.2 / 55.3 in 8 and 56.0 / 58.2 in 16 (two runs,
`page_checksum.py --reads --parts`): about 0.4-1 ms a call, of which starting and joining the second
thread is about 0.1. The copy left after the read is about the last part's (11.5 ms for the whole call on
an H100), so a few parts take most of it, and more add calls for less: 128 MiB cuts that call in 4 (146
pages, the last 62) and keeps a 0.5B-shaped call of 2,000 tokens (24.6 MB) whole."""
_VERIFY_THREADS = min(4, os.cpu_count() or 1)
"""Shared by every fetch of the process: concurrent fetches' checks queue here (the hash holds the GIL
between updates and a mirror's copies take the device lock, so more threads would mostly wait)."""
_AHEAD = 2
"""READs posted at a time. All at once was no faster on CPU (UCX moved them all before the first one
reported done, so nothing was checked meanwhile); one at a time left the wire idle during each post."""


def piece_bounds(pages: int, page_bytes: int, piece_bytes: int = PIECE_BYTES) -> list[tuple[int, int]]:
    """`(lo, hi)` of each piece of `pages` pages, in order; at least one page a piece, and one piece of
    them all when `piece_bytes` is 0."""
    step = max(1, piece_bytes // max(1, page_bytes)) if piece_bytes > 0 else max(1, pages)
    return [(lo, min(lo + step, pages)) for lo in range(0, pages, step)]


def cut_spans(spans: Sequence[Span], lo: int, hi: int) -> list[Span]:
    """The parts of `spans` (in order) that hold pages `lo:hi` of the run they cover together."""
    out: list[Span] = []
    at = 0
    for s in spans:
        first, last = max(lo, at), min(hi, at + s.count)
        if first < last:
            out.append(Span(s.chunk_address, s.chunk_slots, s.first_slot + first - at, last - first))
        at += s.count
    return out


@functools.cache
def _verify_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(_VERIFY_THREADS, thread_name_prefix="page-verify")


def read_in_pieces(
    conn: StoreConnection,
    store: StorePeer,
    pieces: Sequence[tuple[int, int, Rows]],
    verify: Verify,
    clock: StepClock,
) -> list[int]:
    """READs every `(lo, hi, rows)` piece (each posted before the one ahead of it is waited for) and
    verifies each on the verify threads as it lands; returns the indices of the call's pages that
    failed. Blocking: run it off the event loop. Raises `PeerError` (`TransferStuck` when a READ could
    not be cancelled) once every piece has ended."""
    started = time.perf_counter()
    xfers: list[Posted] = []
    checks: list[tuple[int, Future[tuple[list[int], StepClock]]]] = []
    failure: BaseException | None = None
    landed: float | None = None  # when the last piece ended: the "read" step is the wire's time alone
    try:
        for k, (lo, hi, rows) in enumerate(pieces):
            # One piece queued behind the one waited for: the wire never idles between two pieces,
            # and a landed piece is checked while the next moves.
            while len(xfers) < min(len(pieces), k + _AHEAD):
                xfers.append(conn.post("READ", store, pieces[len(xfers)][2]))
            conn.settle("READ", xfers[k], rows, hi - lo)
            if k == len(pieces) - 1:  # nothing moves while the last piece is checked: here, no thread hop
                landed = time.perf_counter()
                checks.append((lo, _checked_here(verify, lo, hi)))
            else:
                checks.append((lo, _verify_pool().submit(_timed, verify, lo, hi)))
    except BaseException as exc:
        failure = exc
    finally:
        failure = _settle_rest(conn, pieces, xfers, failure)
        clock.add("read", (landed or time.perf_counter()) - started)
    corrupt: list[int] = []
    for lo, check in checks:  # every check ends before this returns: they write pool pages
        try:
            bad, spent = check.result()
        except BaseException as exc:
            failure = failure or exc
            continue
        corrupt += [lo + i for i in bad]
        for name, seconds in spent.seconds.items():
            clock.add(name, seconds)
    if failure is not None:
        raise failure
    return corrupt


def _settle_rest(
    conn: StoreConnection,
    pieces: Sequence[tuple[int, int, Rows]],
    xfers: Sequence[Posted],
    failure: BaseException | None,
) -> BaseException | None:
    """Waits for every posted READ still running (after a failure); a stuck one outranks any error."""
    if failure is None:
        return None
    for (lo, hi, rows), xfer in zip(pieces, xfers, strict=False):
        if xfer.state != "PROC":
            continue
        try:
            conn.settle("READ", xfer, rows, hi - lo)
        except TransferStuck as exc:
            failure = exc
        except PeerError:
            pass
    if any(x.in_flight for x in xfers) and not isinstance(failure, TransferStuck):
        return TransferStuck(f"a NIXL READ is still in flight after: {failure}")
    return failure


def _checked_here(verify: Verify, lo: int, hi: int) -> Future[tuple[list[int], StepClock]]:
    """`_timed` run on this thread, its outcome as a finished future (as the verify threads give it)."""
    done: Future[tuple[list[int], StepClock]] = Future()
    try:
        done.set_result(_timed(verify, lo, hi))
    except BaseException as exc:
        done.set_exception(exc)
    return done


def _timed(verify: Verify, lo: int, hi: int) -> tuple[list[int], StepClock]:
    clock = StepClock()
    return verify(lo, hi, clock), clock


def read_checked_in_parts(
    conn: StoreConnection,
    store: StorePeer,
    rows: Rows,
    sums: Sequence[bytes],
    staging: HostStaging,
    slots: Sequence[int],
    pages: Sequence[int],
    parts: Sequence[tuple[int, int]],
    clock: StepClock,
    made: list[tuple[int, int]] | None = None,
) -> list[int]:
    """Reads a call's pages out of a same-host store's memory into the staging rows at `slots`, `rows`
    ((pages, segments, 3) words: `DirectArena.read_checked`) part by part (`parts`, `(lo, hi)` in order),
    each checked against `sums` as it lands and its verified rows queued to the device while the next
    is read; then scatters the verified head into the pool's `pages` and waits. Returns the indices of the
    pages that failed: those of the part holding the first, where the read stopped. Each part is appended
    to `made` before it is read. Every queued copy has ended before this returns or raises (they read the
    rows at `slots`, which go back to the mirror after). Blocking: a worker thread."""
    moved = staging.moved_rows(len(pages))
    corrupt: list[int] = []
    queued = None
    try:
        for lo, hi in parts:
            if made is not None:
                made.append((lo, hi))
            with clock.step("read_checked"):
                got = conn.read_checked(store, rows[lo:hi])
            corrupt = failed_pages(got, sums[lo:hi], lo)
            good = corrupt[0] if corrupt else hi
            queued = staging.queue_rows(slots[lo:good], moved, lo, clock) or queued
            if corrupt:
                break
        staging.rows_to_pool(moved, pages[: corrupt[0] if corrupt else len(pages)], clock)
    except BaseException:
        staging.wait_queued(queued, clock)
        raise
    return corrupt
