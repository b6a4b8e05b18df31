"""Aux slots beside KV pages: one agent registers both groups, a reader copies slots over real NIXL (DRAM),
and the wire form (endpoint `aux_regions`, descriptor `aux_runs`) is validated like any network input."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from xavier.v1 import directory_service_pb2 as dpb

from xavier_core.transfer import InvalidPagesError, InvalidSourceError, KvBuffer, LayoutError, peer_key
from xavier_core.transfer.aux_slots import AuxNixlAgent, aux_from_proto
from xavier_core.transfer.kv_transfer import KvManager, KvPoll, KvReceiver, KvSender
from xavier_core.transfer.source import endpoint_proto, regions_proto

pytestmark = pytest.mark.integration

PAGE_BYTES, PAGES = 256, 16
AUX_ITEMS, SLOTS = (64, 128, 32), 8


def _arrays(seed: int | None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)

    def fill(n: int) -> np.ndarray:
        return rng.integers(0, 256, n, dtype=np.uint8) if seed is not None else np.zeros(n, np.uint8)

    return [fill(PAGES * PAGE_BYTES) for _ in range(2)], [fill(SLOTS * n) for n in AUX_ITEMS]


def _bufs(arrays: list[np.ndarray], items: tuple[int, ...] | int) -> list[KvBuffer]:
    sizes = [items] * len(arrays) if isinstance(items, int) else list(items)
    return [KvBuffer(a.ctypes.data, a.nbytes, n, "cpu") for a, n in zip(arrays, sizes, strict=True)]


@pytest.fixture(scope="module")
def agents() -> Iterator[tuple[AuxNixlAgent, AuxNixlAgent, list[np.ndarray], list[np.ndarray]]]:
    src_kv, src_aux = _arrays(5)
    dst_kv, dst_aux = _arrays(None)
    pid = os.getpid()
    src = AuxNixlAgent(f"aux-src-{pid}", _bufs(src_kv, PAGE_BYTES), _bufs(src_aux, AUX_ITEMS))
    dst = AuxNixlAgent(f"aux-dst-{pid}", _bufs(dst_kv, PAGE_BYTES), _bufs(dst_aux, AUX_ITEMS))
    dst.add_peer(peer_key("src", 1), src.metadata())
    yield src, dst, src_aux, dst_aux
    dst.close()
    src.close()


def test_slot_is_copied_bitwise(
    agents: tuple[AuxNixlAgent, AuxNixlAgent, list[np.ndarray], list[np.ndarray]],
) -> None:
    src, dst, src_aux, dst_aux = agents
    xfer = dst.read_slots(peer_key("src", 1), src.aux_buffers, [2], [5])
    deadline = time.monotonic() + 20
    while xfer.poll() == "PROC" and time.monotonic() < deadline:
        src.notifications()  # the source's side of progress (no NIXL progress threads)
        time.sleep(0.001)
    assert xfer.state == "DONE", xfer.error
    assert xfer.nbytes == sum(AUX_ITEMS) and not xfer.in_flight
    for s, d, n in zip(src_aux, dst_aux, AUX_ITEMS, strict=True):
        assert d[5 * n : 6 * n].tobytes() == s[2 * n : 3 * n].tobytes()
        assert not d[: 5 * n].any() and not d[6 * n :].any()  # nothing else written


def test_bad_slots_and_layouts_are_refused(
    agents: tuple[AuxNixlAgent, AuxNixlAgent, list[np.ndarray], list[np.ndarray]],
) -> None:
    src, dst, _, _ = agents
    key = peer_key("src", 1)
    with pytest.raises(InvalidPagesError, match="aux source page 8 is outside"):
        dst.read_slots(key, src.aux_buffers, [SLOTS], [0])
    with pytest.raises(InvalidPagesError, match="aux destination page ids repeat"):  # the checks of read()
        dst.read_slots(key, src.aux_buffers, [0, 1], [2, 2])
    with pytest.raises(LayoutError, match="count"):
        dst.read_slots(key, src.aux_buffers[:2], [0], [0])
    wrong = (*src.aux_buffers[:2], KvBuffer(src.aux_buffers[2].addr, 64 * SLOTS, 64, "cpu"))
    with pytest.raises(LayoutError, match="aux buffer 2: bytes_per_page differs"):
        dst.read_slots(key, wrong, [0], [0])
    kv_only = AuxNixlAgent(f"aux-none-{os.getpid()}", list(dst.buffers), [])
    try:
        with pytest.raises(LayoutError, match="no aux"):
            kv_only.read_slots(key, src.aux_buffers, [0], [0])
    finally:
        kv_only.close()


def test_wire_form_round_trips_and_is_validated() -> None:
    kv, aux = _arrays(1)
    kv_bufs, aux_bufs = _bufs(kv, PAGE_BYTES), _bufs(aux, AUX_ITEMS)
    endpoint = endpoint_proto("agent", b"md", kv_bufs)
    endpoint.aux_regions.extend(regions_proto(aux_bufs))
    source = dpb.SourceDescriptor(num_pages=1)
    source.page_runs.add(first_page=0, count=1)
    source.aux_runs.add(first_page=3, count=1)
    buffers, slots = aux_from_proto(source, endpoint)
    assert buffers == tuple(aux_bufs) and slots.tolist() == [3]

    no_aux = endpoint_proto("agent", b"md", kv_bufs)
    with pytest.raises(InvalidSourceError, match="aux_regions"):
        aux_from_proto(source, no_aux)
    for first, count in ((0, 0), (0, (1 << 32) - 1), (SLOTS - 1, 2), (SLOTS, 1)):
        bad = dpb.SourceDescriptor()  # empty, more than the slots (unexpanded), past the last slot
        bad.aux_runs.add(first_page=first, count=count)
        with pytest.raises(InvalidSourceError, match="aux_runs"):
            aux_from_proto(bad, endpoint)
    endpoint.aux_regions[0].device = ""
    with pytest.raises(InvalidSourceError, match=r"aux_regions\[0\]\.device"):
        aux_from_proto(source, endpoint)
    endpoint.aux_regions[0].device = "cpu"
    endpoint.aux_regions[1].bytes_per_page = 0
    with pytest.raises(InvalidSourceError, match="aux_regions: buffer 1 is invalid"):
        aux_from_proto(source, endpoint)


@contextlib.contextmanager
def _rooms(tag: str) -> Iterator[tuple[KvSender, KvReceiver, KvManager, list[np.ndarray], list[np.ndarray]]]:
    """A published source room and its reader over fresh agents: (sender, receiver, source manager,
    source arrays, reader arrays), each list KV buffers then aux buffers."""
    (src_kv, src_aux), (dst_kv, dst_aux) = _arrays(9), _arrays(None)
    pid = os.getpid()
    src = AuxNixlAgent(f"lead-src-{tag}-{pid}", _bufs(src_kv, PAGE_BYTES), _bufs(src_aux, AUX_ITEMS))
    dst = AuxNixlAgent(f"lead-dst-{tag}-{pid}", _bufs(dst_kv, PAGE_BYTES), _bufs(dst_aux, AUX_ITEMS))
    try:
        src_mgr = KvManager(src, src.buffers, 1)
        sender = KvSender(src_mgr, "r")
        sender.init(3)
        info = sender.send([1, 2, 3])
        rx = KvReceiver(KvManager(dst, dst.buffers, 1), "r")
        rx.init()
        rx.send_metadata([4, 5, 6])
        key = peer_key("src", 1)
        rx.start(info, key, lead=lambda: dst.read_slots(key, src.aux_buffers, [2], [6]))
        yield sender, rx, src_mgr, [*src_kv, *src_aux], [*dst_kv, *dst_aux]
    finally:
        dst.close()
        src.close()


def _pump(src_mgr: KvManager, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 20
    while not done() and time.monotonic() < deadline:
        src_mgr.progress()  # the source's side of progress, and its notifications routed to the sender
        time.sleep(0.001)


def test_receiver_reads_the_lead_slot_then_the_pages() -> None:
    with _rooms("ok") as (sender, rx, src_mgr, src, dst):
        _pump(src_mgr, lambda: rx.poll() != KvPoll.TRANSFERRING and sender.poll() != KvPoll.TRANSFERRING)
        assert rx.poll() == KvPoll.SUCCESS, rx.error
        assert sender.poll() == KvPoll.SUCCESS  # the page READ's done notification
        for s, d in zip(src[:2], dst[:2], strict=True):
            assert d[4 * PAGE_BYTES : 7 * PAGE_BYTES].tobytes() == s[PAGE_BYTES : 4 * PAGE_BYTES].tobytes()
        for s, d, n in zip(src[2:], dst[2:], AUX_ITEMS, strict=True):
            assert d[6 * n : 7 * n].tobytes() == s[2 * n : 3 * n].tobytes()


def test_failure_during_the_lead_read_is_told_once_it_ended_and_pages_stay_unread() -> None:
    with _rooms("abort") as (sender, rx, src_mgr, _, dst):
        # Without NIXL progress threads the lead READ stays PROC until the source makes progress.
        assert rx.poll() == KvPoll.TRANSFERRING and rx.in_flight()
        rx.abort("decode aborted")
        assert sender.peek() == (KvPoll.TRANSFERRING, True)  # nothing told while the slot may be read
        _pump(src_mgr, lambda: not rx.in_flight() and sender.peek()[0] != KvPoll.TRANSFERRING)
        assert not rx.in_flight() and rx.poll() == KvPoll.FAILED
        assert sender.peek() == (KvPoll.FAILED, False), "the source was not told the read failed"
        assert not any(d[: 7 * PAGE_BYTES].any() for d in dst[:2]), "pages were read after the abort"
