"""Peer death and peer restarts: errors surface within a bound, new epochs replace old ones."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import numpy as np
import pytest

from tests.transfer.kvpool import (
    page_bytes,
    poll_until,
    publish,
    reader_manager,
    receive,
    source_process,
)
from xavier_core.transfer import KvManager, KvPoll, StaleEpochError, peer_key

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def manager(pool: list[np.ndarray]) -> Iterator[KvManager]:
    # READs carry the reader's notification (no read-end agent), so a READ stays in flight while the
    # source does not poll: the in-flight cases below need one.
    with reader_manager(f"dst-faults-{os.getpid()}", pool, read_end_agent=False) as manager:
        yield manager


def test_peer_killed_mid_read_fails_within_bound(manager: KvManager) -> None:
    key = peer_key("prefill-dies", 1)
    with source_process(f"src-dies-{os.getpid()}", 31) as src:
        info = publish(src, "k1", list(range(0, 32)))
        src.call("polling", False)  # the READ stays in flight
        rx = receive(manager, "k1", list(range(32, 64)))
        rx.start(info, key)
        assert rx.poll() == KvPoll.TRANSFERRING
        src.kill()
        t0 = time.monotonic()
        assert poll_until(rx.poll, {KvPoll.SUCCESS, KvPoll.FAILED}, timeout=10) == KvPoll.FAILED
        assert time.monotonic() - t0 < 5
        assert rx.error is not None and "READ failed" in rx.error
        assert rx.wait_idle(1)
        rx.clear()
        # The next call against the dead peer fails at once instead of hanging.
        rx2 = receive(manager, "k2", list(range(32, 64)))
        rx2.start(info, key)
        assert poll_until(rx2.poll, {KvPoll.SUCCESS, KvPoll.FAILED}, timeout=5) == KvPoll.FAILED
        assert rx2.error is not None and "Disconnect" in rx2.error
        rx2.clear()


def test_restarted_peer_new_epoch_replaces_old(manager: KvManager, pool: list[np.ndarray]) -> None:
    agent = manager.agent
    name = f"src-restart-{os.getpid()}"  # the restarted process reuses its agent name
    old, new = peer_key("prefill-r", 1), peer_key("prefill-r", 2)
    with source_process(name, 41) as first:
        info1 = publish(first, "e1", [1, 2])
        rx = receive(manager, "e1", [3, 4])
        rx.start(info1, old)
        assert poll_until(rx.poll, {KvPoll.SUCCESS, KvPoll.FAILED}) == KvPoll.SUCCESS
        rx.clear()
        assert agent.add_peer(old, b"ignored: key already cached") == name
        first.kill()
    with source_process(name, 42) as second:
        info2 = publish(second, "e2", [5, 6, 7])
        assert info2.metadata != info1.metadata
        rx = receive(manager, "e2", [10, 11, 12])
        rx.start(info2, new)
        assert poll_until(rx.poll, {KvPoll.SUCCESS, KvPoll.FAILED}) == KvPoll.SUCCESS, rx.error
        assert page_bytes(pool, [10, 11, 12]) == page_bytes(second.pool, [5, 6, 7])
        rx.clear()
        assert old not in agent.peer_keys() and new in agent.peer_keys()
        with pytest.raises(StaleEpochError):
            agent.add_peer(old, info1.metadata)
        assert agent.drop_peer_id_epochs_except("prefill-r", 3) == [new]
        assert not [k for k in agent.peer_keys() if k.startswith("prefill-r@")]
