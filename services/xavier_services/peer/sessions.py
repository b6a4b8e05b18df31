"""The session RPCs of the peer services: the calls of `PrefillSession` and `DecodeSession` run on the
servicers' own `Prefill`, `ReleaseSource` and `Decode` (`xavier_core.runtime.session`), for the
reference engine's services and the SGLang host's alike."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from xavier.v1 import decode_service_pb2 as dpb
from xavier.v1 import prefill_service_pb2 as ppb

from xavier_core.runtime.session import SessionMethod, serve_session

_PREFILL = "/xavier.v1.PrefillService/"
_DECODE = "/xavier.v1.DecodeService/"
_ROUTER = ("router",)

Handler = Callable[[Any, Any], Any]


async def prefill_session(
    requests: AsyncIterator[ppb.PrefillSessionRequest],
    context: Any,
    prefill: Handler,
    release_source: Handler | None = None,
) -> None:
    """Serves a PrefillSession on `prefill` (and `release_source`, where the service has one: a call of
    a method it lacks ends UNIMPLEMENTED, as the RPC would)."""
    methods = [SessionMethod("prefill", _PREFILL + "Prefill", prefill)]
    if release_source is not None:
        methods.append(SessionMethod("release_source", _PREFILL + "ReleaseSource", release_source))
    await serve_session(
        requests,
        context,
        rpc="PrefillSession",
        roles=_ROUTER,
        methods=methods,
        result=ppb.PrefillSessionResult,
        response=ppb.PrefillSessionResponse,
    )


async def decode_session(
    requests: AsyncIterator[dpb.DecodeSessionRequest], context: Any, decode: Handler
) -> None:
    """Serves a DecodeSession on `decode`."""
    await serve_session(
        requests,
        context,
        rpc="DecodeSession",
        roles=_ROUTER,
        methods=[SessionMethod("decode", _DECODE + "Decode", decode, streaming=True, ends=_finishes)],
        result=dpb.DecodeSessionResult,
        response=dpb.DecodeSessionResponse,
    )


def _finishes(msg: dpb.DecodeResponse) -> bool:
    """A Decode stream's finishing message (its finish reason set) is its last: the router stops there."""
    return bool(msg.finish_reason)
