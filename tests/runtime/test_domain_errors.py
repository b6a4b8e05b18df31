"""Engine and sampling errors know no gRPC; the runtime interceptor turns them into statuses with one
ErrorInfo, on a real server, for unary and streaming handlers."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.protobuf import duration_pb2

from xavier_core.engine.api import EngineError, InvalidRequestError, OutOfPagesError, RequestNotFoundError
from xavier_core.engine.errors import CheckpointError, EngineClosedError, RequestAbortedError
from xavier_core.runtime import from_rpc_error
from xavier_core.runtime.durations import to_duration, to_seconds
from xavier_core.sampling import SamplingError

from .conftest import SERVICE

CASES = [
    (InvalidRequestError("empty prompt"), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST"),
    (OutOfPagesError("pool full"), grpc.StatusCode.RESOURCE_EXHAUSTED, "OUT_OF_PAGES"),
    (RequestNotFoundError("no r1"), grpc.StatusCode.NOT_FOUND, "REQUEST_NOT_FOUND"),
    (RequestAbortedError("aborted"), grpc.StatusCode.ABORTED, "REQUEST_ABORTED"),
    (EngineClosedError("closed"), grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN"),
    (CheckpointError("bad"), grpc.StatusCode.INTERNAL, "CHECKPOINT_ERROR"),
    (EngineError("step failed"), grpc.StatusCode.INTERNAL, "ENGINE_ERROR"),
    (SamplingError("top_p must be in (0, 1]", "top_p"), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_SAMPLING"),
]


def test_the_engine_and_the_text_layer_import_no_grpc() -> None:
    code = (
        "import sys, xavier_core.engine.reference, xavier_core.engine.errors, xavier_core.text;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'xavier') "
        "or m.startswith('xavier_core.runtime')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
    assert EngineError.__mro__[1] is Exception  # a plain exception, not a XavierError


@pytest.mark.parametrize("streaming", [False, True])
async def test_core_errors_reach_the_client_as_code_and_reason(serve_handlers: Any, streaming: bool) -> None:
    errors = {f"Raise{i}": exc for i, (exc, _, _) in enumerate(CASES)}

    def unary(exc: Exception) -> Any:
        async def handler(request: bytes, context: Any) -> bytes:
            raise exc

        return grpc.unary_unary_rpc_method_handler(handler)

    def stream(exc: Exception) -> Any:
        async def handler(request: bytes, context: Any) -> AsyncIterator[bytes]:
            yield b"first"
            raise exc

        return grpc.unary_stream_rpc_method_handler(handler)

    make = stream if streaming else unary
    handle = await serve_handlers({name: make(exc) for name, exc in errors.items()})
    async with grpc.aio.insecure_channel(handle.address) as channel:
        for i, (exc, code, reason) in enumerate(CASES):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                if streaming:
                    async for _ in channel.unary_stream(f"/{SERVICE}/Raise{i}")(b"", timeout=5):
                        pass
                else:
                    await channel.unary_unary(f"/{SERVICE}/Raise{i}")(b"", timeout=5)
            typed = from_rpc_error(info.value)
            assert (info.value.code(), typed.reason) == (code, reason), exc
            assert typed.message == str(exc)


async def test_a_sampling_error_names_its_field(serve_handlers: Any) -> None:
    async def handler(request: bytes, context: Any) -> bytes:
        raise SamplingError("max_tokens must be in [1, 1048576], got 0", "max_tokens", "INVALID_MAX_TOKENS")

    handle = await serve_handlers({"Sample": grpc.unary_unary_rpc_method_handler(handler)})
    async with grpc.aio.insecure_channel(handle.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await channel.unary_unary(f"/{SERVICE}/Sample")(b"", timeout=5)
    typed = from_rpc_error(info.value)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (typed.reason, typed.metadata) == ("INVALID_MAX_TOKENS", {"field": "max_tokens"})


@pytest.mark.parametrize("seconds", [0.0, 0.3, 1.5, 2.000000001, 86_400.25, -1.5])
def test_durations_round_trip(seconds: float) -> None:
    d = to_duration(seconds)
    assert isinstance(d, duration_pb2.Duration)
    assert to_seconds(d) == pytest.approx(seconds, abs=1e-9)
    assert d.ToNanoseconds() == round(seconds * 1e9)  # nearest nanosecond, not truncated
    assert to_seconds(duration_pb2.Duration()) == 0.0
