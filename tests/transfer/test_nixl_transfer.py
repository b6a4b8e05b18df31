"""Real NIXL READs between two processes (UCX over loopback, DRAM), no progress threads anywhere."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.transfer.kvpool import (
    Source,
    page_bytes,
    poll_until,
    publish,
    reader_manager,
    receive,
    source_process,
)
from xavier_core.transfer import (
    KvManager,
    KvPoll,
    TransferInFlightError,
    done_notif,
    fail_notif,
    peer_key,
)

pytestmark = pytest.mark.integration

SRC_SEED = 11
SRC_KEY = peer_key("prefill-a", 1)


@pytest.fixture(scope="module")
def source() -> Iterator[Source]:
    with source_process(f"src-{os.getpid()}", SRC_SEED) as src:
        yield src


@pytest.fixture(scope="module")
def manager(pool: list[np.ndarray]) -> Iterator[KvManager]:
    # READs carry the reader's notification (no read-end agent), so a READ stays in flight while the
    # source does not poll: the in-flight cases below need one.
    with reader_manager(f"dst-{os.getpid()}", pool, read_end_agent=False) as manager:
        yield manager


SRC_PAGES = [5, 6, 7, 20, 21, 3, *range(40, 48), 63, 0]
DST_PAGES = [10, 11, 12, 13, 30, 2, *range(50, 56), 57, 58, 1, 4]


@pytest.mark.parametrize("mode", ["coalesced", "per_page"])
def test_scattered_read_is_bitwise_exact_and_notifies_sender(
    source: Source, manager: KvManager, pool: list[np.ndarray], mode: str
) -> None:
    for a in pool:
        a[...] = 0
    room = f"r-{mode}"
    info = publish(source, room, SRC_PAGES)
    assert [(r.first, r.count) for r in info.runs] == [(5, 3), (20, 2), (3, 1), (40, 8), (63, 1), (0, 1)]
    assert source.call("state", room)[0] == "TRANSFERRING"
    rx = receive(manager, room, DST_PAGES)
    rx.start(info, SRC_KEY, mode=mode)  # type: ignore[arg-type]
    assert poll_until(rx.poll, {KvPoll.SUCCESS, KvPoll.FAILED}) == KvPoll.SUCCESS, rx.error
    assert page_bytes(pool, DST_PAGES) == page_bytes(source.pool, SRC_PAGES)
    untouched = sorted(set(range(64)) - set(DST_PAGES))
    assert not any(np.any(b) for b in (np.frombuffer(x, np.uint8) for x in page_bytes(pool, untouched)))
    descs = 8 * (6 + 2) if mode == "coalesced" else 8 * len(SRC_PAGES)
    assert rx._xfer is not None and rx._xfer.descriptor_count == descs
    # The completion notification rides on the READ and reaches the source's sender.
    poll_until(lambda: source.call("state", room), {("SUCCESS", False, None)})
    rx.clear()


def test_notifications_without_the_read_token_are_ignored(source: Source, manager: KvManager) -> None:
    room = "r-forged"
    info = publish(source, room, [8, 9])
    assert len(info.token) == 32
    manager.agent.add_peer(SRC_KEY, info.metadata)
    # Anyone who can reach the source's agent can send these; none may end the room.
    forged = [done_notif(room), done_notif(room, "0" * 32), fail_notif(room, info.token[::-1])]
    forged.append(done_notif(room) + "é\xff".encode("latin-1"))  # bytes no str comparison accepts
    for msg in forged:
        manager.agent.send_notif(SRC_KEY, msg)
    time.sleep(0.3)
    assert source.call("state", room) == ("TRANSFERRING", True, None)
    # The reader the token went to ends it.
    manager.agent.send_notif(SRC_KEY, fail_notif(room, info.token))
    poll_until(lambda: source.call("state", room)[:2], {("FAILED", False)})


def test_sender_completes_without_notification(source: Source) -> None:
    room = "r-lost-notif"
    publish(source, room, [1, 2, 3])
    assert source.call("state", room) == ("TRANSFERRING", True, None)
    assert source.call("mark_complete", room) == "SUCCESS"
    assert source.call("state", room) == ("SUCCESS", False, None)


def test_page_count_mismatch_fails_clearly(source: Source, manager: KvManager) -> None:
    info = publish(source, "r-count", [1, 2, 3])
    rx = receive(manager, "r-count", [7, 8])
    rx.start(info, SRC_KEY)
    assert rx.poll() == KvPoll.FAILED
    assert rx.error is not None and "source has 3 pages, destination 2" in rx.error
    assert not rx.in_flight()
    rx.clear()
    poll_until(lambda: source.call("state", "r-count")[:2], {("FAILED", False)})


def test_abort_in_flight_parks_pages_until_read_ends(
    source: Source, manager: KvManager, pool: list[np.ndarray]
) -> None:
    info = publish(source, "r-abort", list(range(8, 16)))
    assert source.call("polling", False) is False  # the READ cannot finish while the source is idle
    try:
        rx = receive(manager, "r-abort", list(range(20, 28)))
        rx.start(info, SRC_KEY)
        assert rx.poll() == KvPoll.TRANSFERRING
        rx.abort()
        assert rx.poll() == KvPoll.FAILED
        assert rx.in_flight()
        assert not rx.wait_idle(0.3)
        with pytest.raises(TransferInFlightError):
            rx.clear()
        assert source.call("state", "r-abort")[1] is True  # the sender keeps its pages pinned too
    finally:
        source.call("polling", True)
    assert rx.wait_idle(10)
    rx.clear()
    poll_until(lambda: source.call("state", "r-abort")[1], {False})


def test_read_times_out_and_is_cancelled(source: Source, manager: KvManager) -> None:
    info = publish(source, "r-timeout", [30, 31])
    source.call("polling", False)
    try:
        agent = manager.agent
        agent.add_peer(SRC_KEY, info.metadata)
        xfer = agent.read(SRC_KEY, info.buffers, [30, 31], [40, 41], timeout_s=0.2)
        t0 = time.monotonic()
        assert poll_until(xfer.poll, {"DONE", "ERR"}, timeout=5) == "ERR"
        assert time.monotonic() - t0 < 2
        assert not xfer.in_flight and xfer.error is not None and "timed out" in xfer.error
    finally:
        source.call("polling", True)


def test_concurrent_rooms_from_worker_threads(
    source: Source, manager: KvManager, pool: list[np.ndarray]
) -> None:
    jobs = [(f"t{i}", list(range(4 * i, 4 * i + 4)), [63 - 4 * i - k for k in range(4)]) for i in range(12)]
    infos = {room: publish(source, room, src) for room, src, _ in jobs}

    def run(room: str, dst: list[int]) -> KvPoll:
        rx = receive(manager, room, dst)
        rx.start(infos[room], SRC_KEY)
        state = poll_until(rx.poll, {KvPoll.SUCCESS, KvPoll.FAILED})
        rx.clear()
        return state

    with ThreadPoolExecutor(4) as pool_ex:
        states = list(pool_ex.map(lambda j: run(j[0], j[2]), jobs))
    assert states == [KvPoll.SUCCESS] * len(jobs)
    for room, src, dst in jobs:
        assert page_bytes(pool, dst) == page_bytes(source.pool, src)
        poll_until(lambda room=room: source.call("state", room)[0], {"SUCCESS"})  # type: ignore[misc]
    assert manager.stats()["receivers"] == 0
