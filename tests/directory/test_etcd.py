"""Two directory processes on one etcd serve one mesh: rooms and feeds cross between them, and kill -9
of a directory or of etcd loses no peer and no open room."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from tests.directory.etcd import Etcd, etcd, etcd_env
from tests.directory.helpers import lifecycle, register_request, source
from tests.support.procs import ServiceProc, start_service
from xavier_core.directory import DirectoryClient, Registration
from xavier_core.runtime.tls import make_dev_certificates

pytestmark = pytest.mark.integration
__all__ = ["etcd"]

ENV = {
    "XAVIER_DIRECTORY__HEARTBEAT_INTERVAL_SECONDS": "0.3",
    "XAVIER_DIRECTORY__PEER_LEASE_SECONDS": "20",
    "XAVIER_DIRECTORY__SWEEP_INTERVAL_SECONDS": "0.05",
    "XAVIER_DIRECTORY__ROOM_LEASE_SECONDS": "20",
    # Snapshots (and compaction) every few commands: a restarted directory starts from one.
    "XAVIER_DIRECTORY__ETCD_SNAPSHOT_EVERY": "10",
}
PREFILL, DECODE = types_pb2.ROLE_PREFILL, types_pb2.ROLE_DECODE
OPEN, READY = dpb.ROOM_STATE_OPEN, dpb.ROOM_STATE_SOURCE_READY
XFER, DONE = dpb.ROOM_STATE_TRANSFERRING, dpb.ROOM_STATE_COMPLETED


class Pair:
    """Two directory processes sharing one etcd prefix."""

    def __init__(self, server: Etcd, workdir: Path) -> None:
        self.env = {**ENV, **etcd_env(server)}
        self.workdir = workdir
        self.procs = [self.start(i) for i in range(2)]

    def start(self, i: int) -> ServiceProc:
        return start_service(
            "xavier-directory", ["--listen", "127.0.0.1:0"], self.workdir, name=f"dir{i}", env=self.env
        )

    def close(self) -> None:
        for proc in self.procs:
            proc.stop()


@pytest.fixture
def dirs(etcd: Etcd, tmp_path: Path) -> Iterator[Pair]:
    pair = Pair(etcd, tmp_path)
    yield pair
    pair.close()


@pytest.fixture
async def clients(dirs: Pair) -> AsyncIterator[tuple[DirectoryClient, DirectoryClient]]:
    async with DirectoryClient(dirs.procs[0].address) as a, DirectoryClient(dirs.procs[1].address) as b:
        yield a, b


async def _register(client: DirectoryClient, tag: str) -> tuple[Registration, Registration]:
    p = await client.register_peer(register_request(f"p-{tag}", PREFILL))
    d = await client.register_peer(register_request(f"d-{tag}", DECODE))
    return p, d


async def test_a_room_crosses_directories(clients: tuple[DirectoryClient, DirectoryClient]) -> None:
    a, b = clients
    p, d = await _register(a, "x")
    # The decode waits on directory A; the prefill publishes through B; A's waiter wakes.
    pid, did = (p.peer_id, p.epoch), (d.peer_id, d.epoch)
    room_id = secrets.randbits(63)
    begin = asyncio.ensure_future(a.begin_transfer(room_id, pid, did, wait_for_source=10))
    await asyncio.sleep(0.2)
    assert (await b.get_room(room_id)).state == OPEN
    assert (await b.publish_source(room_id, pid, did, source())).state == READY
    resp = await begin
    assert resp.room.state == XFER and resp.source_endpoint.agent_name == p.peer_id
    assert (await b.complete_room(room_id, *did)).state == DONE
    assert (await a.get_room(room_id)).state == DONE
    # The whole lifecycle on one directory, read back on the other.
    other = secrets.randbits(63)
    assert await lifecycle(b, p, d, other) == [OPEN, READY, XFER, DONE]
    assert (await a.get_room(other)).state == DONE


async def test_a_feed_on_one_directory_sees_rooms_opened_on_the_other(
    clients: tuple[DirectoryClient, DirectoryClient],
) -> None:
    a, b = clients
    p, d = await _register(a, "feed")
    pid, did = (p.peer_id, p.epoch), (d.peer_id, d.epoch)
    feed = b.watch_peer_rooms(d.peer_id, d.epoch)
    assert await anext(feed) == []
    room_id = secrets.randbits(63)
    await a.publish_source(room_id, pid, did, source())
    changed = await asyncio.wait_for(anext(feed), 10)
    assert [(r.room_id, r.state) for r in changed] == [(room_id, READY)]
    await feed.aclose()


async def test_kill_9_of_one_directory_loses_no_peer_or_room(dirs: Pair) -> None:
    async with DirectoryClient(dirs.procs[0].address) as a:
        p, d = await _register(a, "kill")
        rooms = [secrets.randbits(63) for _ in range(12)]  # past a snapshot (every 10 commands)
        pid, did = (p.peer_id, p.epoch), (d.peer_id, d.epoch)
        for room_id in rooms:
            await a.publish_source(room_id, pid, did, source())
    dirs.procs[0].kill()
    async with DirectoryClient(dirs.procs[1].address) as b:
        for room_id in rooms:
            assert (await b.get_room(room_id)).state == READY
        peers = {peer.peer_id: peer.epoch for peer in await b.list_peers()}
        assert peers[p.peer_id] == p.epoch and peers[d.peer_id] == d.epoch
        resp = await b.begin_transfer(rooms[0], pid, did, wait_for_source=5)
        assert resp.room.state == XFER
    # The killed directory comes back from the newest snapshot plus the log after it, and agrees.
    dirs.procs[0] = dirs.start(0)
    assert "directory snapshot loaded" in dirs.procs[0].log()
    async with DirectoryClient(dirs.procs[0].address) as a2:
        assert (await a2.get_room(rooms[0])).state == XFER
        assert (await a2.get_room(rooms[1])).state == READY
        assert (await a2.complete_room(rooms[0], *did)).state == DONE


async def test_an_etcd_restart_is_survived(etcd: Etcd, dirs: Pair) -> None:
    async with DirectoryClient(dirs.procs[0].address) as a, DirectoryClient(dirs.procs[1].address) as b:
        p, d = await _register(a, "etcd")
        pid, did = (p.peer_id, p.epoch), (d.peer_id, d.epoch)
        room_id = secrets.randbits(63)
        await a.publish_source(room_id, pid, did, source())
        etcd.restart()
        # Both directories reconnect: the room is still there, and new calls go through either one.
        assert (await b.get_room(room_id)).state == READY
        resp = await b.begin_transfer(room_id, pid, did, wait_for_source=5)
        assert resp.room.state == XFER
        assert (await a.complete_room(room_id, *did)).state == DONE
        assert await lifecycle(a, p, d, secrets.randbits(63)) == [OPEN, READY, XFER, DONE]


async def test_directory_to_etcd_over_mtls(tmp_path: Path) -> None:
    """etcd demanding client certificates: a directory with ``etcd_tls`` serves; one without cannot start."""
    certs = make_dev_certificates(tmp_path / "etcd-tls")
    server = Etcd(tmp_path, tls=certs)
    try:
        env = {
            **ENV,
            **etcd_env(server),
            "XAVIER_DIRECTORY__ETCD_TLS__CA_FILE": str(certs.ca_file),
            "XAVIER_DIRECTORY__ETCD_TLS__CERT_FILE": str(certs.cert_file),
            "XAVIER_DIRECTORY__ETCD_TLS__KEY_FILE": str(certs.key_file),
            "XAVIER_DIRECTORY__ETCD_TIMEOUT_SECONDS": "2",
        }
        secure = start_service("xavier-directory", ["--listen", "127.0.0.1:0"], tmp_path, name="tls", env=env)
        try:
            async with DirectoryClient(secure.address) as client:
                p, d = await _register(client, "tls")
                assert await lifecycle(client, p, d, secrets.randbits(63)) == [OPEN, READY, XFER, DONE]
        finally:
            secure.stop()
        plain = {k: v for k, v in env.items() if "ETCD_TLS" not in k}
        with pytest.raises(RuntimeError, match="exited"):
            start_service("xavier-directory", ["--listen", "127.0.0.1:0"], tmp_path, name="plain", env=plain)
    finally:
        server.close()
