"""A lapsed peer lease is logged by the directory (once, naming the peer and its epoch) and by the peer
that lost it, which registers again."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog
from xavier.v1 import types_pb2

from tests.directory.fakes import FakeClock, make_state
from tests.directory.helpers import endpoint, layout, register_request
from tests.support.procs import start_service
from xavier_core.directory import DirectoryClient, PeerSession


def test_peer_expiry_is_logged_once() -> None:
    clock = FakeClock()
    state, _ = make_state(clock)
    peer = state.peers.register("", "d", types_pb2.ROLE_DECODE, "127.0.0.1:1", layout(), endpoint("d"))
    clock.advance(state.settings.peer_lease_seconds + 1)
    with structlog.testing.capture_logs() as logs:
        assert state.peers.sweep() == 1
        assert state.peers.get("d") is None
    expired = [e for e in logs if e["event"] == "peer lease expired"]
    assert len(expired) == 1
    assert (expired[0]["peer_id"], expired[0]["epoch"], expired[0]["log_level"]) == (
        "d",
        peer.epoch,
        "warning",
    )


@pytest.mark.integration
async def test_session_logs_losing_its_lease_and_registers_again(tmp_path: Path) -> None:
    proc = start_service("xavier-directory", ["--listen", "127.0.0.1:0"], tmp_path)
    try:
        async with DirectoryClient(proc.address, timeout=5.0) as client:
            session = PeerSession(
                client, register_request("d-lease", types_pb2.ROLE_DECODE), heartbeat_interval=0.05
            )
            await session.start()
            first = session.registration
            with structlog.testing.capture_logs() as logs:
                # The directory forgets the peer behind its back, as after a lapsed lease.
                await client.unregister_peer(first.peer_id, first.epoch)
                again = await session.wait_registered(first.epoch, timeout=10)
            await session.stop()
        assert again.epoch > first.epoch
        lost = [e for e in logs if e["event"] == "lost the directory lease; registering again"]
        assert lost and lost[0]["epoch"] == first.epoch
        assert any(e["event"] == "registered" and e["epoch"] == again.epoch for e in logs)
    finally:
        proc.stop()
