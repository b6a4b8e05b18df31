"""SIGTERM of a prefill or decode with rooms in every state ends promptly and cleanly.

A prefill may hold a published room nobody pulls, a room whose decode began reading and then went
silent (killed), and pages parked after its decode failed mid-read. A decode may wait in the directory
for a source that never comes. None of these may hold the stop past its grace: the process exits 0
well within it, never logs that the drain exceeded grace, and every room it held in the directory ends
(its live rooms with cause SHUTDOWN), so no peer waits on it.

The other side of each room is a "ghost" peer registered with the directory by the test, which makes
every room state reachable on purpose (a real peer gets there only by timing).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from xavier.v1 import decode_service_pb2_grpc as dec_grpc
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import prefill_service_pb2 as pre
from xavier.v1 import prefill_service_pb2_grpc as pre_grpc
from xavier.v1 import types_pb2

from tests.pd.conftest import FAST_ENV, Mesh
from tests.support.pd_driver import decode_request, new_room_id, prefill_request
from xavier_core.directory import DirectoryClient, PeerSession
from xavier_core.runtime.errors import NotFound

pytestmark = pytest.mark.integration

GRACE_S = 5.0
PROMPT = [5, 6, 7, 8] * 20
SAMPLING = types_pb2.SamplingParams(max_tokens=8, ignore_eos=True)
# The production defaults: every wait a room can cause is far longer than the grace.
ENV = {
    **FAST_ENV,
    "XAVIER_DIRECTORY__ROOM_LEASE_SECONDS": "30",
    "XAVIER_HANDOFF__ROOM_LEASE_SECONDS": "30",
    "XAVIER_HANDOFF__TRANSFER_TIMEOUT_SECONDS": "30",
    "XAVIER_HANDOFF__PARK_TIMEOUT_SECONDS": "60",
    "XAVIER_GRACE_SECONDS": str(GRACE_S),
}


@pytest.fixture
def mesh(tiny_model: Path, tmp_path: Path) -> Iterator[Mesh]:
    m = Mesh(tiny_model, tmp_path, dict(ENV))
    try:
        m.start_directory()
        yield m
    finally:
        m.stop()


@contextlib.asynccontextmanager
async def ghost(
    mesh: Mesh, peer_id: str, role: types_pb2.Role.ValueType, like: str
) -> AsyncIterator[dpb.Peer]:
    """A peer that only registers and heartbeats: it never reads, publishes or answers."""
    async with DirectoryClient(mesh.directory) as client:
        real = next(p for p in await client.list_peers() if p.peer_id == like)
        req = dpb.RegisterPeerRequest(peer_id=peer_id, role=role, address="127.0.0.1:9", layout=real.layout)
        if real.HasField("endpoint"):
            req.endpoint.CopyFrom(real.endpoint)
        session = PeerSession(client, req)
        reg = await session.start()
        try:
            yield reg.peer
        finally:
            await session.stop(unregister=True)


async def sigterm(mesh: Mesh, name: str) -> tuple[int, float, str]:
    """SIGTERM `name` and wait for it (the ghosts keep heartbeating): (exit code, seconds, its log)."""
    proc = mesh.procs.pop(name)
    started = time.monotonic()
    rc = await asyncio.to_thread(proc.stop, signal.SIGTERM, GRACE_S * 4)
    return rc, time.monotonic() - started, proc.log()


def assert_clean_exit(rc: int, took: float, log: str) -> None:
    assert rc == 0, log[-3000:]
    assert "exceeded grace" not in log, log[-3000:]
    assert "on_stop failed" not in log, log[-3000:]
    assert "unhandled exception" not in log, log[-3000:]  # e.g. a call on the closed directory channel
    # Well within the grace: a drain that waits on anything the grace bounds takes all of it.
    assert took < GRACE_S * 0.6, f"took {took:.1f}s to stop\n{log[-3000:]}"
    print(f"stopped in {took:.2f}s (grace {GRACE_S}s)")


async def test_sigterm_prefill_with_live_and_parked_rooms(mesh: Mesh) -> None:
    prefill = mesh.start_peer("prefill-0", "prefill")
    async with (
        ghost(mesh, "decode-ghost", types_pb2.ROLE_DECODE, like="prefill-0") as decode,
        DirectoryClient(mesh.directory) as d,
        grpc.aio.insecure_channel(prefill.address) as ch,
    ):
        stub = pre_grpc.PrefillServiceStub(ch)
        me = (decode.peer_id, decode.epoch)
        rooms = {"never pulled": new_room_id(), "reader went silent": new_room_id(), "parked": new_room_id()}
        for room_id in rooms.values():
            resp = await stub.Prefill(prefill_request(room_id, decode, PROMPT, SAMPLING), timeout=30)
            assert resp.num_pages > 0
        source = next(p for p in await d.list_peers() if p.peer_id == "prefill-0")
        src = (source.peer_id, source.epoch)
        for key in ("reader went silent", "parked"):
            room = (await d.begin_transfer(rooms[key], src, me, wait_for_source=10)).room
            assert room.state == dpb.ROOM_STATE_TRANSFERRING, room
        # The decode failed after posting its read: the read may still run, so the prefill parks.
        await d.abort_room(rooms["parked"], dpb.ROOM_END_CAUSE_DECODE_FAILED, "", *me)
        deadline = time.monotonic() + 10
        while True:
            stats = await stub.GetPrefillStats(pre.GetPrefillStatsRequest(), timeout=5)
            if stats.engine.pages_parked > 0:
                break
            assert time.monotonic() < deadline, stats
            await asyncio.sleep(0.05)
        assert stats.rooms_active == 3, stats

        rc, took, log = await sigterm(mesh, "prefill-0")
        assert_clean_exit(rc, took, log)
        ended = {key: await d.get_room(room_id) for key, room_id in rooms.items()}
        for key in ("never pulled", "reader went silent"):
            assert ended[key].state == dpb.ROOM_STATE_ABORTED, (key, ended[key])
            assert ended[key].end_cause == dpb.ROOM_END_CAUSE_SHUTDOWN, (key, ended[key])
        assert ended["parked"].end_cause == dpb.ROOM_END_CAUSE_DECODE_FAILED, ended["parked"]
        assert (await d.get_stats()).rooms_active == 0


async def test_sigterm_decode_waiting_for_a_source(mesh: Mesh) -> None:
    # The ghost prefill borrows a real prefill's layout and endpoint, then the real one leaves.
    mesh.start_peer("prefill-0", "prefill")
    decode = mesh.start_peer("decode-0", "decode")
    async with (
        ghost(mesh, "prefill-ghost", types_pb2.ROLE_PREFILL, like="prefill-0") as source,
        DirectoryClient(mesh.directory) as d,
        grpc.aio.insecure_channel(decode.address) as ch,
    ):
        room_id = new_room_id()
        call = dec_grpc.DecodeServiceStub(ch).Decode(
            decode_request(room_id, source, PROMPT, SAMPLING), timeout=60
        )
        reader = asyncio.ensure_future(call.read())
        deadline = time.monotonic() + 10
        while True:  # the decode opened the room and waits in the directory for its source
            with contextlib.suppress(NotFound):
                if (await d.get_room(room_id)).state == dpb.ROOM_STATE_OPEN:
                    break
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)

        rc, took, log = await sigterm(mesh, "decode-0")
        assert_clean_exit(rc, took, log)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await reader
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, (err.value, log[-3000:])
        room = await d.get_room(room_id)
        assert room.state == dpb.ROOM_STATE_ABORTED, room
        assert room.end_cause == dpb.ROOM_END_CAUSE_SHUTDOWN, room
