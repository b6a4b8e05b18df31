"""P/D handoff over real processes and real NIXL DRAM transfers (issue: P/D spine)."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from xavier.v1 import decode_service_pb2 as dec
from xavier.v1 import decode_service_pb2_grpc as dec_grpc
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import directory_service_pb2_grpc as dpb_grpc
from xavier.v1 import prefill_service_pb2 as pre
from xavier.v1 import prefill_service_pb2_grpc as pre_grpc
from xavier.v1 import types_pb2

from tests.pd.conftest import Mesh, wait_drained
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

PAGE = 16
# One page, many pages, a partial last page, exact page multiples, a single token.
LENGTHS = [1, 5, 15, 16, 17, 31, 32, 33, 47, 64, 65, 100, 127, 128, 129, 200, 255, 256, 300, 401]


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


class Channels:
    def __init__(self, mesh: Mesh) -> None:
        self.directory = grpc.aio.insecure_channel(mesh.directory)
        self.prefill = grpc.aio.insecure_channel(mesh.procs["prefill-0"].address)
        self.decode = grpc.aio.insecure_channel(mesh.procs["decode-0"].address)
        self.unified = grpc.aio.insecure_channel(mesh.procs["unified-0"].address)

    async def peers(self) -> tuple[dpb.Peer, dpb.Peer]:
        return await peer(self.directory, types_pb2.ROLE_PREFILL), await peer(
            self.directory, types_pb2.ROLE_DECODE
        )

    async def close(self) -> None:
        for ch in (self.directory, self.prefill, self.decode, self.unified):
            await ch.close()


async def test_pd_equals_unified_and_bytes_are_exact(mesh: Mesh) -> None:
    ch = Channels(mesh)
    try:
        p, d = await ch.peers()
        for i, n in enumerate(LENGTHS):
            toks = prompt(n, i)
            got = await pd_generate(ch.directory, ch.prefill, ch.decode, p, d, toks, 12, digests=True)
            ref = await unified_generate(ch.unified, toks, 12)
            assert got.tokens == ref, f"prompt of {n} tokens"
            assert got.tokens[0] == got.first_token
            assert len(got.prefill_digest) == 32 and got.prefill_digest == got.decode_digest, n
            assert got.finish == types_pb2.FINISH_REASON_LENGTH
        stats = await wait_drained(mesh)
        assert not any(stats.values()), stats
    finally:
        await ch.close()


async def test_16_concurrent_requests(mesh: Mesh) -> None:
    ch = Channels(mesh)
    try:
        p, d = await ch.peers()
        prompts = [prompt(10 + 23 * i, 100 + i) for i in range(16)]
        refs = [await unified_generate(ch.unified, t, 10) for t in prompts]
        results = await asyncio.gather(
            *(pd_generate(ch.directory, ch.prefill, ch.decode, p, d, t, 10) for t in prompts)
        )
        assert [r.tokens for r in results] == refs
        stats = await wait_drained(mesh)
        assert not any(stats.values()), stats
    finally:
        await ch.close()


async def test_cancel_at_random_points_leaves_nothing(mesh: Mesh) -> None:
    ch = Channels(mesh)
    rng = random.Random(7)
    try:
        p, d = await ch.peers()
        for i in range(12):
            toks = prompt(rng.randrange(20, 400), 1000 + i)
            task = asyncio.ensure_future(
                pd_generate(ch.directory, ch.prefill, ch.decode, p, d, toks, rng.choice([4, 64, 256]))
            )
            await asyncio.sleep(rng.choice([0.0, 0.002, 0.01, 0.03, 0.1]))
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        stats = await wait_drained(mesh)
        assert not any(stats.values()), stats
        # The mesh still serves after the cancellations.
        toks = prompt(50, 5)
        got = await pd_generate(ch.directory, ch.prefill, ch.decode, p, d, toks, 8)
        assert got.tokens == await unified_generate(ch.unified, toks, 8)
    finally:
        await ch.close()


async def test_a_request_id_already_running_is_refused_and_the_running_one_goes_on(mesh: Mesh) -> None:
    toks = prompt(16, 11)
    rid = "busy-request"
    # Real compute, about 3,000 steps (about 190 of the pool's 256 pages): it runs for seconds while the
    # second call comes and goes.
    sampling = types_pb2.SamplingParams(max_tokens=3000, ignore_eos=True)
    request = dec.GenerateUnifiedRequest(request_id=rid, token_ids=toks, sampling=sampling)
    async with grpc.aio.insecure_channel(mesh.procs["unified-0"].address) as ch:
        stub = dec_grpc.DecodeServiceStub(ch)
        first = stub.GenerateUnified(request, timeout=60)
        assert len((await first.read()).delta.token_ids) == 1  # running: its stream has begun
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.GenerateUnified(request, timeout=10):
                pass
        error = from_rpc_error(info.value)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error.reason == "REQUEST_BUSY", error
        assert rid in str(error)
        for _ in range(8):  # the running request is untouched by the refusal
            msg = await first.read()
            assert msg is not grpc.aio.EOF and len(msg.delta.token_ids) == 1 and not msg.finish_reason
        first.cancel()
        stats = await wait_drained(mesh)
        assert not any(stats.values()), stats
        # Ended, its id may be used again.
        assert len(await unified_generate(ch, toks, 2, request_id=rid)) == 2


async def test_bad_input_gets_clear_errors_and_leaks_nothing(mesh: Mesh) -> None:
    ch = Channels(mesh)
    try:
        p, d = await ch.peers()
        prefill = pre_grpc.PrefillServiceStub(ch.prefill)
        decode = dec_grpc.DecodeServiceStub(ch.decode)
        sampling = types_pb2.SamplingParams(max_tokens=4)
        room_id = new_room_id()
        cases = [
            (
                prefill.Prefill(
                    pre.PrefillRequest(room_id=room_id, decode_peer_id=d.peer_id, sampling=sampling),
                    timeout=5,
                ),
                "INVALID_ARGUMENT",
            ),
            (
                prefill.Prefill(
                    pre.PrefillRequest(room_id=room_id, token_ids=[1], sampling=sampling), timeout=5
                ),
                "INVALID_ARGUMENT",
            ),
            (
                prefill.Prefill(
                    pre.PrefillRequest(room_id=0, decode_peer_id=d.peer_id, token_ids=[1], sampling=sampling),
                    timeout=5,
                ),
                "INVALID_ARGUMENT",
            ),
            (
                prefill.Prefill(
                    pre.PrefillRequest(
                        room_id=room_id, decode_peer_id=d.peer_id, token_ids=[1, 10**6], sampling=sampling
                    ),
                    timeout=5,
                ),
                "INVALID_ARGUMENT",
            ),
            (
                prefill.Prefill(
                    pre.PrefillRequest(
                        room_id=room_id,
                        decode_peer_id=d.peer_id,
                        token_ids=[1, 2],
                        sampling=types_pb2.SamplingParams(max_tokens=4, temperature=-1),
                    ),
                    timeout=5,
                ),
                "INVALID_SAMPLING",  # the reason the router gives the same value
            ),
        ]
        for call, reason in cases:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            err = from_rpc_error(info.value)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.reason == reason, err
        # Decode paired with a prefill the directory does not know: PEER_NOT_FOUND, and its reserved pages
        # come back.
        ghost = dpb.Peer(peer_id="prefill-ghost", epoch=1)
        call = decode.Decode(decode_request(new_room_id(), ghost, [1, 2, 3], sampling), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert from_rpc_error(info.value).reason == "PEER_NOT_FOUND"
        # A decode paired with the wrong prefill for an existing room: PAIR_MISMATCH.
        taken = new_room_id()
        await prefill.Prefill(prefill_request(taken, d, [5, 6, 7], sampling), timeout=5)
        # The prefill publishes beside its answer: wait until its room exists, or the decode below would
        # open the room itself and meet STALE_EPOCH for the made-up prefill epoch instead.
        directory = dpb_grpc.DirectoryServiceStub(ch.directory)
        for _ in range(500):
            try:
                await directory.GetRoom(dpb.GetRoomRequest(room_id=taken), timeout=5)
                break
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.NOT_FOUND, exc
                await asyncio.sleep(0.01)
        wrong = dpb.Peer(peer_id=p.peer_id, epoch=p.epoch + 1)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in decode.Decode(decode_request(taken, wrong, [5, 6, 7], sampling), timeout=5):
                pass
        assert from_rpc_error(info.value).reason == "PAIR_MISMATCH"
        await dpb_grpc.DirectoryServiceStub(ch.directory).AbortRoom(
            dpb.AbortRoomRequest(room_id=taken, cause=dpb.ROOM_END_CAUSE_ROUTER_ABORT), timeout=5
        )
        # A unified-only RPC on a decode peer is refused by role.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in decode.GenerateUnified(dec.GenerateUnifiedRequest(token_ids=[1, 2]), timeout=5):
                pass
        assert from_rpc_error(info.value).reason == "WRONG_ROLE"
        stats = await wait_drained(mesh)
        assert not any(stats.values()), stats
    finally:
        await ch.close()


async def test_layout_mismatch_is_refused_naming_fields(mesh: Mesh) -> None:
    other = mesh.start_peer("prefill-pagesize32", "prefill", "--page-size", "32")
    ch = Channels(mesh)
    try:
        peers = await dpb_grpc.DirectoryServiceStub(ch.directory).ListPeers(
            dpb.ListPeersRequest(role=types_pb2.ROLE_PREFILL), timeout=5
        )
        odd = next(x for x in peers.peers if x.peer_id == "prefill-pagesize32")
        sampling = types_pb2.SamplingParams(max_tokens=4)
        call = dec_grpc.DecodeServiceStub(ch.decode).Decode(
            decode_request(new_room_id(), odd, [1, 2, 3], sampling), timeout=5
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
        err = from_rpc_error(info.value)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert err.reason == "LAYOUT_MISMATCH"
        assert "page_size" in str(err) and "page_size" in " ".join(err.metadata.values()) + str(err.metadata)
    finally:
        await ch.close()
        other.stop()
        del mesh.procs["prefill-pagesize32"]


async def test_metrics_report_pages_rooms_and_transfers(mesh: Mesh) -> None:
    import urllib.request

    ch = Channels(mesh)
    try:
        p, d = await ch.peers()
        await pd_generate(ch.directory, ch.prefill, ch.decode, p, d, prompt(80, 77), 4)
        await wait_drained(mesh)
    finally:
        await ch.close()

    def scrape(name: str) -> str:
        url = f"http://{mesh.procs[name].metrics}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return str(resp.read().decode())

    decode = scrape("decode-0")
    assert 'xavier_pages{role="decode",state="pinned"} 0.0' in decode
    assert 'xavier_rooms_active{role="decode"} 0.0' in decode
    transfers = [ln for ln in decode.splitlines() if ln.startswith('xavier_transfers_total{role="decode"}')]
    assert transfers and float(transfers[0].split()[-1]) >= 1
    steps = [
        ln for ln in decode.splitlines() if ln.startswith('xavier_engine_counts{name="steps",role="decode"}')
    ]
    assert steps and float(steps[0].split()[-1]) >= 3  # the engine's own counts (`EngineStats.extra`)
    prefill = scrape("prefill-0")
    assert 'xavier_pages{role="prefill",state="parked"} 0.0' in prefill
    assert 'xavier_engine_counts{name="static_prefill_chunks",role="prefill"} 0.0' in prefill  # CPU: none
    assert "xavier_rpc_total" in prefill
