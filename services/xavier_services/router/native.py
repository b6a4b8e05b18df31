"""Native mode: SGLang's own prefill and decode servers (NIXL P/D) behind the same API.

SGLang's contract: the same `/generate` body goes to the prefill and the decode server, concurrently,
carrying `bootstrap_host`/`bootstrap_port` (the prefill's bootstrap server) and a random 63-bit
`bootstrap_room` pairing the two. The decode's streamed answer is the client's answer: server-sent
events `data: {...}` with cumulative `text` and `output_ids` and a `meta_info` whose `finish_reason`
is set on the last event, then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import aiohttp
from xavier.v1 import types_pb2

from xavier_core.runtime import FailedPrecondition, Internal, InvalidArgument, Unavailable
from xavier_services.router.config import NativeConfig
from xavier_services.router.flows import Step
from xavier_services.router.pair_call import PairCall, PrefillFailed, concurrently
from xavier_services.router.request import Prepared, new_room_id, require_features
from xavier_services.sglang_host.protocol import Deltas, generate_body, sse_events


def native_body(prep: Prepared, cfg: NativeConfig, room: int) -> dict[str, Any]:
    """The `/generate` body both servers get."""
    bootstrap = (cfg.bootstrap_host, cfg.bootstrap_port, room)
    return generate_body(prep.request_id, list(prep.token_ids), prep.sampling, bootstrap=bootstrap)


async def _raise_for(resp: aiohttp.ClientResponse, which: str) -> None:
    if resp.status == 200:
        return
    body = (await resp.text())[:500]
    if resp.status == 400:
        raise InvalidArgument(f"native {which} rejected the request: {body}", reason="NATIVE_REJECTED")
    raise Unavailable(f"native {which} answered HTTP {resp.status}: {body}", reason="NATIVE_UNAVAILABLE")


async def _drain_prefill(resp_cm: Any) -> None:
    async with resp_cm as resp:
        await _raise_for(resp, "prefill")
        async for _ in resp.content.iter_any():
            pass


async def _decode_events(resp_cm: Any) -> AsyncIterator[dict[str, Any]]:
    async with resp_cm as resp:
        await _raise_for(resp, "decode")
        async for event in sse_events(resp, "native decode"):
            yield event


async def native_flow(
    prep: Prepared, cfg: NativeConfig, session: aiohttp.ClientSession, timeout: float
) -> AsyncIterator[Step]:
    """Sends the request to both servers and streams the decode's answer as deltas (the concurrent
    order of `pair_call`: a failed prefill never fills the room, and the decode would wait out SGLang's
    bootstrap timeout, so the prefill's error ends the request at once)."""
    if not cfg.enabled:
        # The router's own configuration, not a passing state: asking again cannot help.
        raise FailedPrecondition(
            "native mode is not configured on this router (native.prefill_url, native.decode_url)",
            reason="INVALID_MODE",
            field="mode",
            param="xavier_mode",
        )
    require_features(prep, None, "native SGLang")  # native servers declare no features
    body = native_body(prep, cfg, new_room_id())  # SGLang keys its transfer state by it
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    client_timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=min(timeout, 10.0))

    def post(url: str) -> Any:
        return session.post(f"{url}/generate", json=body, headers=headers, timeout=client_timeout)

    with PairCall() as call:
        call.beside = asyncio.ensure_future(_drain_prefill(post(cfg.prefill_url)))
        deltas = Deltas()
        try:
            events = concurrently(call.beside, _decode_events(post(cfg.decode_url)))
            async with aclosing(events):  # type: ignore[type-var]
                async for event in events:
                    delta = deltas.next(event)
                    step = Step(delta.token_ids, delta.text, delta.logprobs, delta.finish)
                    if delta.finish:
                        step.cached_tokens = int(delta.meta.get("cached_tokens") or 0)
                        call.finished = True
                    yield step
                    if delta.finish:
                        return
            yield Step([], "", finish=types_pb2.FINISH_REASON_ABORT)
        except PrefillFailed as failed:
            if isinstance(failed.error, aiohttp.ClientError | TimeoutError):
                raise _unreachable("native prefill", failed.error, timeout) from None
            raise failed.error from None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _unreachable("native server", exc, timeout) from None
        except (ValueError, KeyError) as exc:
            raise Internal(f"native decode sent a malformed event: {exc}", reason="NATIVE_ERROR") from None


def _unreachable(who: str, exc: BaseException, timeout: float) -> Unavailable:
    """A failed connection, or no answer within the request's timeout (aiohttp raises a bare
    TimeoutError for that, which would otherwise leave the router unmapped)."""
    if isinstance(exc, TimeoutError) and not isinstance(exc, aiohttp.ClientError):
        return Unavailable(f"{who} did not answer within {timeout:.0f}s", reason="NATIVE_UNAVAILABLE")
    return Unavailable(f"{who} unreachable: {exc}", reason="NATIVE_UNAVAILABLE")


__all__ = ["native_body", "native_flow"]
