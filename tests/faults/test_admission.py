"""Router admission control and the HTTP front's limits: 429 + Retry-After, a 413 JSON body, and a huge
prompt tokenized off the event loop while another stream keeps flowing."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import aiohttp
import grpc
import pytest
from xavier.v1 import router_service_pb2 as rpb
from xavier.v1 import router_service_pb2_grpc as rpb_grpc
from xavier.v1 import types_pb2

from tests.faults.conftest import FaultMesh, Router, metric_values, metrics_page, start_router, wait_idle
from xavier_core.runtime.errors import from_rpc_error

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def small_router(fault_mesh: FaultMesh) -> Iterator[Router]:
    router = start_router(
        fault_mesh.mesh,
        "router-small",
        XAVIER_MAX_INFLIGHT_REQUESTS="1",
        XAVIER_MAX_QUEUED_REQUESTS="0",
        XAVIER_RETRY_AFTER_SECONDS="2",
    )
    try:
        yield router
    finally:
        router.proc.stop()


async def _first_event(resp: aiohttp.ClientResponse) -> None:
    async for raw in resp.content:
        if raw.startswith(b"data:"):
            return


async def test_one_over_the_limit_gets_429_with_retry_after(
    fault_mesh: FaultMesh, small_router: Router
) -> None:
    body = {"prompt": "hold the only slot", "max_tokens": 400, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://{small_router.http}/v1/completions", json=body) as holder:
            assert holder.status == 200
            await _first_event(holder)
            # The slot is taken and nothing may queue: the next request is refused at once.
            t = time.monotonic()
            async with session.post(
                f"http://{small_router.http}/v1/completions", json={**body, "stream": False, "max_tokens": 2}
            ) as over:
                assert over.status == 429, await over.text()
                assert over.headers["Retry-After"] == "2"
                err = (await over.json())["error"]
                assert err["code"] == "ROUTER_OVERLOADED" and err["type"] == "rate_limit_error"
            assert time.monotonic() - t < 2.0
            # The same limit over gRPC: RESOURCE_EXHAUSTED with the declared reason.
            async with grpc.aio.insecure_channel(small_router.grpc) as ch:
                call = rpb_grpc.RouterServiceStub(ch).Generate(
                    rpb.GenerateRequest(text="over", sampling=types_pb2.SamplingParams(max_tokens=2)),
                    timeout=10,
                )
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in call:
                        pass
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert from_rpc_error(info.value).reason == "ROUTER_OVERLOADED"
            assert from_rpc_error(info.value).metadata["retry_after_seconds"] == "2"
            async for _ in holder.content:
                pass
        # The slot is free again.
        async with session.post(
            f"http://{small_router.http}/v1/completions", json={**body, "stream": False, "max_tokens": 2}
        ) as again:
            assert again.status == 200, await again.text()
    page = await metrics_page(small_router.proc.metrics)
    assert metric_values(page, 'xavier_router_failures_total{reason="ROUTER_OVERLOADED"}')
    stats = await wait_idle(fault_mesh.mesh, timeout=15.0)
    assert not any(stats.values()), stats


async def test_oversize_body_is_a_json_413(fault_mesh: FaultMesh) -> None:
    blob = json.dumps({"prompt": "x" * (9 << 20), "max_tokens": 1})
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"http://{fault_mesh.router.http}/v1/completions",
            data=blob,
            headers={"Content-Type": "application/json"},
        ) as resp:
            assert resp.status == 413
            assert (await resp.json())["error"]["code"] == "REQUEST_TOO_LARGE"


async def test_huge_prompt_is_refused_unread_while_another_stream_runs(fault_mesh: FaultMesh) -> None:
    """A ~7 MB prompt cannot fit the context however it tokenizes: it is refused PROMPT_TOO_LONG from its
    size alone (never tokenized), and a stream running beside it gets every token."""
    http = fault_mesh.router.http
    stream_body = {"prompt": "keep streaming", "max_tokens": 300, "stream": True, "ignore_eos": True}
    huge = {"prompt": "hello world " * 600_000, "max_tokens": 1}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://{http}/v1/completions", json=stream_body) as stream:
            assert stream.status == 200
            await _first_event(stream)
            async with session.post(f"http://{http}/v1/completions", json=huge) as resp:
                assert resp.status == 400, await resp.text()
                error = (await resp.json())["error"]
                assert error["code"] == "PROMPT_TOO_LONG" and "bytes" in error["message"]
            events = [raw async for raw in stream.content if raw.startswith(b"data:")]
    finished = [json.loads(e[5:]) for e in events if e.strip() != b"data: [DONE]"]
    assert sum(1 for e in finished if e["choices"] and e["choices"][0]["text"] is not None) >= 299
