"""A STAND-IN for an SGLang server (`python -m sglang.launch_server`), not SGLang: the subset of its
command line and HTTP API that a Xavier service hosting SGLang uses, for CI machines where SGLang cannot
run. Run as `python -m tests.support.sglang_standin ARGS...` (the service's `sglang.command`).

- Command line: parsed the way SGLang's argparse would (`allow_abbrev`, choices, unknown flags exit 2
  with a usage error); `--disaggregation-transfer-backend xavier` is a choice only with SGLANG_PLUGINS
  naming the xavier plugin, as the plugin widens the choices.
- `GET /health`: 200 once up (after XAVIER_STANDIN_START_DELAY seconds). `POST /generate` needs
  `Authorization: Bearer <--api-key>`; `input_ids`, `sampling_params`, `stream`, `rid`; streamed answers
  are `data: {...}` events with cumulative `text` / `output_ids` and `meta_info.finish_reason`, then
  `data: [DONE]`. Tokens are deterministic: next = (prev * 7 + 3) % 97, text `t<id> `.
- P/D (`--disaggregation-mode prefill|decode`): as with SGLang, the prefill's `/generate` answers only
  once the decode took the "KV" (a rendezvous file per `bootstrap_room` under XAVIER_STANDIN_DIR carries
  the first token); the decode streams from the first token. With the xavier backend the process
  registers with the directory like the plugin's KV manager (role, the advertised address and peer id
  read by the plugin's own `XavierSettings`, an "sglang" layout with the plugin's features, an
  endpoint) and the decode checks that a prefill is registered at `bootstrap_host:bootstrap_port`, as
  the plugin's lookup does; otherwise the request ends in an abort.
- Like SGLang it forks a helper process (its schedulers) that dies with it (PR_SET_PDEATHSIG).
- XAVIER_STANDIN_GENERATE_STATUS=N makes every `/generate` answer HTTP N with an error body (after
  XAVIER_STANDIN_FAIL_AFTER seconds).
- `GET /v1/loads?include=core`: SGLang's load report of its one rank (`num_running_reqs`,
  `num_waiting_reqs`, `num_used_tokens` = prompt + max new tokens of the requests open,
  `max_total_num_tokens` = XAVIER_STANDIN_MAX_TOKENS or 4096); 404 with XAVIER_STANDIN_NO_LOADS=1.
- `POST /standin/health?ok=0|1` makes `/health` answer 503 or 200.
- `GET /server_info`: `{"version": XAVIER_STANDIN_VERSION or "0.5.23"}` (SGLang's answer has many more
  fields); 404 with XAVIER_STANDIN_VERSION=none.
- `GET /standin/state`: its argv, environment, helper pid and counters, the salt fields
  (`cache_salt`, `extra_key`) of the last `/generate`, and its `sampling_params` (with
  `top_logprobs_num` and `logprob_start_len` when given), for the tests. The controls are not applied.
- Logprobs in SGLang's `meta_info` shape, deterministic per token so that a pair's and a unified
  server's agree: with `return_logprob`, `output_token_logprobs` (`[logprob, id, None]`) and, with
  `top_logprobs_num` k, `output_top_logprobs` (k alternatives per token, the chosen one first); with
  `logprob_start_len` 0 also `input_token_logprobs` (the first None) and `input_top_logprobs`. As
  SGLang's, a decode sends no prompt logprobs and a prefill sends them in its answer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from aiohttp import web

_BACKENDS = ["mooncake", "nixl", "ascend", "fake", "mori"]
_STARTED_AT = time.time()
# A child that dies with its parent, as SGLang's do (PR_SET_PDEATHSIG). A parent already gone before the
# prctl took effect never signals it: the child checks that its parent is still the one that started it.
_HELPER = (
    "import ctypes,os,signal,sys,time; ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0); "
    "os.getppid() == int(sys.argv[1]) or os._exit(0); time.sleep(3600)"
)


def parser() -> argparse.ArgumentParser:
    backends = [*_BACKENDS]
    if "xavier" in os.environ.get("SGLANG_PLUGINS", "").split(","):
        backends.append("xavier")
    p = argparse.ArgumentParser(prog="sglang-standin")  # allow_abbrev, as SGLang's
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument(
        "--dtype", default="auto", choices=["auto", "half", "float16", "bfloat16", "float", "float32"]
    )
    p.add_argument("--base-gpu-id", type=int, default=0)
    p.add_argument("--disaggregation-mode", default="null", choices=["null", "prefill", "decode"])
    p.add_argument("--disaggregation-transfer-backend", default="mooncake", choices=backends)
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument(
        "--grammar-backend", default="xgrammar", choices=["xgrammar", "outlines", "llguidance", "none"]
    )
    p.add_argument("--constrained-json-disable-any-whitespace", action="store_true")
    p.add_argument("--enable-hierarchical-cache", action="store_true")
    p.add_argument("--hicache-storage-backend", default=None, choices=["file", "mooncake", "dynamic", "nixl"])
    p.add_argument("--hicache-storage-backend-extra-config", default=None)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--skip-tokenizer-init", action="store_true")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--log-level", default="info")
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--lora-paths", nargs="*", default=None)
    return p


def next_token(prev: int) -> int:
    return (prev * 7 + 3) % 97


def alternatives(token: int, k: int) -> list[list[Any]]:
    """The stand-in's k most likely tokens where `token` was chosen (or stands in the prompt)."""
    return [[token_logprob(token) - j, (token + j) % 97, None] for j in range(k)]


def token_logprob(token: int) -> float:
    return -0.5 - (token % 5) / 8


def logprob_meta(body: dict[str, Any], mode: str, prompt: list[int], out: list[int]) -> dict[str, Any]:
    """The logprob keys of `meta_info` (SGLang's `add_logprob_to_meta_info`) for a request of `body`."""
    if not body.get("return_logprob"):
        return {}
    k = int(body.get("top_logprobs_num") or 0)
    meta: dict[str, Any] = {"output_token_logprobs": [[token_logprob(t), t, None] for t in out]}
    if k:
        meta["output_top_logprobs"] = [alternatives(t, k) for t in out]
    with_prompt = body.get("logprob_start_len") == 0 and mode != "decode"
    meta["input_token_logprobs"] = (
        [[None, prompt[0], None]] + [[token_logprob(t) - 1, t, None] for t in prompt[1:]]
        if with_prompt
        else []
    )
    if k:
        meta["input_top_logprobs"] = [None] + [alternatives(t, k) for t in prompt[1:]] if with_prompt else []
    return meta


class Standin:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.mode = args.disaggregation_mode
        self.xavier = self.mode != "null" and args.disaggregation_transfer_backend == "xavier"
        self.rendezvous = Path(
            os.environ.get("XAVIER_STANDIN_DIR") or Path(tempfile.gettempdir()) / "standin"
        )
        self.rendezvous.mkdir(parents=True, exist_ok=True)
        self.token_delay = float(os.environ.get("XAVIER_STANDIN_TOKEN_DELAY") or 0)
        self.wait_s = float(os.environ.get("XAVIER_STANDIN_RENDEZVOUS_SECONDS") or 10)
        self.counters = {"requests": 0, "aborted": 0, "bad_key": 0}
        self.held: dict[int, int] = {}  # request -> KV tokens it holds (prompt + max new), for /v1/loads
        self.max_tokens = int(os.environ.get("XAVIER_STANDIN_MAX_TOKENS") or 4096)
        self.healthy = True
        self.last_salt: dict[str, Any] = {}
        self.last_sampling: dict[str, Any] = {}
        self.helper = subprocess.Popen([sys.executable, "-c", _HELPER, str(os.getpid())])
        self.session: Any = None
        self.directory: Any = None

    # --- the xavier plugin's part: registration and the decode's prefill lookup ----------------

    async def register(self) -> None:
        from xavier.v1 import directory_service_pb2 as dpb
        from xavier.v1 import types_pb2
        from xavier_sglang.config import XavierSettings
        from xavier_sglang.features import declare

        from xavier_core.contract import layout_from_model_dir
        from xavier_core.directory import DirectoryClient, PeerSession

        # The plugin's own parser of what the service hands it (directory, address, peer id).
        settings = XavierSettings.from_env(default_advertise="")
        if settings.tls is not None:  # as the plugin's hub: the service's own certificate
            from xavier_core.runtime.channels import use_client_tls

            use_client_tls(settings.tls)
        self.directory = DirectoryClient(settings.directory)
        dtype = "float32" if self.args.dtype in ("float", "float32") else "float16"
        layout = layout_from_model_dir(
            Path(self.args.model_path),
            engine="sglang",
            engine_version="standin",
            dtype=dtype,
            page_size=self.args.page_size,
        )
        endpoint = types_pb2.TransferEndpoint(
            kind=types_pb2.TRANSPORT_KIND_NIXL,
            agent_name=f"standin-{os.getpid()}",
            agent_metadata=b"standin",
            host_id="standin",
            regions=[
                types_pb2.MemoryRegion(base_address=4096, length=1 << 20, device="cpu", bytes_per_page=4096)
            ],
        )
        role = types_pb2.ROLE_PREFILL if self.mode == "prefill" else types_pb2.ROLE_DECODE
        request = dpb.RegisterPeerRequest(
            peer_id=settings.peer_id,
            role=role,
            address=settings.advertise,
            layout=declare(layout.to_proto(), role, settings.call_sessions),  # as the plugin's hub does
            endpoint=endpoint,
        )
        self.session = PeerSession(self.directory, request)
        await self.session.start()

    async def prefill_registered(self, address: str) -> bool:
        from xavier.v1 import types_pb2

        peers = await self.directory.list_peers(types_pb2.ROLE_PREFILL)
        return any(p.address == address for p in peers)

    # --- HTTP ----------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if not self.healthy:
            return web.Response(status=503, text="unhealthy")
        return web.Response(text="ok")

    async def server_info(self, request: web.Request) -> web.Response:
        version = os.environ.get("XAVIER_STANDIN_VERSION") or "0.5.23"
        if version == "none":
            return web.Response(status=404, text="not found")
        return web.json_response({"version": version})

    async def set_health(self, request: web.Request) -> web.Response:
        self.healthy = request.query.get("ok") == "1"
        return web.Response(text="ok")

    async def state(self, request: web.Request) -> web.Response:
        keys = ("SGLANG_PLUGINS", "XAVIER_DIRECTORY", "XAVIER_SGLANG_ADVERTISE", "XAVIER_SGLANG_PEER_ID",
                "CUDA_VISIBLE_DEVICES", "XAVIER_TLS__CERT_FILE")  # fmt: skip
        return web.json_response(
            {
                "argv": sys.argv[1:],
                "env": {k: os.environ[k] for k in keys if k in os.environ},
                "pid": os.getpid(),
                "started_at": _STARTED_AT,
                "helper_pid": self.helper.pid,
                "last_salt": self.last_salt,
                "last_sampling": self.last_sampling,
                **self.counters,
            }
        )

    async def generate(self, request: web.Request) -> web.StreamResponse:
        if self.args.api_key and request.headers.get("Authorization") != f"Bearer {self.args.api_key}":
            self.counters["bad_key"] += 1
            return web.json_response({"error": {"message": "Unauthorized"}}, status=401)
        body = await request.json()
        self.counters["requests"] += 1
        self.last_salt = {k: body[k] for k in ("cache_salt", "extra_key") if k in body}
        logprob_keys = ("top_logprobs_num", "logprob_start_len")
        self.last_sampling = {
            **(body.get("sampling_params") or {}),
            **{k: body[k] for k in logprob_keys if k in body},
        }
        status = int(os.environ.get("XAVIER_STANDIN_GENERATE_STATUS") or 200)
        if status != 200:  # a server that refuses every request (the tests' failure injection)
            await asyncio.sleep(float(os.environ.get("XAVIER_STANDIN_FAIL_AFTER") or 0))
            return web.json_response({"error": {"message": f"stand-in answers {status}"}}, status=status)
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids:
            return web.json_response({"error": {"message": "input_ids is required"}}, status=400)
        params = body.get("sampling_params") or {}
        max_new = int(params.get("max_new_tokens", 16))
        if max_new < 0:
            return web.json_response({"error": {"message": "max_new_tokens must be >= 0"}}, status=400)
        if self.mode != "null":
            room = body.get("bootstrap_room")
            if not isinstance(room, int) or not isinstance(body.get("bootstrap_port"), int):
                return web.json_response({"error": {"message": "bootstrap_room/port required"}}, status=400)
        key = id(request)
        self.held[key] = len(ids) + max_new
        try:
            return await self._serve(request, body, ids, params, max_new)
        finally:
            del self.held[key]

    async def _serve(
        self, request: web.Request, body: dict[str, Any], ids: list[int], params: dict[str, Any], max_new: int
    ) -> web.StreamResponse:
        if self.mode == "prefill":
            return await self._prefill(body, ids)
        meta = {"id": body.get("rid"), "prompt_tokens": len(ids), "cached_tokens": 0}
        if self.mode == "decode":
            first = await self._take(body)
            if isinstance(first, str):
                return await self._respond(request, body, [], {**meta, "finish_reason": _abort(first)})
            tokens = self._continue(first, max_new, params)
        else:
            tokens = self._continue(next_token(ids[-1]), max_new, params)
        return await self._respond(request, body, tokens, meta)

    async def loads(self, request: web.Request) -> web.Response:
        """SGLang's `/v1/loads` (`include=core`) for one rank: requests and KV tokens held of the pool."""
        if self.args.api_key and request.headers.get("Authorization") != f"Bearer {self.args.api_key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        if os.environ.get("XAVIER_STANDIN_NO_LOADS"):  # a server without the endpoint
            return web.json_response({"detail": "Not Found"}, status=404)
        used = min(self.max_tokens, sum(self.held.values()))
        core = {
            "dp_rank": 0,
            "num_running_reqs": len(self.held),
            "num_waiting_reqs": 0,
            "num_used_tokens": used,
            "max_total_num_tokens": self.max_tokens,
            "token_usage": round(used / self.max_tokens, 4),
        }
        return web.json_response({"version": "standin", "loads": [core]})

    def _continue(self, first: int, max_new: int, params: dict[str, Any]) -> list[int]:
        stop = set(params.get("stop_token_ids") or [])
        tokens = [first]
        while len(tokens) < max_new and tokens[-1] not in stop:
            tokens.append(next_token(tokens[-1]))
        return tokens

    async def _prefill(self, body: dict[str, Any], ids: list[int]) -> web.Response:
        room = body["bootstrap_room"]
        first = next_token(ids[-1])
        tmp = self.rendezvous / f"{room}.first.tmp"
        tmp.write_text(str(first))
        tmp.rename(self.rendezvous / f"{room}.first")
        taken = self.rendezvous / f"{room}.taken"
        meta: dict[str, Any] = {"id": body.get("rid"), "prompt_tokens": len(ids), "cached_tokens": 0}
        try:
            deadline = time.monotonic() + self.wait_s
            while not taken.exists():
                if time.monotonic() > deadline:
                    meta["finish_reason"] = _abort("timed out waiting for the decode to take the KV")
                    return web.json_response({"text": "", "output_ids": [], "meta_info": meta})
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            self.counters["aborted"] += 1
            raise
        meta["finish_reason"] = {"type": "length", "length": 1}
        meta.update(logprob_meta(body, self.mode, ids, [first]))
        return web.json_response({"text": f"t{first} ", "output_ids": [first], "meta_info": meta})

    async def _take(self, body: dict[str, Any]) -> int | str:
        """The first token of the room (the KV "transfer"), or why it failed."""
        room = body["bootstrap_room"]
        if self.xavier:
            address = f"{body.get('bootstrap_host')}:{body.get('bootstrap_port')}"
            if not await self.prefill_registered(address):
                return f"no xavier prefill is registered at {address}"
        first = self.rendezvous / f"{room}.first"
        deadline = time.monotonic() + self.wait_s
        try:
            while not first.exists():
                if time.monotonic() > deadline:
                    return "KV transfer failed: the prefill never sent this room"
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            self.counters["aborted"] += 1
            raise
        (self.rendezvous / f"{room}.taken").write_text("")
        return int(first.read_text())

    async def _respond(
        self, request: web.Request, body: dict[str, Any], tokens: list[int], meta: dict[str, Any]
    ) -> web.StreamResponse:
        max_new = int((body.get("sampling_params") or {}).get("max_new_tokens", 16))

        def event(n: int) -> dict[str, Any]:
            done = n == len(tokens)
            m = {**meta, "completion_tokens": n}
            if done and "finish_reason" not in m:
                stop = len(tokens) < max_new
                m["finish_reason"] = {"type": "stop"} if stop else {"type": "length", "length": max_new}
            m.update(logprob_meta(body, self.mode, body["input_ids"], tokens[:n]))
            return {"text": "".join(f"t{t} " for t in tokens[:n]), "output_ids": tokens[:n], "meta_info": m}

        if not body.get("stream"):
            return web.json_response(event(len(tokens)))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for n in range(1, len(tokens) + 1) if tokens else [0]:
                await resp.write(f"data: {json.dumps(event(n))}\n\n".encode())
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.counters["aborted"] += 1
            raise
        return resp


def _abort(message: str) -> dict[str, Any]:
    return {"type": "abort", "message": message, "status_code": 500}


async def serve(args: argparse.Namespace) -> None:
    delay = float(os.environ.get("XAVIER_STANDIN_START_DELAY") or 0)
    standin = Standin(args)
    try:
        if standin.xavier:
            await standin.register()
        await asyncio.sleep(delay)
        app = web.Application()
        app.router.add_get("/health", standin.health)
        app.router.add_get("/standin/state", standin.state)
        app.router.add_post("/standin/health", standin.set_health)
        app.router.add_post("/generate", standin.generate)
        app.router.add_get("/v1/loads", standin.loads)
        app.router.add_get("/server_info", standin.server_info)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, args.host, args.port).start()
        print(f"stand-in serving on {args.host}:{args.port} ({standin.mode})", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        if os.environ.get("XAVIER_STANDIN_IGNORE_SIGTERM"):
            loop.add_signal_handler(signal.SIGTERM, lambda: print("SIGTERM ignored", flush=True))
        else:
            loop.add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await runner.cleanup()
    finally:
        if standin.session is not None:
            with contextlib.suppress(Exception):
                await standin.session.stop(unregister=True)
        standin.helper.kill()


def main() -> int:
    args = parser().parse_args()  # exits 2 with a usage error on anything SGLang would refuse
    exit_code = os.environ.get("XAVIER_STANDIN_EXIT_AT_START")
    if exit_code:
        print("stand-in: failing at start as asked (XAVIER_STANDIN_EXIT_AT_START)", file=sys.stderr)
        return int(exit_code)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
