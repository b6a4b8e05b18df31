"""Native mode: SGLang's own prefill and decode servers (NIXL P/D) behind the same API.

SGLang's contract: the same `/generate` body goes to the prefill and the decode server, concurrently,
carrying `bootstrap_host`/`bootstrap_port` (the prefill's bootstrap server) and a random 63-bit
`bootstrap_room` pairing the two. The decode's streamed answer is the client's answer: server-sent
events `data: {...}` with cumulative `text` and `output_ids` and a `meta_info` whose `finish_reason`
is set on the last event, then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from xavier.v1 import types_pb2

from xavier_core.runtime import Internal, InvalidArgument, Unavailable
from xavier_services.router.config import NativeConfig
from xavier_services.router.flows import Step
from xavier_services.router.request import Prepared

_FINISH = {
    "stop": types_pb2.FINISH_REASON_STOP,
    "length": types_pb2.FINISH_REASON_LENGTH,
    "abort": types_pb2.FINISH_REASON_ABORT,
}
_MAX_LINE = 1 << 20
_PREFILL_FAILED = "native prefill failed"


def new_bootstrap_room() -> int:
    """A random 63-bit room id (SGLang keys its transfer state by it)."""
    return secrets.randbits(63)


def native_body(prep: Prepared, cfg: NativeConfig, room: int) -> dict[str, Any]:
    """The `/generate` body both servers get."""
    s = prep.sampling
    params: dict[str, Any] = {
        "max_new_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p if s.top_p > 0 else 1.0,
        "ignore_eos": s.ignore_eos,
    }
    if s.top_k:
        params["top_k"] = s.top_k
    if s.stop:
        params["stop"] = list(s.stop)
    if s.stop_token_ids:
        params["stop_token_ids"] = list(s.stop_token_ids)
    if s.HasField("seed"):
        params["sampling_seed"] = s.seed
    return {
        "rid": prep.request_id,
        "input_ids": list(prep.token_ids),
        "sampling_params": params,
        "stream": True,
        "return_logprob": s.logprobs,
        "bootstrap_host": cfg.bootstrap_host,
        "bootstrap_port": cfg.bootstrap_port,
        "bootstrap_room": room,
    }


def _finish_of(meta: dict[str, Any]) -> int:
    reason = meta.get("finish_reason")
    if isinstance(reason, dict):
        reason = reason.get("type")
    return _FINISH.get(str(reason), types_pb2.FINISH_REASON_STOP) if reason else 0


def _logprobs_of(meta: dict[str, Any]) -> list[float]:
    # SGLang: output_token_logprobs = [[logprob, token_id, text], ...] (cumulative).
    items = meta.get("output_token_logprobs") or []
    return [float(x[0]) for x in items if isinstance(x, list | tuple) and x]


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


async def native_flow(
    prep: Prepared, cfg: NativeConfig, session: aiohttp.ClientSession, timeout: float
) -> AsyncIterator[Step]:
    """Sends the request to both servers and streams the decode's answer as deltas."""
    if not cfg.enabled:
        raise Unavailable("native mode is not configured", reason="NO_PEERS", mode="native")
    body = native_body(prep, cfg, new_bootstrap_room())
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    client_timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=min(timeout, 10.0))
    prefill = asyncio.ensure_future(
        _drain_prefill(
            session.post(f"{cfg.prefill_url}/generate", json=body, headers=headers, timeout=client_timeout)
        )
    )
    # A failed prefill never fills the room, and the decode would wait out SGLang's bootstrap timeout:
    # stop reading the decode at once and answer with the prefill's error instead.
    me = asyncio.current_task()

    def _prefill_ended(fut: asyncio.Future[None]) -> None:
        if me is not None and not me.done() and not fut.cancelled() and fut.exception() is not None:
            me.cancel(msg=_PREFILL_FAILED)

    prefill.add_done_callback(_prefill_ended)
    ids_sent = 0
    text_sent = 0
    lps_sent = 0
    try:
        decode_url = f"{cfg.decode_url}/generate"
        async with session.post(decode_url, json=body, headers=headers, timeout=client_timeout) as resp:
            await _raise_for(resp, "decode")
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise Internal(f"native decode failed: {event['error']}", reason="NATIVE_ERROR")
                meta = event.get("meta_info") or {}
                ids = list(event.get("output_ids") or [])
                text = str(event.get("text") or "")
                lps = _logprobs_of(meta)
                finish = _finish_of(meta)
                step = Step(ids[ids_sent:], text[text_sent:], lps[lps_sent:], finish)
                ids_sent, text_sent, lps_sent = len(ids), len(text), len(lps)
                if finish:
                    step.cached_tokens = int(meta.get("cached_tokens") or 0)
                yield step
                if finish:
                    return
        yield Step([], "", finish=types_pb2.FINISH_REASON_ABORT)
    except asyncio.CancelledError:
        failed = prefill.done() and not prefill.cancelled() and prefill.exception() is not None
        if not failed or me is None:
            raise
        me.uncancel()
        err = prefill.exception()
        if isinstance(err, aiohttp.ClientError):
            raise Unavailable(f"native prefill unreachable: {err}", reason="NATIVE_UNAVAILABLE") from None
        raise err from None  # type: ignore[misc]
    except aiohttp.ClientError as exc:
        raise Unavailable(f"native server unreachable: {exc}", reason="NATIVE_UNAVAILABLE") from None
    except (ValueError, KeyError) as exc:
        raise Internal(f"native decode sent a malformed event: {exc}", reason="NATIVE_ERROR") from None
    finally:
        prefill.remove_done_callback(_prefill_ended)
        if prefill.done():
            with contextlib.suppress(Exception, asyncio.CancelledError):
                prefill.result()
        else:
            prefill.cancel()


__all__ = ["native_body", "native_flow", "new_bootstrap_room"]
