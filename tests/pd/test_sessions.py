"""Call sessions against real prefill and decode processes: many calls multiplexed on one stream give
what one RPC each gives; a cancel and a deadline reach the servicer, whose cleanup runs (nothing stays
pinned, no room stays open); a peer killed mid-call fails the open calls UNAVAILABLE and the router's
request fails over; a peer that does not declare sessions is called per RPC."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from xavier.v1 import decode_service_pb2 as dec
from xavier.v1 import decode_service_pb2_grpc as dec_grpc
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import prefill_service_pb2 as pre
from xavier.v1 import prefill_service_pb2_grpc as pre_grpc
from xavier.v1 import types_pb2
from xavier_client import AsyncClient

from tests.pd.conftest import FAST_ENV, Mesh, mesh_stats, pair_mesh, rpc_count, wait_drained
from tests.support.pd_driver import decode_request, new_room_id, peer, prefill_request
from tests.support.procs import ServiceProc, start_service
from xavier_core.runtime import from_rpc_error
from xavier_core.runtime.session_client import CallSession

pytestmark = pytest.mark.integration

# Nothing ends a waiting decode but its call: a cancel or deadline that did not reach it would leave its
# pages and room held for ten minutes, past every wait below.
_LONG = {
    **FAST_ENV,
    "XAVIER_HANDOFF__ROOM_LEASE_SECONDS": "600",
    "XAVIER_HANDOFF__TRANSFER_TIMEOUT_SECONDS": "600",
    "XAVIER_DIRECTORY__ROOM_LEASE_SECONDS": "600",
}
_SAMPLING = types_pb2.SamplingParams(max_tokens=6, ignore_eos=True)


def _prefill_session(channel: grpc.aio.Channel) -> CallSession:
    stub = pre_grpc.PrefillServiceStub(channel)
    return CallSession(stub.PrefillSession, pre.PrefillSessionRequest, pre.PrefillSessionCall, "prefill")


def _decode_session(channel: grpc.aio.Channel) -> CallSession:
    stub = dec_grpc.DecodeServiceStub(channel)
    return CallSession(stub.DecodeSession, dec.DecodeSessionRequest, dec.DecodeSessionCall, "decode")


def _router(m: Mesh, tmp: Path, name: str = "router", env: dict[str, str] | None = None) -> ServiceProc:
    """A router on `m`'s directory (not in `m.procs`: `mesh_stats` reads peers only)."""
    args = ["--model", str(m.model), "--directory", m.directory, "--listen", "127.0.0.1:0", "--http", ""]
    return start_service("xavier-router", args, tmp, name=name, env=env or m.env)


@pytest.fixture(scope="module")
def long_mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with pair_mesh(tiny_model, tmp_path_factory.mktemp("sessions"), dict(_LONG)) as m:
        yield m


async def _peers(m: Mesh) -> tuple[dpb.Peer, dpb.Peer]:
    async with grpc.aio.insecure_channel(m.directory) as ch:
        return await peer(ch, types_pb2.ROLE_PREFILL), await peer(ch, types_pb2.ROLE_DECODE)


async def _read_all(call: Any) -> list[int]:
    tokens: list[int] = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        tokens.extend(msg.delta.token_ids)
    return tokens


async def _pair_request(
    ps: CallSession, ds: CallSession, p: dpb.Peer, d: dpb.Peer, prompt: list[int]
) -> list[int]:
    """One P/D request of the pair handoff, both calls on sessions."""
    room = new_room_id()
    req = prefill_request(room, d, prompt, _SAMPLING, pair_handoff=True)
    pf = await ps.unary("prefill", req, request_id=req.request_id, timeout=30)
    dreq = decode_request(room, p, prompt, _SAMPLING, pf.first_token, pf.first_logprob)
    dreq.source.CopyFrom(pf.source)
    return [pf.first_token, *await _read_all(ds.stream("decode", dreq, request_id="", timeout=30))]


async def _pair_per_rpc(
    pch: grpc.aio.Channel, dch: grpc.aio.Channel, p: dpb.Peer, d: dpb.Peer, prompt: list[int]
) -> list[int]:
    room = new_room_id()
    pf = await pre_grpc.PrefillServiceStub(pch).Prefill(
        prefill_request(room, d, prompt, _SAMPLING, pair_handoff=True), timeout=30
    )
    dreq = decode_request(room, p, prompt, _SAMPLING, pf.first_token, pf.first_logprob)
    dreq.source.CopyFrom(pf.source)
    call = dec_grpc.DecodeServiceStub(dch).Decode(dreq, timeout=30)
    return [pf.first_token, *await _read_all(call)]


async def test_many_calls_share_one_session_and_answer_as_rpcs_do(long_mesh: Mesh) -> None:
    p, d = await _peers(long_mesh)
    assert types_pb2.SERVICE_FEATURE_CALL_SESSIONS in p.layout.service_features
    assert types_pb2.SERVICE_FEATURE_CALL_SESSIONS in d.layout.service_features
    prompts = [[3 + i, 7, 11 + 2 * i, 5, 9] for i in range(16)]
    async with grpc.aio.insecure_channel(p.address) as pch, grpc.aio.insecure_channel(d.address) as dch:
        ps, ds = _prefill_session(pch), _decode_session(dch)
        on_sessions = await asyncio.gather(*(_pair_request(ps, ds, p, d, x) for x in prompts))
        per_rpc = [await _pair_per_rpc(pch, dch, p, d, x) for x in prompts]
        assert (ps.opened, ds.opened) == (1, 1)  # 16 prefills and 16 decodes, one stream each
        await ps.close()
        await ds.close()
    assert on_sessions == per_rpc
    assert all(len(t) == _SAMPLING.max_tokens for t in on_sessions)
    assert not any((await wait_drained(long_mesh)).values())


async def test_a_decode_ends_with_its_finishing_message_marked_last(long_mesh: Mesh) -> None:
    """The finishing message of a Decode ends its call by itself: no OK status after it, so the caller
    has no call left to cancel (one message each way fewer per request than a stream ended apart)."""
    p, d = await _peers(long_mesh)
    prompt = [2, 4, 6, 8, 10]
    async with grpc.aio.insecure_channel(p.address) as pch, grpc.aio.insecure_channel(d.address) as dch:
        ps = _prefill_session(pch)
        room = new_room_id()
        req = prefill_request(room, d, prompt, _SAMPLING, pair_handoff=True)
        pf = await ps.unary("prefill", req, request_id=req.request_id, timeout=30)
        await ps.close()
        dreq = decode_request(room, p, prompt, _SAMPLING, pf.first_token, pf.first_logprob)
        dreq.source.CopyFrom(pf.source)
        got_last = asyncio.Event()

        async def requests() -> Any:
            yield dec.DecodeSessionRequest(
                calls=[dec.DecodeSessionCall(call_id=1, request_id="ends-last", decode=dreq)]
            )
            await got_last.wait()  # then the caller closes its side, and the stream ends once all is sent

        results: list[dec.DecodeSessionResult] = []
        async for resp in dec_grpc.DecodeServiceStub(dch).DecodeSession(requests(), timeout=30):
            results += resp.results
            if any(r.last for r in resp.results):
                got_last.set()
    assert [r.WhichOneof("outcome") for r in results] == ["decode"] * len(results)  # no status follows
    assert {r.call_id for r in results} == {1}
    assert [r.last for r in results] == [False] * (len(results) - 1) + [True]
    assert results[-1].decode.finish_reason == types_pb2.FINISH_REASON_LENGTH
    assert sum(len(r.decode.delta.token_ids) for r in results) == _SAMPLING.max_tokens - 1
    assert not any((await wait_drained(long_mesh)).values())


async def _waiting_decode(ds: CallSession, p: dpb.Peer, timeout: float | None) -> tuple[Any, int]:
    """A Decode of a directory room nobody publishes: it holds its pages and room until its call ends."""
    room = new_room_id()
    req = decode_request(room, p, [4, 8, 15, 16, 23, 42], _SAMPLING)
    return ds.stream("decode", req, request_id=f"wait-{room}", timeout=timeout), room


async def _until_holding(m: Mesh) -> None:
    for _ in range(300):
        stats = await mesh_stats(m)
        if stats["decode-0.pages_pinned"] and stats["directory.rooms_active"]:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the decode never took the request: {stats}")


async def test_a_cancel_reaches_the_decode_and_its_cleanup_runs(long_mesh: Mesh) -> None:
    p, d = await _peers(long_mesh)
    cancelled_before = rpc_count(long_mesh.procs["decode-0"], "Decode")
    async with grpc.aio.insecure_channel(d.address) as dch:
        ds = _decode_session(dch)
        call, _room = await _waiting_decode(ds, p, None)
        await _until_holding(long_mesh)
        assert call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call.read()
        stats = await wait_drained(long_mesh)
        assert not any(stats.values()), stats  # the decode's pages and the room went with its task
        # The session outlives the cancelled call: the next one runs on the same stream.
        p_, d_ = await _peers(long_mesh)
        async with grpc.aio.insecure_channel(p.address) as pch:
            tokens = await _pair_request(_prefill_session(pch), ds, p_, d_, [5, 6, 7])
        assert len(tokens) == _SAMPLING.max_tokens and ds.opened == 1
        await ds.close()
    assert rpc_count(long_mesh.procs["decode-0"], "Decode") >= cancelled_before + 2


async def test_a_session_that_ends_cancels_its_open_calls_on_the_peer(long_mesh: Mesh) -> None:
    p, d = await _peers(long_mesh)
    async with grpc.aio.insecure_channel(d.address) as dch:
        ds = _decode_session(dch)
        calls = [(await _waiting_decode(ds, p, None))[0] for _ in range(2)]
        await _until_holding(long_mesh)
        await ds.close()  # the stream ends under its calls, as a router that goes away ends it
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        stats = await wait_drained(long_mesh)
        assert not any(stats.values()), stats  # each call's task was cancelled and cleaned up


async def test_a_deadline_ends_the_call_on_both_sides(long_mesh: Mesh) -> None:
    p, d = await _peers(long_mesh)
    async with grpc.aio.insecure_channel(d.address) as dch:
        ds = _decode_session(dch)
        call, _room = await _waiting_decode(ds, p, 2.0)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        stats = await wait_drained(long_mesh)
        assert not any(stats.values()), stats
        await ds.close()


async def test_bad_input_on_a_session_gets_the_rpcs_status(long_mesh: Mesh) -> None:
    p, d = await _peers(long_mesh)
    async with grpc.aio.insecure_channel(p.address) as pch:
        ps = _prefill_session(pch)
        req = prefill_request(new_room_id(), d, [], _SAMPLING, pair_handoff=True)
        with pytest.raises(grpc.aio.AioRpcError) as on_session:
            await ps.unary("prefill", req, request_id="bad-1", timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as per_rpc:
            await pre_grpc.PrefillServiceStub(pch).Prefill(req, timeout=10)
        got, want = from_rpc_error(on_session.value), from_rpc_error(per_rpc.value)
        assert (got.code, got.reason, got.metadata) == (want.code, want.reason, want.metadata)
        assert got.code == grpc.StatusCode.INVALID_ARGUMENT
        # A failed call leaves the session up for the next.
        release = pre.ReleaseSourceRequest(request_id="r", room_id=new_room_id())
        answer = await ps.unary("release_source", release, request_id="r", timeout=10)
        assert answer.held is False and ps.opened == 1
        await ps.close()


_SMALL_MESSAGES = 64 << 10


async def test_an_answer_past_the_message_limit_fails_its_call_alone(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A Prefill whose answer (a long prompt's logprobs, 20 alternatives each) is larger than the
    prefill's message limit ends RESOURCE_EXHAUSTED (MESSAGE_TOO_LARGE) by itself, where sending it
    would break the session under the calls beside it; those finish, the stream stays, and the
    router's ReleaseSource unpins what the refused call published."""
    env = {**_LONG, "XAVIER_MAX_MESSAGE_BYTES": str(_SMALL_MESSAGES)}
    with pair_mesh(tiny_model, tmp_path, env) as m:
        p, d = await _peers(m)
        big = types_pb2.SamplingParams(max_tokens=2, prompt_logprobs=True, top_logprobs=20)
        prompt = [3 + (i * 7) % 500 for i in range(1500)]
        async with grpc.aio.insecure_channel(p.address) as pch, grpc.aio.insecure_channel(d.address) as dch:
            ps, ds = _prefill_session(pch), _decode_session(dch)
            room = new_room_id()
            req = prefill_request(room, d, prompt, big, pair_handoff=True)
            calls = [_pair_request(ps, ds, p, d, [5 + i, 6, 7, 8]) for i in range(4)]
            got = await asyncio.gather(
                ps.unary("prefill", req, request_id=req.request_id, timeout=30),
                *calls,
                return_exceptions=True,
            )
            refused, beside = got[0], got[1:]
            assert isinstance(refused, grpc.aio.AioRpcError), refused
            err = from_rpc_error(refused)
            assert (err.code, err.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "MESSAGE_TOO_LARGE")
            assert err.metadata["limit"] == str(_SMALL_MESSAGES)
            assert int(err.metadata["bytes"]) > _SMALL_MESSAGES and err.metadata["method"] == "prefill"
            assert all(isinstance(t, list) and len(t) == _SAMPLING.max_tokens for t in beside), beside
            # The same call per RPC fails RESOURCE_EXHAUSTED too (gRPC's own, without a reason).
            room_rpc = new_room_id()
            with pytest.raises(grpc.aio.AioRpcError) as per_rpc:
                await pre_grpc.PrefillServiceStub(pch).Prefill(
                    prefill_request(room_rpc, d, prompt, big, pair_handoff=True), timeout=30
                )
            assert per_rpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for r in (room, room_rpc):  # as the router does for a Prefill that failed
                release = pre.ReleaseSourceRequest(request_id=f"r{r}", room_id=r)
                assert (await ps.unary("release_source", release, request_id=f"r{r}", timeout=10)).held
            assert ps.opened == 1 and ds.opened == 1  # no stream broke
            await ps.close()
            await ds.close()
        assert not any((await wait_drained(m)).values())


async def test_a_request_past_the_message_limit_is_refused_before_it_is_sent(long_mesh: Mesh) -> None:
    """A call whose request is larger than the caller's message limit fails RESOURCE_EXHAUSTED
    (MESSAGE_TOO_LARGE) without being sent, and the session goes on."""
    p, d = await _peers(long_mesh)
    async with grpc.aio.insecure_channel(p.address) as pch, grpc.aio.insecure_channel(d.address) as dch:
        stub = pre_grpc.PrefillServiceStub(pch)
        ps = CallSession(
            stub.PrefillSession, pre.PrefillSessionRequest, pre.PrefillSessionCall, "prefill", 4096
        )
        req = prefill_request(new_room_id(), d, [5] * 3000, _SAMPLING, pair_handoff=True)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await ps.unary("prefill", req, request_id=req.request_id, timeout=10)
        err = from_rpc_error(refused.value)
        assert (err.code, err.reason, err.metadata["limit"]) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "MESSAGE_TOO_LARGE",
            "4096",
        )
        tokens = await _pair_request(ps, _decode_session(dch), p, d, [9, 8, 7])
        assert len(tokens) == _SAMPLING.max_tokens and ps.opened == 1
        await ps.close()
    assert not any((await wait_drained(long_mesh)).values())


@contextlib.contextmanager
def _routed(m: Mesh, tmp: Path, env: dict[str, str] | None = None) -> Iterator[ServiceProc]:
    router = _router(m, tmp, env=env)
    try:
        yield router
    finally:
        router.stop()


async def _generate(client: AsyncClient, prompt: str) -> int:
    return len((await client.generate(prompt, max_tokens=4, mode="pd", ignore_eos=True)).token_ids)


async def test_a_killed_decode_fails_its_open_calls_unavailable_and_the_request_fails_over(
    tiny_model: Path, tmp_path: Path
) -> None:
    env = {**_LONG, "XAVIER_HEALTH_INTERVAL_SECONDS": "600"}
    with pair_mesh(tiny_model, tmp_path, env) as m, _routed(m, tmp_path) as router:
        async with AsyncClient(router.address, timeout=60) as client:
            assert await _generate(client, "warm the router's sessions") == 4
            p, d = await _peers(m)
            async with grpc.aio.insecure_channel(d.address) as dch:
                ds = _decode_session(dch)
                calls = [(await _waiting_decode(ds, p, None))[0] for _ in range(3)]
                await _until_holding(m)
                m.procs.pop("decode-0").kill()
                for call in calls:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call.read()
                    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                    assert from_rpc_error(err.value).reason == "UNAVAILABLE"  # a transport failure
            m.start_peer("decode-1", "decode")
            # The router's session to the dead decode broke too: its next requests go to decode-1.
            for _ in range(3):
                assert await _generate(client, "after the decode died") == 4
        router.stop()  # the sessions it held end now and are counted
        assert rpc_count(m.procs["prefill-0"], "PrefillSession") >= 1


async def test_a_peer_without_sessions_is_called_per_rpc(tiny_model: Path, tmp_path: Path) -> None:
    env = {**FAST_ENV, "XAVIER_PEER__CALL_SESSIONS": "false"}
    with pair_mesh(tiny_model, tmp_path, env) as m, _routed(m, tmp_path, dict(FAST_ENV)) as router:
        p, d = await _peers(m)
        assert not p.layout.service_features and not d.layout.service_features
        async with AsyncClient(router.address, timeout=60) as client:
            for _ in range(3):
                assert await _generate(client, "per call") == 4
        router.stop()  # a session it held would end now and be counted
        for name, session in (("prefill-0", "PrefillSession"), ("decode-0", "DecodeSession")):
            assert rpc_count(m.procs[name], session) == 0, name
        assert rpc_count(m.procs["prefill-0"], "Prefill") == 3
        assert rpc_count(m.procs["decode-0"], "Decode") == 3
