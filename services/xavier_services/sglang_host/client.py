"""The service's HTTP client of its own SGLang server, with SGLang's answers mapped to Xavier errors.

Cancelling a call closes its HTTP connection, which SGLang takes as an abort of the request (its
`/generate` handler aborts the request when the client disconnects).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from xavier_core.runtime.errors import CapacityExhausted, Internal, InvalidArgument, Unavailable, XavierError
from xavier_services.sglang_host.protocol import Delta, Deltas, sse_events

__all__ = ["SglangHttp", "http_error"]


def http_error(status: int, body: str, who: str = "SGLang") -> XavierError:
    """The Xavier error for a non-200 answer of SGLang's `/generate`."""
    detail = body.strip()[:500]
    if status == 400:
        return InvalidArgument(f"{who} rejected the request: {detail}", reason="INVALID_REQUEST")
    if status in (401, 403):
        return Internal(f"{who} refused the service's API key ({status})", reason="ENGINE_ERROR")
    if status == 429:
        return CapacityExhausted(f"{who} is overloaded: {detail}", reason="ENGINE_QUEUE_FULL")
    if status == 503:
        return Unavailable(f"{who} is not serving: {detail}", reason="PEER_UNAVAILABLE")
    return Internal(f"{who} answered HTTP {status}: {detail}", reason="ENGINE_ERROR")


class SglangHttp:
    """`/generate` on one SGLang server (loopback, with its API key)."""

    def __init__(self, url: str, api_key: str, timeout: float) -> None:
        self.url = url
        self._headers = {"Authorization": f"Bearer {api_key}"}
        self._timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=10.0)
        # One connection per request: a request's connection closing is how SGLang learns of a cancel.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def close(self) -> None:
        await self.session.close()

    async def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        """A non-streamed `/generate` (the prefill's: it ends once the decode took the KV)."""
        try:
            async with self.session.post(
                f"{self.url}/generate",
                json={**body, "stream": False},
                headers=self._headers,
                timeout=self._timeout,
            ) as resp:
                if resp.status != 200:
                    raise http_error(resp.status, await resp.text())
                answer = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _unreachable(exc, self._timeout) from None
        if not isinstance(answer, dict):
            raise Internal(f"SGLang answered {type(answer).__name__}, not an object", reason="ENGINE_ERROR")
        if "error" in answer:
            raise Internal(f"SGLang failed: {answer['error']}", reason="ENGINE_ERROR")
        return answer

    async def load(self, timeout: float) -> dict[str, Any]:
        """The load report of SGLang's (one) rank: `GET /v1/loads?include=core` (`stats` reads it)."""
        try:
            async with self.session.get(
                f"{self.url}/v1/loads",
                params={"include": "core"},
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as resp:
                if resp.status != 200:
                    raise http_error(resp.status, await resp.text())
                answer = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise Unavailable(f"SGLang is not reachable: {exc!r}", reason="PEER_UNAVAILABLE") from None
        loads = answer.get("loads") if isinstance(answer, dict) else None
        if not isinstance(loads, list) or len(loads) != 1 or not isinstance(loads[0], dict):
            raise Internal("SGLang's /v1/loads did not report exactly one rank", reason="ENGINE_ERROR")
        return dict(loads[0])

    async def release(self, timeout: float) -> str:
        """SGLang's version from `GET /server_info` ("" when it does not answer with one)."""
        try:
            async with self.session.get(
                f"{self.url}/server_info", headers=self._headers, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                answer = await resp.json(content_type=None) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return ""
        version = answer.get("version") if isinstance(answer, dict) else None
        return version if isinstance(version, str) else ""

    async def stream(self, body: dict[str, Any]) -> AsyncIterator[Delta]:
        """A streamed `/generate` as deltas; leaving early (cancel) closes the connection: SGLang aborts."""
        resp: aiohttp.ClientResponse | None = None
        deltas = Deltas()
        try:
            resp = await self.session.post(
                f"{self.url}/generate",
                json={**body, "stream": True},
                headers=self._headers,
                timeout=self._timeout,
            )
            if resp.status != 200:
                raise http_error(resp.status, await resp.text())
            async for event in sse_events(resp, "SGLang"):
                delta = deltas.next(event)
                yield delta
                if delta.finish:
                    return
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _unreachable(exc, self._timeout) from None
        finally:
            if resp is not None:
                resp.close()  # an unfinished stream's connection is dropped, not pooled


def _unreachable(exc: Exception, timeout: aiohttp.ClientTimeout) -> Unavailable:
    """A connection that failed, or a request past `sglang.request_timeout_seconds` (aiohttp raises a
    bare TimeoutError for that, which would otherwise leave the servicer as an unmapped INTERNAL)."""
    if isinstance(exc, TimeoutError) and not isinstance(exc, aiohttp.ClientError):
        why = f"did not finish the request within {timeout.total:.0f}s (sglang.request_timeout_seconds)"
        return Unavailable(f"SGLang {why}", reason="PEER_UNAVAILABLE")
    return Unavailable(f"SGLang is not reachable: {exc}", reason="PEER_UNAVAILABLE")
