"""The pair handoff (HandoffProtocol PAIR): the prefill's answer carries the source, the decode reads it
with no directory room, and every way a request can end unpins the prefill's pages (I1, I2)."""

from __future__ import annotations

import asyncio
import signal
import uuid
from pathlib import Path

import grpc
import pytest
from xavier.v1 import decode_service_pb2 as dec
from xavier.v1 import decode_service_pb2_grpc as dec_grpc
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import directory_service_pb2_grpc as dpb_grpc
from xavier.v1 import prefill_service_pb2 as pre
from xavier.v1 import prefill_service_pb2_grpc as pre_grpc
from xavier.v1 import types_pb2
from xavier_client import AsyncClient, XavierError

from tests.faults.test_shutdown import ghost
from tests.pd.conftest import FAST_ENV, Mesh, mesh_stats, rpc_count, wait_drained
from tests.pd.test_pd import Channels, prompt
from tests.support.pd_driver import decode_request, new_room_id, prefill_request, unified_generate
from tests.support.procs import start_service
from xavier_core.runtime.errors import from_rpc_error

pytestmark = pytest.mark.integration

GREEDY = types_pb2.SamplingParams(max_tokens=8, ignore_eos=True)


async def _rooms_opened(ch: Channels) -> int:
    stats = await dpb_grpc.DirectoryServiceStub(ch.directory).GetDirectoryStats(
        dpb.GetDirectoryStatsRequest(), timeout=5
    )
    return stats.rooms_opened


async def _prefill(ch: Channels, room_id: int, tokens: list[int]) -> pre.PrefillResponse:
    _, d = await ch.peers()
    req = prefill_request(room_id, d, tokens, GREEDY, pair_handoff=True)
    resp: pre.PrefillResponse = await pre_grpc.PrefillServiceStub(ch.prefill).Prefill(req, timeout=30)
    return resp


async def _release(ch: Channels, room_id: int, decode_called: bool) -> pre.ReleaseSourceResponse:
    req = pre.ReleaseSourceRequest(request_id=uuid.uuid4().hex, room_id=room_id, decode_called=decode_called)
    resp: pre.ReleaseSourceResponse = await pre_grpc.PrefillServiceStub(ch.prefill).ReleaseSource(
        req, timeout=5
    )
    return resp


def _handed(prefill: dpb.Peer, room_id: int, tokens: list[int], pf: pre.PrefillResponse) -> dec.DecodeRequest:
    """The Decode the router sends after `pf`: the first token and the prefill's source."""
    req = decode_request(room_id, prefill, tokens, GREEDY, pf.first_token, pf.first_logprob)
    req.source.CopyFrom(pf.source)
    return req


async def _decode(ch: Channels, req: dec.DecodeRequest, pf: pre.PrefillResponse) -> list[int]:
    """The whole answer: the prefill's first token and every token the decode streams."""
    got = [pf.first_token]
    async for msg in dec_grpc.DecodeServiceStub(ch.decode).Decode(req, timeout=30):
        got.extend(msg.delta.token_ids)
    return got


async def test_peers_declare_the_pair_handoff(mesh: Mesh) -> None:
    ch = Channels(mesh)
    try:
        p, d = await ch.peers()
        assert p.layout.handoff == d.layout.handoff == types_pb2.HANDOFF_PROTOCOL_PAIR
    finally:
        await ch.close()


async def test_pair_handoff_equals_unified_and_opens_no_room(mesh: Mesh) -> None:
    ch = Channels(mesh)
    try:
        p, _ = await ch.peers()
        opened = await _rooms_opened(ch)
        for n, seed in ((1, 1), (17, 2), (130, 3)):
            tokens = prompt(n, seed)
            room_id = new_room_id()
            pf = await _prefill(ch, room_id, tokens)
            assert pf.HasField("source") and pf.source.num_pages == pf.num_pages > 0
            req = _handed(p, room_id, tokens, pf)
            assert await _decode(ch, req, pf) == await unified_generate(ch.unified, tokens, max_tokens=8)
        assert await _rooms_opened(ch) == opened  # the directory saw no request
        assert not any((await wait_drained(mesh)).values())
    finally:
        await ch.close()


async def test_release_without_a_decode_unpins_at_once(mesh: Mesh) -> None:
    ch = Channels(mesh)
    try:
        room_id = new_room_id()
        pf = await _prefill(ch, room_id, prompt(40, 4))
        assert (await mesh_stats(mesh))["prefill-0.pages_pinned"] == pf.num_pages
        assert (await _release(ch, room_id, decode_called=False)).held
        assert not any((await wait_drained(mesh, timeout=2)).values())
        assert not (await _release(ch, room_id, decode_called=False)).held  # again: nothing held
    finally:
        await ch.close()


async def test_release_after_a_decode_call_parks_until_the_park_timeout(mesh: Mesh) -> None:
    """The router gave up after calling the decode: a read may run, so the pages wait (parked)."""
    ch = Channels(mesh)
    try:
        room_id = new_room_id()
        pf = await _prefill(ch, room_id, prompt(40, 5))
        await _release(ch, room_id, decode_called=True)
        await asyncio.sleep(0.5)
        stats = await mesh_stats(mesh)
        assert stats["prefill-0.pages_parked"] == pf.num_pages, stats
        assert not any((await wait_drained(mesh, timeout=15)).values())  # the park timeout is 5 s here
    finally:
        await ch.close()


async def test_a_source_nobody_reads_is_reclaimed_after_its_lease(mesh: Mesh) -> None:
    """No decode and no word from the router (it died): the room lease, then the park timeout."""
    ch = Channels(mesh)
    try:
        await _prefill(ch, new_room_id(), prompt(20, 6))
        assert (await mesh_stats(mesh))["prefill-0.pages_pinned"] > 0
        assert not any((await wait_drained(mesh, timeout=20)).values())
    finally:
        await ch.close()


async def test_a_decode_that_refuses_the_source_declines_it(mesh: Mesh) -> None:
    """A source of another layout: the decode refuses it naming the field and tells the prefill over
    NIXL that no read will come, so the pages are unpinned at once, with no word from the router."""
    ch = Channels(mesh)
    try:
        p, _ = await ch.peers()
        tokens = prompt(40, 7)
        room_id = new_room_id()
        pf = await _prefill(ch, room_id, tokens)
        req = _handed(p, room_id, tokens, pf)
        req.source.contract_fingerprint = "0" * 64
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _decode(ch, req, pf)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert not any((await wait_drained(mesh, timeout=2)).values())
    finally:
        await ch.close()


async def test_a_decode_that_cannot_find_the_prefill_fails_clearly(mesh: Mesh) -> None:
    ch = Channels(mesh)
    try:
        p, _ = await ch.peers()
        tokens = prompt(40, 8)
        room_id = new_room_id()
        pf = await _prefill(ch, room_id, tokens)
        req = _handed(p, room_id, tokens, pf)
        req.prefill_epoch = p.epoch + 100  # an epoch the directory never saw
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _decode(ch, req, pf)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # As the router does: the decode was called, so the pages are parked until the park timeout.
        await _release(ch, room_id, decode_called=True)
        assert not any((await wait_drained(mesh, timeout=15)).values())
    finally:
        await ch.close()


async def test_decode_killed_mid_handoff_leaves_nothing(mesh: Mesh) -> None:
    """The decode dies with the source handed to it and no word sent: the prefill's lease, then its
    park, reclaim the pages (I2), and the restarted decode serves pair handoffs again."""
    ch = Channels(mesh)
    try:
        room_id = new_room_id()
        pf = await _prefill(ch, room_id, prompt(200, 9))
        assert pf.num_pages == 13
        mesh.procs["decode-0"].stop(signal.SIGKILL)
        del mesh.procs["decode-0"]
        await _release(ch, room_id, decode_called=True)  # the router saw its Decode call fail
        assert not any((await wait_drained(mesh, timeout=20)).values())
    finally:
        await ch.close()
    mesh.start_peer("decode-0", "decode")
    ch = Channels(mesh)
    try:
        p, _ = await ch.peers()
        tokens = prompt(50, 10)
        room_id = new_room_id()
        pf = await _prefill(ch, room_id, tokens)
        req = _handed(p, room_id, tokens, pf)
        assert await _decode(ch, req, pf) == await unified_generate(ch.unified, tokens, max_tokens=8)
        assert not any((await wait_drained(mesh)).values())
    finally:
        await ch.close()


async def test_a_decode_that_never_connected_frees_the_source_at_once(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The router picks a listed decode that nothing answers for (a peer that only registers): its
    Decode never reaches it, so the router's ReleaseSource says so and the prefill unpins at once, not
    after the lease and the park timeout (here ten minutes each)."""
    env = {
        **FAST_ENV,
        "XAVIER_HANDOFF__ROOM_LEASE_SECONDS": "600",
        "XAVIER_HANDOFF__PARK_TIMEOUT_SECONDS": "600",
        "XAVIER_HEALTH_INTERVAL_SECONDS": "600",  # only the failed call takes it out
    }
    m = Mesh(tiny_model, tmp_path, env)
    try:
        m.start_directory()
        prefill = m.start_peer("prefill-0", "prefill")
        checks = rpc_count(prefill, "Check")
        args = ["--model", str(tiny_model), "--directory", m.directory, "--listen", "127.0.0.1:0"]
        m.procs["router"] = start_service(
            "xavier-router", [*args, "--http", ""], tmp_path, name="router", env=env
        )
        # The router's health loop probes every listed peer once as it starts: the ghost registers after
        # that round (the prefill has seen its probe), so only the failed call can take it out.
        for _ in range(600):
            if rpc_count(prefill, "Check") > checks:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the router never probed the prefill")
        async with (
            ghost(m, "decode-ghost", types_pb2.ROLE_DECODE, like="prefill-0"),
            AsyncClient(m.procs["router"].address, timeout=60) as client,
        ):
            with pytest.raises(XavierError) as err:
                await client.generate("a prompt for a decode that is not there", max_tokens=4, mode="pd")
            assert err.value.code == grpc.StatusCode.UNAVAILABLE, err.value  # no pair left after the ghost
            m.procs.pop("router").stop()
            async with grpc.aio.insecure_channel(m.procs["prefill-0"].address) as ch:
                pf = await pre_grpc.PrefillServiceStub(ch).GetPrefillStats(
                    pre.GetPrefillStatsRequest(), timeout=5
                )
            # The prefill ran: the router got as far as the decode.
            assert pf.engine.prompt_tokens_computed > 0, (err.value, m.procs["prefill-0"].log()[-3000:])
            stats: dict[str, int] = {}
            for _ in range(300):
                stats = await mesh_stats(m)
                if not any(stats.values()):
                    break
                await asyncio.sleep(0.1)
            assert not any(stats.values()), stats
    finally:
        m.stop()


async def test_reference_peers_take_the_first_token_from_the_prefill(mesh: Mesh) -> None:
    ch = Channels(mesh)
    try:
        p, d = await ch.peers()
        assert (
            p.layout.first_token_source == d.layout.first_token_source == types_pb2.FIRST_TOKEN_SOURCE_PREFILL
        )
        room_id = new_room_id()
        pf = await _prefill(ch, room_id, prompt(20, 5))
        assert pf.first_token_source == types_pb2.FIRST_TOKEN_SOURCE_PREFILL
        assert (await _release(ch, room_id, decode_called=False)).held
        assert not any((await wait_drained(mesh, timeout=2)).values())
    finally:
        await ch.close()


async def test_a_decode_handed_no_first_token_is_refused_naming_the_field(mesh: Mesh) -> None:
    ch = Channels(mesh)
    try:
        p, _ = await ch.peers()
        req = decode_request(new_room_id(), p, prompt(20, 6), GREEDY)
        req.first_token_source = types_pb2.FIRST_TOKEN_SOURCE_DECODE
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in dec_grpc.DecodeServiceStub(ch.decode).Decode(req, timeout=10):
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        err = from_rpc_error(info.value)
        assert err.reason == "INVALID_ARGUMENT" and err.metadata["field"] == "first_token_source"
        assert not any((await wait_drained(mesh, timeout=2)).values())
    finally:
        await ch.close()
