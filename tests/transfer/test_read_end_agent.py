"""A reader's read-end notifications leave from its second agent: its READs carry none, the source
hears them from that agent (after a peer's next epoch too), and a dead source fails the next READ and
refuses its notification as before. (`test_port.py` checks a fresh port's first "done" arrives.)"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import numpy as np
import pytest
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from tests.transfer.kvpool import (
    PAGE_SIZE,
    kv_buffers,
    page_bytes,
    poll_until,
    publish,
    reader_manager,
    receive,
    source_process,
)
from xavier_core.transfer import KvBuffer, KvManager, KvPoll, KvPort, NixlAgent, PeerError, peer_key
from xavier_core.transfer.nixl.rooms import done_notif

pytestmark = pytest.mark.integration

PAGES, BPP = 16, 512


def _bufs(seed: int | None) -> tuple[np.ndarray, list[KvBuffer]]:
    rng = np.random.default_rng(seed)
    arr = (
        rng.integers(0, 256, PAGES * BPP, dtype=np.uint8)
        if seed is not None
        else np.zeros(PAGES * BPP, np.uint8)
    )
    return arr, [KvBuffer(arr.ctypes.data, arr.nbytes, BPP, "cpu")]


def _heard(
    src: NixlAgent, senders: list[NixlAgent], want: int, timeout: float = 10.0
) -> list[tuple[str, bytes]]:
    """What `src` hears, polling the senders too (one process: nobody else moves their sends)."""
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        got += src.notifications()
        for agent in senders:
            agent.notifications()
        time.sleep(0.001)
    return got


def test_read_end_notifications_leave_from_the_second_agent_and_follow_a_new_epoch() -> None:
    src_arr, src_bufs = _bufs(3)
    dst_arr, dst_bufs = _bufs(None)
    src = NixlAgent(f"rea-src-{os.getpid()}", src_bufs)
    dst = NixlAgent(f"rea-dst-{os.getpid()}", dst_bufs)
    plain = NixlAgent(f"rea-plain-{os.getpid()}", dst_bufs, read_end_agent=False)
    try:
        assert dst.notifies_apart and not plain.notifies_apart
        for agent in (dst, plain):
            agent.add_peer("src@1", src.metadata())
        xfer = dst.read("src@1", src_bufs, [1, 2, 3], [4, 5, 6])
        poll_until(lambda: (src.notifications(), xfer.poll())[1], {"DONE", "ERR"})
        assert xfer.state == "DONE"
        assert dst_arr.reshape(PAGES, BPP)[4:7].tobytes() == src_arr.reshape(PAGES, BPP)[1:4].tobytes()
        dst.notify_read_end("src@1", b"first")
        plain.notify_read_end("src@1", b"plain")
        heard = _heard(src, [dst, plain], 2)
        assert sorted(heard) == sorted([(f"{dst.name}.notify", b"first"), (plain.name, b"plain")])
        # The peer's next epoch replaces the old one in the second agent too.
        dst.add_peer("src@2", src.metadata())
        assert dst.peer_keys() == ["src@2"]
        dst.notify_read_end("src@2", b"second")
        assert _heard(src, [dst], 1) == [(f"{dst.name}.notify", b"second")]
    finally:
        for agent in (plain, dst, src):
            agent.close()


@pytest.fixture(scope="module")
def manager(pool: list[np.ndarray]) -> Iterator[KvManager]:
    with reader_manager(f"dst-rea-{os.getpid()}", pool, read_end_agent=True) as manager:
        yield manager


def test_a_dead_source_fails_the_next_read_and_its_notification_goes_nowhere(manager: KvManager) -> None:
    key = peer_key("src-gone", 1)
    with source_process(f"src-gone-{os.getpid()}", 9) as src:
        info = publish(src, "g1", [0, 1])
        rx = receive(manager, "g1", [10, 11])
        rx.start(info, key)
        assert poll_until(rx.poll, {KvPoll.SUCCESS, KvPoll.FAILED}) == KvPoll.SUCCESS
        rx.clear()
        src.kill()
        rx2 = receive(manager, "g2", [12, 13])
        rx2.start(info, key)
        assert poll_until(rx2.poll, {KvPoll.SUCCESS, KvPoll.FAILED}, timeout=10) == KvPoll.FAILED
        assert rx2.wait_idle(5)
        rx2.clear()
        with pytest.raises(PeerError):  # neither agent reaches a dead peer: said, not hung
            manager.agent.notify_read_end(key, done_notif("g2"))
        assert manager.agent.live_transfers() == 0


async def test_a_done_sent_while_the_source_is_idle_still_arrives(pool: list[np.ndarray]) -> None:
    """A fresh port's READ ends while the source does not poll (one-sided where UCX copies through CMA),
    so its "done" leaves on an endpoint the source has not answered yet: the port keeps polling after
    the read, so once the source polls again the message goes out and the room ends."""
    with source_process(f"src-idle-{os.getpid()}", 13) as src:
        desc, endpoint = src.call("publish", "401", [3, 4])
        port = KvPort(f"dst-idle-{os.getpid()}", kv_buffers(pool), PAGE_SIZE)
        try:
            assert src.call("polling", False) is False
            pull = asyncio.ensure_future(
                port.pull(
                    401,
                    dpb.SourceDescriptor.FromString(desc),
                    types_pb2.TransferEndpoint.FromString(endpoint),
                    peer_key("src-idle", 1),
                    [50, 51],
                    timeout=10,
                    park_timeout=5,
                )
            )
            await asyncio.wait([pull], timeout=0.5)  # over TCP the READ itself waits for the source
            src.call("polling", True)
            await pull
            assert page_bytes(pool, [50, 51]) == page_bytes(src.pool, [3, 4])
            assert poll_until(lambda: src.call("state", "401")[:2], {("SUCCESS", False)}) == (
                "SUCCESS",
                False,
            )
        finally:
            await port.close()
