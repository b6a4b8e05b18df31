"""A mesh of unified replicas sharing one page store, all real processes (directory, store, replicas)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from xavier.v1 import decode_service_pb2 as dec
from xavier.v1 import decode_service_pb2_grpc as dec_grpc
from xavier.v1 import prefill_service_pb2 as pre
from xavier.v1 import prefill_service_pb2_grpc as pre_grpc
from xavier.v1 import types_pb2

from tests.pagestore.support import start_store
from tests.support.procs import ServiceProc, start_service

# Fast directory leases; a pool large enough for a 2,000-token prefix plus headroom (the tiny model's
# context is 4,096 tokens and its pages hold 16 tokens).
MESH_ENV = {
    "XAVIER_DIRECTORY__PEER_LEASE_SECONDS": "2",
    "XAVIER_DIRECTORY__HEARTBEAT_INTERVAL_SECONDS": "0.5",
    "XAVIER_DIRECTORY__SWEEP_INTERVAL_SECONDS": "0.1",
    "XAVIER_ENGINE__NUM_PAGES": "600",
    "XAVIER_GRACE_SECONDS": "2",
}


@dataclass
class Answer:
    tokens: list[int]
    usage: types_pb2.Usage
    first_at: float = 0.0  # time.perf_counter() when its first message arrived


@dataclass
class StoreMesh:
    """`device`: where replicas keep their KV (XAVIER_TEST_DEVICE=cuda runs the module on the GPU, the
    store then reached through each replica's pinned host mirror)."""

    model: Path
    workdir: Path
    procs: dict[str, ServiceProc] = field(default_factory=dict)
    device: str = field(default_factory=lambda: os.environ.get("XAVIER_TEST_DEVICE", "cpu"))
    arena: int = 32 << 20
    chunk: int = 1 << 20
    env: dict[str, str] = field(default_factory=dict)

    @property
    def store(self) -> ServiceProc:
        return self.procs["store"]

    def start_store(self, listen: str = "127.0.0.1:0") -> ServiceProc:
        self.procs["store"] = start_store(self.workdir, arena=self.arena, chunk=self.chunk, listen=listen)
        return self.store

    def start_directory(self) -> ServiceProc:
        proc = start_service("xavier-directory", ["--listen", "127.0.0.1:0"], self.workdir, env=MESH_ENV)
        self.procs["directory"] = proc
        return proc

    def start_unified(self, name: str, *extra: str) -> ServiceProc:
        return self._start_peer("xavier-decode", name, "--role", "unified", *extra)

    def start_prefill(self, name: str, *extra: str) -> ServiceProc:
        return self._start_peer("xavier-prefill", name, *extra)

    def _start_peer(self, binary: str, name: str, *extra: str) -> ServiceProc:
        args = ["--model", str(self.model), "--directory", self.procs["directory"].address]
        args += ["--peer-id", name, "--listen", "127.0.0.1:0", "--device", self.device, *extra]
        env = {**MESH_ENV, **self.env}
        # A compiled static step is compiled while the graphs are captured, before the service is ready.
        timeout = 600 if env.get("XAVIER_ENGINE__COMPILE") == "true" else 120
        proc = start_service(binary, args, self.workdir, name=name, env=env, timeout=timeout)
        self.procs[name] = proc
        return proc

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            proc.stop()


async def generate(
    address: str,
    token_ids: Sequence[int],
    salt: str = "",
    max_tokens: int = 8,
    channel: grpc.aio.Channel | None = None,
) -> Answer:
    """A greedy GenerateUnified (on `channel` when given, else on a channel of its own); returns its
    tokens, the usage of its last message and when its first message arrived."""
    async with contextlib.AsyncExitStack() as stack:
        if channel is None:
            channel = await stack.enter_async_context(grpc.aio.insecure_channel(address))
        call = dec_grpc.DecodeServiceStub(channel).GenerateUnified(
            dec.GenerateUnifiedRequest(
                request_id=uuid.uuid4().hex,
                token_ids=token_ids,
                sampling=types_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                cache_salt=salt,
            ),
            timeout=120,
        )
        tokens: list[int] = []
        usage = types_pb2.Usage()
        first_at = 0.0
        async for msg in call:
            first_at = first_at or time.perf_counter()
            tokens.extend(msg.delta.token_ids)
            if msg.HasField("usage"):
                usage = msg.usage
        return Answer(tokens, usage, first_at)


async def prefill_once(address: str, token_ids: Sequence[int], salt: str = "") -> pre.PrefillResponse:
    """A Prefill whose first token ends the request (max_tokens 1): nothing is published, no decode runs."""
    async with grpc.aio.insecure_channel(address) as ch:
        resp: pre.PrefillResponse = await pre_grpc.PrefillServiceStub(ch).Prefill(
            pre.PrefillRequest(
                request_id=uuid.uuid4().hex,
                room_id=secrets.randbits(63) or 1,
                decode_peer_id="no-decode",
                token_ids=token_ids,
                sampling=types_pb2.SamplingParams(max_tokens=1, ignore_eos=True),
                cache_salt=salt,
            ),
            timeout=120,
        )
        return resp


async def prefill_stats(address: str) -> types_pb2.EngineStats:
    async with grpc.aio.insecure_channel(address) as ch:
        resp = await pre_grpc.PrefillServiceStub(ch).GetPrefillStats(pre.GetPrefillStatsRequest(), timeout=5)
        return resp.engine


async def engine_stats(address: str) -> types_pb2.EngineStats:
    async with grpc.aio.insecure_channel(address) as ch:
        resp = await dec_grpc.DecodeServiceStub(ch).GetDecodeStats(dec.GetDecodeStatsRequest(), timeout=5)
        return resp.engine


async def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def prompt(seed: int, n: int, vocab: int = 512) -> list[int]:
    """n token ids derived from `seed` (ids 3.. avoid the tiny tokenizer's special tokens)."""
    return [3 + (seed * 7919 + i * 104729) % (vocab - 3) for i in range(n)]
