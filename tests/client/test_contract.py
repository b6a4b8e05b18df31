"""The SDK covers every RouterService RPC; retries only UNAVAILABLE on idempotent calls; typed errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import xavier_client
from xavier.v1 import router_service_pb2 as rpb
from xavier.v1 import router_service_pb2_grpc as rpb_grpc
from xavier_client import (
    AsyncClient,
    Client,
    InvalidArgumentError,
    RetryPolicy,
    UnavailableError,
)

from xavier_core.runtime import InvalidArgument, Unavailable, abort_with


def test_sdk_covers_every_router_rpc() -> None:
    service = rpb.DESCRIPTOR.services_by_name["RouterService"]
    assert set(xavier_client.RPC_METHODS) == {m.name for m in service.methods}
    for methods in xavier_client.RPC_METHODS.values():
        for name in methods:
            assert callable(getattr(Client, name)) and callable(getattr(AsyncClient, name))


class _Flaky(rpb_grpc.RouterServiceServicer):
    """Fails the first `fail` calls of each RPC with UNAVAILABLE; Generate can fail after one chunk."""

    def __init__(self, fail: int, fail_mid_stream: bool = False) -> None:
        self.fail = fail
        self.fail_mid_stream = fail_mid_stream
        self.calls: dict[str, int] = {}
        self.metadata: list[dict[str, str]] = []

    async def _maybe_fail(self, name: str, context: Any) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        self.metadata.append(dict(context.invocation_metadata()))
        if self.calls[name] <= self.fail:
            await abort_with(context, Unavailable("try again", reason="SHUTTING_DOWN"))

    async def ListModels(self, request: Any, context: Any) -> rpb.ListModelsResponse:
        await self._maybe_fail("ListModels", context)
        return rpb.ListModelsResponse(models=[rpb.Model(id="m")])

    async def Abort(self, request: Any, context: Any) -> rpb.AbortResponse:
        await self._maybe_fail("Abort", context)
        if not request.request_id:
            await abort_with(
                context, InvalidArgument("no id", reason="MISSING_REQUEST_ID", field="request_id")
            )
        return rpb.AbortResponse(found=True)

    async def GetClusterStatus(self, request: Any, context: Any) -> rpb.GetClusterStatusResponse:
        await self._maybe_fail("GetClusterStatus", context)
        return rpb.GetClusterStatusResponse(requests_active=3)

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[rpb.GenerateResponse]:
        if request.model == "slow":
            await asyncio.sleep(2)
        if not self.fail_mid_stream:
            await self._maybe_fail("Generate", context)
        yield rpb.GenerateResponse(request_id=request.request_id, token_ids=[1], text="a")
        if self.fail_mid_stream:
            self.calls["Generate"] = self.calls.get("Generate", 0) + 1
            await abort_with(context, Unavailable("peer died", reason="PEER_UNAVAILABLE"))
        yield rpb.GenerateResponse(request_id=request.request_id, token_ids=[2], text="b", finish_reason=2)


class _Server:
    def __init__(self, servicer: _Flaky) -> None:
        self.servicer = servicer
        self.loop = asyncio.new_event_loop()
        self.address = ""

    def __enter__(self) -> _Server:
        async def start() -> grpc.aio.Server:
            server = grpc.aio.server()
            rpb_grpc.add_RouterServiceServicer_to_server(self.servicer, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            self.address = f"127.0.0.1:{port}"
            return server

        import threading

        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.server = self.loop.run_until_complete(start())
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(None), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def fast_retry() -> RetryPolicy:
    return RetryPolicy(max_attempts=3, initial_backoff=0.001, max_backoff=0.002)


def test_idempotent_calls_retry_unavailable_bounded(fast_retry: RetryPolicy) -> None:
    with _Server(_Flaky(fail=2)) as srv, Client(srv.address, retry=fast_retry, token="t0k") as client:
        assert [m.id for m in client.list_models()] == ["m"]
        assert client.cluster_status().requests_active == 3
        assert client.generate("x", max_tokens=2).text == "ab"
        assert srv.servicer.calls == {"ListModels": 3, "GetClusterStatus": 3, "Generate": 3}
        assert all(md.get("authorization") == "Bearer t0k" for md in srv.servicer.metadata)
    with _Server(_Flaky(fail=5)) as srv, Client(srv.address, retry=fast_retry) as client:
        with pytest.raises(UnavailableError) as info:
            client.abort("r1")
        assert info.value.reason == "SHUTTING_DOWN"
        assert srv.servicer.calls["Abort"] == 3


def test_generate_is_not_retried_after_the_first_chunk(fast_retry: RetryPolicy) -> None:
    with (
        _Server(_Flaky(fail=0, fail_mid_stream=True)) as srv,
        Client(srv.address, retry=fast_retry) as client,
    ):
        got = []
        with pytest.raises(UnavailableError) as info:
            for chunk in client.generate_stream("x", max_tokens=2):
                got.append(chunk.text)
        assert got == ["a"] and info.value.reason == "PEER_UNAVAILABLE"
        assert srv.servicer.calls["Generate"] == 1


def test_typed_error_carries_reason_and_metadata(fast_retry: RetryPolicy) -> None:
    with _Server(_Flaky(fail=0)) as srv, Client(srv.address, retry=fast_retry) as client:
        with pytest.raises(InvalidArgumentError) as info:
            client.abort("")
        err = info.value
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.reason, err.domain, err.metadata) == (
            "MISSING_REQUEST_ID",
            "xavier.v1",
            {"field": "request_id"},
        )


def test_deadline_exceeded_is_typed() -> None:
    with _Server(_Flaky(fail=0)) as srv, Client(srv.address) as client:
        with pytest.raises(xavier_client.XavierError) as info:
            client.generate("x", model="slow", max_tokens=2, deadline=0.2)
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert isinstance(info.value, xavier_client.DeadlineExceededError)


async def test_async_client_retries_and_streams(fast_retry: RetryPolicy) -> None:
    with _Server(_Flaky(fail=1)) as srv:
        async with AsyncClient(srv.address, retry=fast_retry) as client:
            assert [m.id for m in await client.list_models()] == ["m"]
            chunks = [c async for c in client.generate_stream("x", max_tokens=2)]
            assert [c.text for c in chunks] == ["a", "b"] and chunks[-1].finish_reason == "length"
            assert await client.abort("r")


def test_request_building() -> None:
    req = xavier_client.build_request(
        [{"role": "user", "content": "hi"}], xavier_client.Sampling(seed=5), mode="colocated"
    )
    assert req.chat.messages[0].content == "hi" and req.sampling.seed == 5
    assert req.mode == rpb.ROUTING_MODE_COLOCATED and req.request_id
    assert list(xavier_client.build_request([3, 4], xavier_client.Sampling()).token_ids.ids) == [3, 4]
    assert not xavier_client.build_request("t", xavier_client.Sampling()).sampling.HasField("seed")
    with pytest.raises(ValueError):
        xavier_client.build_request("t", xavier_client.Sampling(), mode="warp")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"top_k": 2**32}, "top_k"),
        ({"seed": -5}, "seed"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"stop_token_ids": (1, -2)}, "stop_token_ids"),
        ({"top_logprobs": -1}, "top_logprobs"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logit_bias": {-3: 1.0}}, "logit_bias"),
        ({"json_object": True, "regex": "a+"}, "json_object"),
    ],
)
def test_a_sampling_value_the_wire_cannot_carry_is_a_typed_error(
    sampling: dict[str, object], field: str
) -> None:
    with pytest.raises(xavier_client.InvalidArgumentError) as info:
        xavier_client.build_request("hi", xavier_client.Sampling(**sampling))  # type: ignore[arg-type]
    assert info.value.metadata == {"field": field}


def test_sampling_has_every_field_of_the_wire_form() -> None:
    """The SDK's Sampling names every SamplingParams field: no engine setting is out of a client's reach."""
    import dataclasses

    from xavier.v1 import types_pb2

    ours = {f.name for f in dataclasses.fields(xavier_client.Sampling)}
    assert set(types_pb2.SamplingParams.DESCRIPTOR.fields_by_name) <= ours


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"seed": 0, "top_p": 0.9, "repetition_penalty": 1.0, "stop": ("a", "b"), "logit_bias": {7: -1.5}},
        {"max_tokens": 3, "temperature": 0.7, "top_k": 5, "stop_token_ids": (2,), "ignore_eos": True,
         "logprobs": True, "top_logprobs": 2, "prompt_logprobs": True, "presence_penalty": -0.5,
         "frequency_penalty": 0.25, "min_tokens": 1, "min_p": 0.1, "include_stop_str_in_output": True,
         "truncate_prompt_tokens": 9, "regex": "[a-z]+", "resumed_output_tokens": 3},
    ],
)  # fmt: skip
def test_sampling_wire_form_carries_every_field(kw: dict[str, object]) -> None:
    """Each Sampling field lands in the SamplingParams field of its name; defaults stay off the wire
    except the seed, which has presence."""
    from xavier.v1 import types_pb2

    sampling = xavier_client.Sampling(**kw)  # type: ignore[arg-type]
    msg = sampling.to_proto()
    want = types_pb2.SamplingParams()
    for name in types_pb2.SamplingParams.DESCRIPTOR.fields_by_name:
        value = getattr(sampling, name, None)
        if name == "logit_bias":
            want.logit_bias.update(sampling.logit_bias)
        elif name == "seed":
            if sampling.seed is not None:
                want.seed = sampling.seed
        elif isinstance(value, tuple):
            getattr(want, name).extend(value)
        elif (
            value is not None
            and name not in ("json_object",)
            and value != want.DESCRIPTOR.fields_by_name[name].default_value
        ):
            setattr(want, name, value)
    assert msg == want
    assert msg.HasField("seed") is (sampling.seed is not None)
    assert msg.top_p == pytest.approx(sampling.top_p) and msg.repetition_penalty == pytest.approx(
        sampling.repetition_penalty
    )
