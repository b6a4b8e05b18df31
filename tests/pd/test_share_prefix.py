"""SharePrefix: a unified replica publishes the pages of a cached prefix for one reader's NIXL read, and
every way the share ends (the read, a decline, no word within the lease, the replica's stop) unpins them."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from xavier.v1 import decode_service_pb2 as dec
from xavier.v1 import decode_service_pb2_grpc as dec_grpc
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import directory_service_pb2_grpc as dpb_grpc
from xavier.v1 import types_pb2

from tests.pd.conftest import FAST_ENV, Mesh
from tests.pd.test_pd import prompt
from tests.support.pd_driver import new_room_id, unified_generate
from tests.support.procs import ServiceProc, start_service
from xavier_core.engine.api import InvalidRequestError, Sampling
from xavier_core.engine.reference import ReferenceEngine
from xavier_core.runtime.errors import XavierError, from_rpc_error
from xavier_core.transfer import peer_key
from xavier_core.transfer.port.kv_port import KvPort

pytestmark = pytest.mark.integration

PAGE = 16
# Null compute: every page's K/V is a function of its tokens and positions, so an engine in this process
# computes exactly the bytes the replica holds, and the reader's pool has the replica's geometry.
ENV = {**FAST_ENV, "XAVIER_ENGINE__COMPUTE": "null", "XAVIER_ENGINE__PAGE_SIZE": str(PAGE)}
SHARING = {**ENV, "XAVIER_HANDOFF__SHARE_PREFIXES": "1"}


def _start_unified(mesh: Mesh, name: str, env: dict[str, str]) -> ServiceProc:
    args = ["--model", str(mesh.model), "--directory", mesh.directory, "--peer-id", name]
    args += ["--device", "cpu", "--listen", "127.0.0.1:0", "--role", "unified"]
    proc = start_service("xavier-decode", args, mesh.workdir, name=name, env=env, timeout=120)
    mesh.procs[name] = proc
    return proc


@pytest.fixture(scope="module")
def share_mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """A directory, `sharer` (share_prefixes on) and `plain` (off)."""
    m = Mesh(tiny_model, tmp_path_factory.mktemp("share"), dict(ENV))
    try:
        m.start_directory()
        _start_unified(m, "sharer", SHARING)
        _start_unified(m, "plain", ENV)
        yield m
    finally:
        m.stop()


@dataclass
class Reader:
    """A reader in this process: an engine's pool (null compute, the replica's geometry) behind a port."""

    engine: ReferenceEngine
    port: KvPort


@pytest.fixture
async def reader(tiny_model: Path) -> AsyncIterator[Reader]:
    engine = ReferenceEngine.load(tiny_model, compute="null", page_size=PAGE, num_pages=64)
    port = KvPort(f"share-reader-{uuid.uuid4().hex[:8]}", engine.kv_buffers(), PAGE)
    try:
        yield Reader(engine, port)
    finally:
        await port.close()
        await engine.close()


async def _share(proc: ServiceProc, room_id: int, tokens: list[int], **kw: Any) -> dec.SharePrefixResponse:
    req = dec.SharePrefixRequest(room_id=room_id, token_ids=tokens, **{"reader_peer_id": "reader-0", **kw})
    async with grpc.aio.insecure_channel(proc.address) as ch:
        try:
            resp: dec.SharePrefixResponse = await dec_grpc.DecodeServiceStub(ch).SharePrefix(req, timeout=10)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
    return resp


async def _refused(proc: ServiceProc, room_id: int, tokens: list[int], **kw: Any) -> XavierError:
    with pytest.raises(XavierError) as info:
        await _share(proc, room_id, tokens, **kw)
    return info.value


async def _stats(proc: ServiceProc) -> dict[str, int]:
    async with grpc.aio.insecure_channel(proc.address) as ch:
        s = await dec_grpc.DecodeServiceStub(ch).GetDecodeStats(dec.GetDecodeStatsRequest(), timeout=5)
    return {"pinned": s.engine.pages_pinned, "parked": s.engine.pages_parked, "rooms": s.rooms_active}


async def _wait_stats(proc: ServiceProc, want: dict[str, int], timeout: float = 30.0) -> dict[str, int]:
    """Polls GetDecodeStats until it reads `want` or the deadline passes; returns the last reading."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        got = await _stats(proc)
        if got == want or asyncio.get_running_loop().time() > deadline:
            return got
        await asyncio.sleep(0.1)


IDLE = {"pinned": 0, "parked": 0, "rooms": 0}


async def _peer(mesh: Mesh, name: str) -> dpb.Peer:
    """The replica's registration, as a reader finds it in the directory's peer list."""
    async with grpc.aio.insecure_channel(mesh.directory) as ch:
        resp = await dpb_grpc.DirectoryServiceStub(ch).ListPeers(
            dpb.ListPeersRequest(role=types_pb2.ROLE_UNIFIED, page_size=100), timeout=5
        )
    (peer,) = [p for p in resp.peers if p.peer_id == name]
    return peer


async def _cache(proc: ServiceProc, tokens: list[int]) -> None:
    """Runs `tokens` through the replica (GenerateUnified), which leaves their full pages in its cache."""
    async with grpc.aio.insecure_channel(proc.address) as ch:
        assert len(await unified_generate(ch, tokens, max_tokens=2)) == 2


async def _expected(reader: Reader, tokens: list[int], first_page: int) -> bytes:
    """The KV bytes of `tokens`' pages from `first_page` on, computed by the reader's own engine."""
    rid = f"ref-{uuid.uuid4().hex[:8]}"
    res = await reader.engine.prefill(rid, tokens, Sampling(max_tokens=1))
    try:
        return reader.engine.read_pages(res.page_ids[first_page:])
    finally:
        reader.engine.release_pages(rid)


async def _pull(reader: Reader, peer: dpb.Peer, room_id: int, source: dpb.SourceDescriptor) -> bytes:
    """Reads a share into pages reserved in the reader's pool, as a page fetch would; their bytes."""
    rid = f"dest-{room_id}"
    dest = reader.engine.reserve_pages(rid, source.num_tokens)
    try:
        key = peer_key(peer.peer_id, peer.epoch)
        await reader.port.pull(room_id, source, peer.endpoint, key, dest, 10, 10)
        return reader.engine.read_pages(dest)
    finally:
        reader.engine.release_pages(rid)


async def test_pin_prefix_pins_the_cached_run_of_full_pages(reader: Reader) -> None:
    engine = reader.engine
    tokens = prompt(3 * PAGE + 7, seed=11)
    res = await engine.prefill("p", tokens, Sampling(max_tokens=1))
    engine.release_pages("p")  # its full pages stay cached, unreferenced
    assert engine.stats().pages_pinned == 0
    assert engine.pin_prefix("a", tokens[: 3 * PAGE]) == res.page_ids[:3]
    assert engine.pin_prefix("b", tokens[: 3 * PAGE], first_page=2) == res.page_ids[2:3]
    assert engine.pin_prefix("c", tokens) == res.page_ids[:3]  # full pages only: the partial last is not
    assert engine.stats().pages_pinned == 3
    assert engine.pin_prefix("d", tokens[: 3 * PAGE], cache_salt="other") == ()  # another tenant's chain
    assert engine.pin_prefix("e", prompt(2 * PAGE, seed=12)) == ()
    with pytest.raises(InvalidRequestError):
        engine.pin_prefix("a", tokens[:PAGE])  # "a" holds pins already
    with pytest.raises(InvalidRequestError):
        engine.pin_prefix("f", tokens[: 3 * PAGE], first_page=3)
    for owner in "abc":
        engine.release_pages(owner)
    s = engine.stats()
    assert s.pages_pinned == 0 and s.pages_free == s.pages_total


async def test_a_reader_pulls_the_shared_pages_bitwise_and_its_read_unpins_them(
    share_mesh: Mesh, reader: Reader
) -> None:
    sharer = share_mesh.procs["sharer"]
    tokens = prompt(4 * PAGE + 5, seed=1)
    await _cache(sharer, tokens)
    peer = await _peer(share_mesh, "sharer")
    assert peer.HasField("endpoint") and peer.endpoint.agent_name
    prefix = tokens[: 4 * PAGE]
    for first_page in (0, 1, 3):
        room_id = new_room_id()
        resp = await _share(sharer, room_id, prefix, first_page=first_page)
        pages = 4 - first_page
        assert resp.pages == resp.source.num_pages == pages and resp.source.num_tokens == pages * PAGE
        assert resp.source.contract_fingerprint == peer.contract_fingerprint != ""
        assert await _stats(sharer) == {"pinned": pages, "parked": 0, "rooms": 1}
        got = await _pull(reader, peer, room_id, resp.source)
        assert got == await _expected(reader, prefix, first_page)
        assert await _wait_stats(sharer, IDLE) == IDLE  # the reader's "done" unpinned them


async def test_a_declined_share_is_unpinned_and_its_room_id_refused_while_live(
    share_mesh: Mesh, reader: Reader
) -> None:
    sharer = share_mesh.procs["sharer"]
    tokens = prompt(2 * PAGE, seed=2)
    await _cache(sharer, [*tokens, 1, 2, 3])
    room_id = new_room_id()
    resp = await _share(sharer, room_id, tokens)
    assert resp.pages == 2
    err = await _refused(sharer, room_id, tokens)
    assert (err.code, err.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "ROOM_BUSY")
    assert await _stats(sharer) == {"pinned": 2, "parked": 0, "rooms": 1}  # the live share is untouched
    peer = await _peer(share_mesh, "sharer")
    key = peer_key(peer.peer_id, peer.epoch)
    await reader.port.decline(room_id, resp.source.read_token, peer.endpoint, key)
    assert await _wait_stats(sharer, IDLE) == IDLE
    again = await _share(sharer, room_id, tokens)  # ended: the id may be used again
    assert again.pages == 2
    await reader.port.decline(room_id, again.source.read_token, peer.endpoint, key)
    assert await _wait_stats(sharer, IDLE) == IDLE


async def test_a_request_whose_id_reads_like_a_shares_owner_runs_beside_the_share(
    share_mesh: Mesh, reader: Reader
) -> None:
    sharer = share_mesh.procs["sharer"]
    tokens = prompt(2 * PAGE, seed=5)
    await _cache(sharer, [*tokens, 7])
    room_id = new_room_id()
    resp = await _share(sharer, room_id, tokens)
    # A client may choose any id: this one is the text of the live share's pin owner.
    async with grpc.aio.insecure_channel(sharer.address) as ch:
        got = await unified_generate(ch, [*tokens, 9], max_tokens=2, request_id=f"share-prefix-{room_id}")
    assert len(got) == 2
    assert await _stats(sharer) == {"pinned": 2, "parked": 0, "rooms": 1}  # the share is untouched
    peer = await _peer(share_mesh, "sharer")
    await reader.port.decline(
        room_id, resp.source.read_token, peer.endpoint, peer_key(peer.peer_id, peer.epoch)
    )
    assert await _wait_stats(sharer, IDLE) == IDLE


async def test_a_share_nobody_reads_is_parked_then_released(share_mesh: Mesh) -> None:
    sharer = share_mesh.procs["sharer"]
    tokens = prompt(3 * PAGE, seed=3)
    await _cache(sharer, [*tokens, 4])
    assert (await _share(sharer, new_room_id(), tokens)).pages == 3
    # No word within the room lease: a read may run, so the pages wait out the park timeout.
    parked = {"pinned": 3, "parked": 3, "rooms": 1}
    assert await _wait_stats(sharer, parked) == parked
    assert await _wait_stats(sharer, IDLE) == IDLE


async def test_a_prefix_not_cached_shares_no_pages(share_mesh: Mesh) -> None:
    sharer = share_mesh.procs["sharer"]
    tokens = prompt(2 * PAGE, seed=4)
    resp = await _share(sharer, new_room_id(), tokens)
    assert resp.pages == 0 and not resp.HasField("source")
    await _cache(sharer, [*tokens, 5])
    salted = await _share(sharer, new_room_id(), tokens, cache_salt="tenant-b")  # another tenant's chain
    assert salted.pages == 0 and not salted.HasField("source")
    assert await _stats(sharer) == IDLE


@pytest.mark.parametrize(
    ("room_id", "tokens", "kw", "field"),
    [
        (0, prompt(PAGE, 5), {}, "room_id"),
        (7, [], {}, "token_ids"),
        (7, prompt(PAGE + 1, 5), {}, "token_ids"),
        (7, [*prompt(PAGE - 1, 5), 1 << 20], {}, "token_ids"),
        (7, prompt(2 * PAGE, 5), {"first_page": 2}, "first_page"),
        (7, prompt(PAGE, 5), {"reader_peer_id": ""}, "reader_peer_id"),
        (7, prompt(PAGE, 5), {"cache_salt": "s" * 257}, "cache_salt"),
    ],
)
async def test_bad_requests_name_their_field(
    share_mesh: Mesh, room_id: int, tokens: list[int], kw: dict[str, Any], field: str
) -> None:
    err = await _refused(share_mesh.procs["sharer"], room_id, tokens, **kw)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.metadata["field"] == field


async def test_a_replica_that_does_not_share_says_so_and_registers_no_endpoint(share_mesh: Mesh) -> None:
    plain = share_mesh.procs["plain"]
    tokens = prompt(2 * PAGE, seed=6)
    await _cache(plain, [*tokens, 6])
    err = await _refused(plain, new_room_id(), tokens)
    assert (err.code, err.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "SHARING_OFF")
    assert not (await _peer(share_mesh, "plain")).HasField("endpoint")
    assert await _stats(plain) == IDLE


async def test_stopping_the_replica_ends_its_shares(share_mesh: Mesh) -> None:
    proc = _start_unified(share_mesh, "sharer-stop", SHARING)
    tokens = prompt(2 * PAGE, seed=7)
    await _cache(proc, [*tokens, 7])
    assert (await _share(proc, new_room_id(), tokens)).pages == 2
    assert await _stats(proc) == {"pinned": 2, "parked": 0, "rooms": 1}
    assert proc.stop() == 0
    log = proc.log()
    # The drain waited for the hold to end (it would warn of what was still live, or of a task destroyed
    # while pending).
    assert "still live at shutdown" not in log and "destroyed but it is pending" not in log
    assert "Traceback" not in log
