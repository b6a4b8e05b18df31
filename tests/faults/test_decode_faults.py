"""Decode faults under load through the router: kill -9 with a spare decode, SIGSTOP past the lease.

After each: clients got a clear status (never HTTP 200 then an error before a decode token), requests
begun a second after the fault succeed on the healthy decode, and every counter (rooms, pinned and
parked pages, running requests) on every service is back to 0 within a bound.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import grpc
import pytest
from xavier.v1 import router_service_pb2 as rpb
from xavier.v1 import router_service_pb2_grpc as rpb_grpc
from xavier.v1 import types_pb2

from tests.faults.conftest import (
    FaultMesh,
    assert_failed_over,
    metric_values,
    metrics_page,
    no_internal_addresses,
    stream_completion,
    under_load,
    wait_idle,
)
from xavier_core.runtime.errors import from_rpc_error

pytestmark = pytest.mark.integration

COUNTS = {"faults": 0, "requests": 0, "leaks": 0}


async def test_kill_one_decode_under_load_fails_over(fault_mesh: FaultMesh) -> None:
    mesh = fault_mesh.mesh
    async with under_load(fault_mesh.router.http, 6, lambda w, i: f"worker {w} request {i}") as outcomes:
        await asyncio.sleep(2.0)
        killed_at = time.monotonic()
        mesh.procs["decode-0"].stop(signal.SIGKILL)
        COUNTS["faults"] += 1
        await asyncio.sleep(5.0)
    COUNTS["requests"] += len(outcomes)

    # 200 then an error is allowed only where decode tokens had already gone out (tokens > 1).
    after = assert_failed_over(outcomes, killed_at, tokens_from_peer=1)
    assert len(after) >= 6, f"only {len(after)} requests after the kill"
    for o in outcomes:
        if o.status != 200:
            assert json.loads(o.body)["error"]["code"] in ("PEER_FAILED", "NO_PEERS"), o.body

    del mesh.procs["decode-0"]
    stats = await wait_idle(mesh, timeout=20.0)
    COUNTS["leaks"] += sum(1 for v in stats.values() if v)
    assert not any(stats.values()), stats

    page = await metrics_page(fault_mesh.router.proc.metrics)
    assert sum(metric_values(page, "xavier_router_peer_down_total").values()) >= 1
    assert sum(metric_values(page, "xavier_router_output_tokens_total").values()) > 0
    for family in ("xavier_router_ttft_seconds", "xavier_router_tpot_seconds", "xavier_router_queue_seconds"):
        assert metric_values(page, f"{family}_count"), family
    assert "xavier_router_failures_total" in page or "xavier_router_failures_created" in page
    log = fault_mesh.router.proc.log()
    assert '"request"' in log or "request " in log  # the per-request line

    # The killed decode comes back (a new epoch) for the next test.
    mesh.start_peer("decode-0", "decode")


async def test_sigstop_decode_past_lease_ends_stalled_streams(fault_mesh: FaultMesh) -> None:
    mesh = fault_mesh.mesh
    victim = mesh.procs["decode-1"]
    async with aiohttp.ClientSession() as session:
        streams = [
            asyncio.ensure_future(
                stream_completion(session, fault_mesh.router.http, f"long stream {i}", 3000)
            )
            for i in range(6)
        ]
        await asyncio.sleep(2.0)
        assert not any(s.done() for s in streams), "streams ended before the fault"
        stopped_at = time.monotonic()
        os.kill(victim.proc.pid, signal.SIGSTOP)
        COUNTS["faults"] += 1
        try:
            # Status answers within its own deadline although one peer cannot answer.
            async with grpc.aio.insecure_channel(fault_mesh.router.grpc) as ch:
                t = time.monotonic()
                status = await rpb_grpc.RouterServiceStub(ch).GetClusterStatus(
                    rpb.GetClusterStatusRequest(), timeout=10
                )
                assert time.monotonic() - t < 3.0
            stalled = [p for p in status.peers if p.peer_id == "decode-1"]
            assert stalled and stalled[0].error, status

            # Past the health probe (and the peer's lease): new requests go to the healthy decode.
            await asyncio.sleep(max(0.0, stopped_at + 2.5 - time.monotonic()))
            fresh = await asyncio.gather(
                *(
                    stream_completion(session, fault_mesh.router.http, f"fresh {i}", 8, timeout=20)
                    for i in range(4)
                )
            )
            for o in fresh:
                assert o.status == 200 and o.finish == "length" and o.sse_error is None, o

            results = await asyncio.gather(*streams)
        finally:
            await asyncio.sleep(max(0.0, stopped_at + 4.0 - time.monotonic()))
            os.kill(victim.proc.pid, signal.SIGCONT)
    COUNTS["requests"] += len(results) + len(fresh)
    timed_out = [o for o in results if o.sse_error is not None]
    assert timed_out, "no stream was on the stopped decode"
    for o in timed_out:
        assert o.sse_error is not None and o.sse_error["code"] == "PROGRESS_TIMEOUT", o
        assert o.ended - stopped_at < 4.0 + 4.0, o.ended - stopped_at  # progress deadline + slack
        assert o.keepalives >= 1, o
    for o in results:
        if o.sse_error is None:
            assert o.finish == "length", o

    stats = await wait_idle(mesh, timeout=30.0)
    COUNTS["leaks"] += sum(1 for v in stats.values() if v)
    assert not any(stats.values()), stats


async def test_no_decode_left_is_a_clean_503(fault_mesh: FaultMesh) -> None:
    """With every decode killed, a request gets a status before any byte: HTTP 503 / UNAVAILABLE with a
    declared reason naming no internal address."""
    mesh = fault_mesh.mesh
    for name in ("decode-0", "decode-1"):
        mesh.procs.pop(name).stop(signal.SIGKILL)
        COUNTS["faults"] += 1
    async with aiohttp.ClientSession() as session:
        for i in range(3):
            o = await stream_completion(
                session, fault_mesh.router.http, f"after both died {i}", 8, timeout=20
            )
            assert o.status == 503, o
            no_internal_addresses(o)
            assert json.loads(o.body)["error"]["code"] in ("PEER_FAILED", "NO_PEERS"), o.body
    async with grpc.aio.insecure_channel(fault_mesh.router.grpc) as ch:
        call = rpb_grpc.RouterServiceStub(ch).Generate(
            rpb.GenerateRequest(text="grpc after both died", sampling=types_pb2.SamplingParams(max_tokens=4)),
            timeout=20,
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "127.0.0.1" not in (info.value.details() or "")
    assert from_rpc_error(info.value).reason in ("PEER_FAILED", "NO_PEERS")
    COUNTS["requests"] += 4
    stats = await wait_idle(mesh, timeout=20.0)
    assert not any(stats.values()), stats
    print("fault counts:", COUNTS)
