"""Typed errors cross a real gRPC hop as google.rpc.Status with one ErrorInfo and come back typed."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from xavier_core.runtime import (
    ERROR_DOMAIN,
    Aborted,
    CapacityExhausted,
    FailedPrecondition,
    GenericError,
    Internal,
    InvalidArgument,
    LayoutMismatch,
    LeaseExpired,
    NotFound,
    Unavailable,
    Unimplemented,
    XavierError,
    abort_with,
    from_rpc_error,
    to_rpc_status,
)

from .conftest import SERVICE

CASES: list[tuple[XavierError, grpc.StatusCode, str]] = [
    (InvalidArgument("bad top_p", field="top_p"), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"),
    (NotFound("no room", reason="ROOM_NOT_FOUND", room_id="7"), grpc.StatusCode.NOT_FOUND, "ROOM_NOT_FOUND"),
    (
        FailedPrecondition("old epoch", reason="STALE_EPOCH", epoch=3),
        grpc.StatusCode.FAILED_PRECONDITION,
        "STALE_EPOCH",
    ),
    (
        LayoutMismatch("dtype differs", dtype="float16!=bfloat16"),
        grpc.StatusCode.FAILED_PRECONDITION,
        "LAYOUT_MISMATCH",
    ),
    (LeaseExpired("room lease ended", room_id="9"), grpc.StatusCode.FAILED_PRECONDITION, "LEASE_EXPIRED"),
    (CapacityExhausted("no pages", free_pages=0), grpc.StatusCode.RESOURCE_EXHAUSTED, "CAPACITY_EXHAUSTED"),
    (Unavailable("draining", reason="SHUTTING_DOWN"), grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN"),
    (Aborted("client went away"), grpc.StatusCode.ABORTED, "REQUEST_ABORTED"),
    (Unimplemented("later part"), grpc.StatusCode.UNIMPLEMENTED, "NOT_IMPLEMENTED"),
    (Internal("broken invariant"), grpc.StatusCode.INTERNAL, "INTERNAL"),
]


def _error_info(err: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    blob = dict(err.trailing_metadata() or ())["grpc-status-details-bin"]
    status = status_pb2.Status.FromString(blob)
    assert len(status.details) == 1
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    return info


@pytest.mark.parametrize(("raised", "code", "reason"), CASES, ids=[type(c[0]).__name__ for c in CASES])
async def test_typed_error_arrives_with_code_reason_and_metadata(
    serve_handlers: Any, raised: XavierError, code: grpc.StatusCode, reason: str
) -> None:
    async def fail(request: bytes, context: Any) -> bytes:
        raise raised

    handle = await serve_handlers({"Fail": grpc.unary_unary_rpc_method_handler(fail)})
    async with grpc.aio.insecure_channel(handle.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await channel.unary_unary(f"/{SERVICE}/Fail")(b"", timeout=5)
    err = caught.value
    assert err.code() == code
    assert err.details() == raised.message
    info = _error_info(err)
    assert info.domain == ERROR_DOMAIN
    assert info.reason == reason
    assert dict(info.metadata) == raised.metadata

    rebuilt = from_rpc_error(err)
    assert type(rebuilt) is type(raised)
    assert (rebuilt.code, rebuilt.reason, rebuilt.metadata, rebuilt.message) == (
        code,
        reason,
        raised.metadata,
        raised.message,
    )


async def test_streaming_error_after_items_and_abort_with(serve_handlers: Any) -> None:
    async def stream(request: bytes, context: Any) -> Any:
        yield b"1"
        yield b"2"
        raise LeaseExpired("gone", room_id="3")

    async def explicit(request: bytes, context: Any) -> bytes:
        await abort_with(context, NotFound("peer", reason="PEER_NOT_FOUND", peer_id="p"))
        return b"unreachable"

    handle = await serve_handlers(
        {
            "Stream": grpc.unary_stream_rpc_method_handler(stream),
            "Explicit": grpc.unary_unary_rpc_method_handler(explicit),
        }
    )
    received: list[bytes] = []
    async with grpc.aio.insecure_channel(handle.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for item in channel.unary_stream(f"/{SERVICE}/Stream")(b"", timeout=5):
                received.append(item)
        with pytest.raises(grpc.aio.AioRpcError) as caught_explicit:
            await channel.unary_unary(f"/{SERVICE}/Explicit")(b"", timeout=5)
    assert received == [b"1", b"2"]
    rebuilt = from_rpc_error(caught.value)
    assert isinstance(rebuilt, LeaseExpired) and rebuilt.metadata == {"room_id": "3"}
    explicit_err = from_rpc_error(caught_explicit.value)
    assert isinstance(explicit_err, NotFound) and explicit_err.reason == "PEER_NOT_FOUND"


async def test_unexpected_exception_is_internal_without_traceback(serve_handlers: Any) -> None:
    secret = "db password is hunter2"

    async def bug(request: bytes, context: Any) -> bytes:
        raise RuntimeError(secret)

    handle = await serve_handlers({"Bug": grpc.unary_unary_rpc_method_handler(bug)})
    async with grpc.aio.insecure_channel(handle.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await channel.unary_unary(f"/{SERVICE}/Bug")(b"", timeout=5)
    err = caught.value
    assert err.code() == grpc.StatusCode.INTERNAL
    text = f"{err.details()} {err.trailing_metadata()}"
    assert secret not in text and "Traceback" not in text and "RuntimeError" not in text
    rebuilt = from_rpc_error(err)
    assert isinstance(rebuilt, Internal) and rebuilt.reason == "INTERNAL"
    assert rebuilt.metadata["request_id"]


async def test_plain_status_without_details_becomes_generic(serve_handlers: Any) -> None:
    async def plain(request: bytes, context: Any) -> bytes:
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "too slow")
        return b""

    handle = await serve_handlers({"Plain": grpc.unary_unary_rpc_method_handler(plain)})
    async with grpc.aio.insecure_channel(handle.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await channel.unary_unary(f"/{SERVICE}/Plain")(b"", timeout=5)
    rebuilt = from_rpc_error(caught.value)
    assert isinstance(rebuilt, GenericError)
    assert (rebuilt.code, rebuilt.reason, rebuilt.message) == (
        grpc.StatusCode.DEADLINE_EXCEEDED,
        "DEADLINE_EXCEEDED",
        "too slow",
    )


def test_status_encoding_and_metadata_keys_that_shadow_parameters() -> None:
    err = NotFound("x", reason="ROOM_NOT_FOUND")
    err.metadata = {"message": "m", "reason": "r", "code": "c"}
    status = to_rpc_status(err, (("x-request-id", "abc"),))
    assert status.code == grpc.StatusCode.NOT_FOUND
    assert ("x-request-id", "abc") in status.trailing_metadata
    assert isinstance(status, grpc.Status)

    class FakeError(grpc.RpcError):  # type: ignore[misc,unused-ignore]
        def code(self) -> grpc.StatusCode:
            return status.code

        def details(self) -> str:
            return str(status.details)

        def trailing_metadata(self) -> Any:
            return status.trailing_metadata

    rebuilt = from_rpc_error(FakeError())
    assert isinstance(rebuilt, NotFound)
    assert rebuilt.metadata == {"message": "m", "reason": "r", "code": "c"}
    assert str(rebuilt) == "ROOM_NOT_FOUND: x"
