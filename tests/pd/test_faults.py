"""Faults on the P/D path: kill -9 of either side, restarts with new epochs (invariants I2, I6, I7)."""

from __future__ import annotations

import asyncio
import random
import signal
import time

import grpc
import pytest
from xavier.v1 import decode_service_pb2_grpc as dec_grpc
from xavier.v1 import prefill_service_pb2_grpc as pre_grpc
from xavier.v1 import types_pb2

from tests.pd.conftest import Mesh, mesh_stats, wait_drained
from tests.support.pd_driver import (
    decode_request,
    new_room_id,
    pd_generate,
    peer,
    prefill_request,
    unified_generate,
)
from xavier_core.runtime.errors import from_rpc_error

pytestmark = pytest.mark.integration


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


async def wait_for(pred, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not await pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def pd_once(mesh: Mesh, toks: list[int], n: int = 6) -> list[int]:
    async with (
        grpc.aio.insecure_channel(mesh.directory) as d,
        grpc.aio.insecure_channel(mesh.procs["prefill-0"].address) as p,
        grpc.aio.insecure_channel(mesh.procs["decode-0"].address) as c,
    ):
        pp, dd = await peer(d, types_pb2.ROLE_PREFILL), await peer(d, types_pb2.ROLE_DECODE)
        return (await pd_generate(d, p, c, pp, dd, toks, n)).tokens


async def test_prefill_killed_mid_request(mesh: Mesh) -> None:
    """A decode waiting on a dead prefill fails with a clear status within the lease, freeing its pages."""
    toks = prompt(300, 1)
    async with (
        grpc.aio.insecure_channel(mesh.directory) as d,
        grpc.aio.insecure_channel(mesh.procs["decode-0"].address) as c,
    ):
        pp = await peer(d, types_pb2.ROLE_PREFILL)
        # The decode opens the room and waits there for a source that never comes.
        call = dec_grpc.DecodeServiceStub(c).Decode(
            decode_request(new_room_id(), pp, toks, types_pb2.SamplingParams(max_tokens=4)), timeout=30
        )

        async def decode_holds_pages() -> bool:
            return (await mesh_stats(mesh))["decode-0.pages_pinned"] > 0

        consume = asyncio.ensure_future(call.read())
        await wait_for(decode_holds_pages)
        started = time.monotonic()
        mesh.procs["prefill-0"].stop(signal.SIGKILL)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await consume
        elapsed = time.monotonic() - started
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
        assert from_rpc_error(info.value).reason == "PEER_UNAVAILABLE"
        assert elapsed < 6.0  # peer lease 2 s + sweep
    del mesh.procs["prefill-0"]
    stats = await wait_drained(mesh)
    assert not any(stats.values()), stats
    # A restarted prefill registers under a new epoch and serves again.
    mesh.start_peer("prefill-0", "prefill")
    toks = prompt(70, 2)
    async with grpc.aio.insecure_channel(mesh.procs["unified-0"].address) as u:
        assert await pd_once(mesh, toks) == await unified_generate(u, toks, 6)


async def test_decode_killed_prefill_unpins(mesh: Mesh) -> None:
    """A prefill whose decode died unpins its published pages within the lease."""
    toks = prompt(200, 3)
    async with (
        grpc.aio.insecure_channel(mesh.directory) as d,
        grpc.aio.insecure_channel(mesh.procs["prefill-0"].address) as p,
    ):
        dd = await peer(d, types_pb2.ROLE_DECODE)
        # The prefill's publication opens the room; its decode never comes.
        resp = await pre_grpc.PrefillServiceStub(p).Prefill(
            prefill_request(new_room_id(), dd, toks, types_pb2.SamplingParams(max_tokens=4)), timeout=30
        )
        assert resp.num_pages == 13
        assert (await mesh_stats(mesh))["prefill-0.pages_pinned"] >= 13
        started = time.monotonic()
        mesh.procs["decode-0"].stop(signal.SIGKILL)
        del mesh.procs["decode-0"]

        async def prefill_unpinned() -> bool:
            s = await mesh_stats(mesh)
            return s["prefill-0.pages_pinned"] == 0 and s["prefill-0.rooms_active"] == 0

        await wait_for(prefill_unpinned, timeout=10)
        assert time.monotonic() - started < 8.0
    stats = await wait_drained(mesh)
    assert not any(stats.values()), stats
    mesh.start_peer("decode-0", "decode")
    toks = prompt(90, 4)
    async with grpc.aio.insecure_channel(mesh.procs["unified-0"].address) as u:
        assert await pd_once(mesh, toks) == await unified_generate(u, toks, 6)


async def test_old_epoch_is_rejected_after_restart(mesh: Mesh) -> None:
    """A room asked for with a peer's old epoch gets STALE_EPOCH after that peer restarted (I6)."""
    toks = prompt(20, 5)
    async with grpc.aio.insecure_channel(mesh.directory) as d:
        old_p = await peer(d, types_pb2.ROLE_PREFILL)
        mesh.procs["prefill-0"].stop()
        del mesh.procs["prefill-0"]
        mesh.start_peer("prefill-0", "prefill")
        new_p = await peer(d, types_pb2.ROLE_PREFILL)
        assert new_p.epoch > old_p.epoch
        async with grpc.aio.insecure_channel(mesh.procs["decode-0"].address) as c:
            call = dec_grpc.DecodeServiceStub(c).Decode(
                decode_request(new_room_id(), old_p, toks, types_pb2.SamplingParams(max_tokens=4)), timeout=10
            )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in call:
                    pass
        assert from_rpc_error(info.value).reason == "STALE_EPOCH"
    async with grpc.aio.insecure_channel(mesh.procs["unified-0"].address) as u:
        assert await pd_once(mesh, toks) == await unified_generate(u, toks, 6)


async def test_directory_restart_peers_reregister_and_serve(mesh: Mesh) -> None:
    """The directory keeps soft state: after a restart on the same address every peer registers again
    (new epoch) within a heartbeat or two, and P/D works again (I6)."""
    from tests.support.procs import start_service

    old = mesh.procs["directory"]
    address = old.address
    async with grpc.aio.insecure_channel(address) as d:
        before = {p.peer_id: p.epoch for p in (await _peers(d))}
    old.stop()
    mesh.procs["directory"] = start_service(
        "xavier-directory", ["--listen", address], mesh.workdir, name="directory-2", env=mesh.env
    )
    async with grpc.aio.insecure_channel(address) as d:

        async def all_back() -> bool:
            now = {p.peer_id: p.epoch for p in await _peers(d)}
            return set(now) == set(before) and all(now[k] > before[k] for k in before)

        await wait_for(all_back, timeout=10)
    toks = prompt(40, 9)
    async with grpc.aio.insecure_channel(mesh.procs["unified-0"].address) as u:
        assert await pd_once(mesh, toks) == await unified_generate(u, toks, 6)


async def _peers(d: grpc.aio.Channel) -> list:  # type: ignore[type-arg]
    from xavier.v1 import directory_service_pb2 as dpb
    from xavier.v1 import directory_service_pb2_grpc as dpb_grpc

    return list((await dpb_grpc.DirectoryServiceStub(d).ListPeers(dpb.ListPeersRequest(), timeout=5)).peers)
