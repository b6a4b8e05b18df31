"""A protocol double of SGLang's prefill/decode `/generate` bootstrap contract (not SGLang itself).

It speaks only what the router relies on in native mode: both servers receive the same `/generate`
body with `bootstrap_host`, `bootstrap_port` and a 63-bit `bootstrap_room`; the prefill server registers
the room (as SGLang's bootstrap server would) and the decode server refuses to answer a room the prefill
never saw, then streams `data: {...}` events with cumulative `text` and `output_ids`, `meta_info` with
`finish_reason` on the last event, and `data: [DONE]`. Tokens are deterministic: `(last id + 1) % 50`,
rendered as `t<id> `.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

_ROOM_WAIT_SECONDS = 5.0


@dataclass
class DoubleState:
    """What the double saw: the bodies each side got, rooms prefilled, decodes aborted by disconnect."""

    prefill_bodies: list[dict[str, Any]] = field(default_factory=list)
    decode_bodies: list[dict[str, Any]] = field(default_factory=list)
    rooms: dict[int, asyncio.Event] = field(default_factory=dict)
    disconnects: int = 0
    token_delay: float = 0.0
    prefill_status: int = 200  # any other status: the prefill fails with it (the room never fills)
    waits_cancelled: int = 0  # decodes whose client left while they waited for their room


def _check_bootstrap(body: dict[str, Any]) -> str | None:
    room = body.get("bootstrap_room")
    if not isinstance(room, int) or not 0 <= room < 2**63:
        return "bootstrap_room must be a 63-bit integer"
    if not isinstance(body.get("bootstrap_host"), str) or not isinstance(body.get("bootstrap_port"), int):
        return "bootstrap_host and bootstrap_port are required"
    if not body.get("input_ids") and not body.get("text"):
        return "input_ids or text is required"
    return None


class SglangDouble:
    """Two HTTP servers (prefill, decode) on 127.0.0.1:0 in a background thread."""

    def __init__(self) -> None:
        self.state = DoubleState()
        self.loop = asyncio.new_event_loop()
        self.prefill_url = ""
        self.decode_url = ""
        self._runners: list[web.AppRunner] = []

    def _room(self, room: int) -> asyncio.Event:
        return self.state.rooms.setdefault(room, asyncio.Event())

    async def _prefill(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.state.prefill_bodies.append(body)
        problem = _check_bootstrap(body)
        if problem:
            return web.json_response({"error": {"message": problem}}, status=400)
        if self.state.prefill_status != 200:
            failure = {"error": {"message": "prefill failed"}}
            return web.json_response(failure, status=self.state.prefill_status)
        self._room(body["bootstrap_room"]).set()
        meta = {
            "id": body.get("rid"),
            "finish_reason": {"type": "length"},
            "prompt_tokens": len(body["input_ids"]),
        }
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(
            f"data: {json.dumps({'text': '', 'output_ids': [], 'meta_info': meta})}\n\n".encode()
        )
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _decode(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.state.decode_bodies.append(body)
        problem = _check_bootstrap(body)
        if problem:
            return web.json_response({"error": {"message": problem}}, status=400)
        try:
            await asyncio.wait_for(self._room(body["bootstrap_room"]).wait(), _ROOM_WAIT_SECONDS)
        except TimeoutError:
            return web.json_response({"error": {"message": "no prefill for this bootstrap_room"}}, status=500)
        except asyncio.CancelledError:
            self.state.waits_cancelled += 1
            raise
        params = body.get("sampling_params") or {}
        max_new = int(params.get("max_new_tokens", 16))
        ids: list[int] = []
        last = body["input_ids"][-1]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(max_new):
                last = (last + 1) % 50
                ids.append(last)
                done = i == max_new - 1
                meta = {
                    "id": body.get("rid"),
                    "finish_reason": {"type": "length", "length": max_new} if done else None,
                    "prompt_tokens": len(body["input_ids"]),
                    "completion_tokens": len(ids),
                    "cached_tokens": 0,
                }
                event = {"text": "".join(f"t{t} " for t in ids), "output_ids": list(ids), "meta_info": meta}
                await resp.write(f"data: {json.dumps(event)}\n\n".encode())
                if self.state.token_delay:
                    await asyncio.sleep(self.state.token_delay)
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.state.disconnects += 1
            raise
        return resp

    async def _start(self) -> None:
        for name, handler in (("prefill", self._prefill), ("decode", self._decode)):
            app = web.Application()
            app.router.add_post("/generate", handler)
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self._runners.append(runner)
            url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            setattr(self, f"{name}_url", url)

    def __enter__(self) -> SglangDouble:
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self._start())
            ready.set()
            self.loop.run_forever()

        self._thread = threading.Thread(target=run, name="sglang-double", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the SGLang protocol double did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            for runner in self._runners:
                await runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
