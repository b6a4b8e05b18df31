"""The asyncio client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from xavier.v1 import router_service_pb2 as rpb
from xavier.v1 import router_service_pb2_grpc as rpb_grpc

from xavier_client._errors import UnavailableError, XavierError, error_from_rpc
from xavier_client._options import (
    RetryPolicy,
    TlsOptions,
    call_metadata,
    channel_args,
    channel_credentials,
)
from xavier_client._types import Chunk, ClusterStatus, Completion, Mode, Prompt, Sampling, build_request

T = TypeVar("T")


class AsyncGenerateStream:
    """Async-iterates the chunks of one streamed answer; `cancel()` stops it."""

    def __init__(self, start: Callable[[], Any], policy: RetryPolicy, request_id: str) -> None:
        self.request_id = request_id
        self._start = start
        self._policy = policy
        self._call: Any = None
        self._cancelled = False

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        attempt = 1
        received = False
        while not self._cancelled:
            self._call = call = self._start()
            try:
                # read() directly: `async for` over the call adds an async generator of grpc's own.
                while (msg := await call.read()) is not grpc.aio.EOF:
                    received = True
                    yield Chunk.from_proto(msg)
                return
            except asyncio.CancelledError:
                if self._cancelled:  # our own cancel(): end quietly
                    return
                self._call.cancel()
                raise
            except grpc.RpcError as exc:
                if self._cancelled:
                    return
                err = error_from_rpc(exc)
                if received or not isinstance(err, UnavailableError) or attempt >= self._policy.max_attempts:
                    raise err from None
                await asyncio.sleep(self._policy.backoff(attempt))
                attempt += 1

    def cancel(self) -> None:
        """Cancels the call; iteration ends quietly."""
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()


class AsyncClient:
    """asyncio client of the Xavier router; same options and semantics as `Client`.

    >>> async with AsyncClient("127.0.0.1:50051") as client:
    ...     async for chunk in client.generate_stream("Hello", max_tokens=8):
    ...         print(chunk.text, end="")
    """

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        tls: TlsOptions | None = None,
        timeout: float = 120.0,
        retry: RetryPolicy | None = None,
        max_message_bytes: int = 16 * 1024 * 1024,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        options = channel_args(tls, max_message_bytes)
        creds = channel_credentials(tls, token)
        if creds is None:
            self._channel = grpc.aio.insecure_channel(address, options=options)
        else:
            self._channel = grpc.aio.secure_channel(address, creds, options=options)
        self._metadata = call_metadata(tls, token)
        self._stub = rpb_grpc.RouterServiceStub(self._channel)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes the channel."""
        await self._channel.close()

    async def _unary(self, fn: Callable[..., Awaitable[T]], request: Any, deadline: float | None) -> T:
        for attempt in range(1, self.retry.max_attempts + 1):
            try:
                return await fn(request, timeout=deadline or self.timeout, metadata=self._metadata)
            except grpc.RpcError as exc:
                err = error_from_rpc(exc)
                if not isinstance(err, UnavailableError) or attempt >= self.retry.max_attempts:
                    raise err from None
                await asyncio.sleep(self.retry.backoff(attempt))
        raise XavierError("retries exhausted")  # unreachable: the loop returns or raises

    def generate_stream(
        self,
        prompt: Prompt,
        *,
        model: str = "",
        mode: Mode | None = None,
        request_id: str | None = None,
        cache_salt: str = "",
        deadline: float | None = None,
        sampling: Sampling | None = None,
        **sampling_kw: Any,
    ) -> AsyncGenerateStream:
        """Starts a streamed answer; sampling fields may be given as keywords (max_tokens=..., ...)."""
        sampling = sampling or Sampling(**sampling_kw)
        req = build_request(
            prompt, sampling, model=model, mode=mode, request_id=request_id, cache_salt=cache_salt
        )
        deadline_s = deadline or self.timeout

        def start() -> Any:
            return self._stub.Generate(req, timeout=deadline_s, metadata=self._metadata)

        return AsyncGenerateStream(start, self.retry, req.request_id)

    async def generate(self, prompt: Prompt, **kw: Any) -> Completion:
        """Generates a whole answer (same arguments as `generate_stream`)."""
        out = Completion()
        async for chunk in self.generate_stream(prompt, **kw):
            out.add(chunk)
        return out

    async def abort(self, request_id: str, *, deadline: float | None = None) -> bool:
        """Aborts a live request by id; True when it was live."""
        resp = await self._unary(self._stub.Abort, rpb.AbortRequest(request_id=request_id), deadline)
        return bool(resp.found)

    async def list_models(self, *, deadline: float | None = None) -> list[rpb.Model]:
        """Every served model (follows pagination)."""
        models: list[rpb.Model] = []
        token = ""
        for _ in range(10_000):
            req = rpb.ListModelsRequest(page_size=100, page_token=token)
            resp = await self._unary(self._stub.ListModels, req, deadline)
            models.extend(resp.models)
            token = resp.next_page_token
            if not token:
                break
        return models

    async def cluster_status(self, *, deadline: float | None = None) -> ClusterStatus:
        """The router's load, each peer's public status (engine pages, rooms) and the room counters."""
        return await self._unary(self._stub.GetClusterStatus, rpb.GetClusterStatusRequest(), deadline)
