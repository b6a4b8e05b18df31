"""The migration suites' mesh and client: 1 prefill + 2 decodes and a router with a short progress
deadline, gRPC streams as the client sees them, and the moves the router's request lines record."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from xavier.v1 import decode_service_pb2 as dec
from xavier.v1 import decode_service_pb2_grpc as dec_grpc
from xavier.v1 import router_service_pb2 as rpb
from xavier.v1 import router_service_pb2_grpc as rpb_grpc
from xavier.v1 import types_pb2

from tests.faults.conftest import Router, start_router
from tests.faults.leaks import wait_all_idle
from tests.pd.conftest import FAST_ENV, Mesh
from xavier_core.text.tokenizer import IncrementalDetokenizer, TextTokenizer

MIGRATION_ENV = {
    "XAVIER_DECODE_PROGRESS_SECONDS": "2",
    "XAVIER_PROGRESS_TIMEOUT_SECONDS": "20",
    "XAVIER_FAILOVER_ATTEMPTS": "3",
}
DECODES = ["decode-0", "decode-1"]


@dataclass
class MigrationMesh:
    mesh: Mesh
    router: Router
    tokenizer: TextTokenizer
    routers: list[Router] = field(default_factory=list)

    def text(self, prompt: list[int], tokens: list[int]) -> str:
        """The text one uninterrupted engine writes for `tokens` after `prompt` (no stop strings)."""
        detok = IncrementalDetokenizer(self.tokenizer, prompt)
        return "".join(detok.push(t) for t in tokens[:-1]) + detok.push(tokens[-1]) + detok.flush()

    def restart(self, name: str) -> None:
        """Starts `name` again if it is not running (a new epoch)."""
        proc = self.mesh.procs.get(name)
        if proc is None or proc.proc.poll() is not None:
            self.mesh.start_peer(name, "prefill" if name.startswith("prefill") else "decode")


@contextlib.contextmanager
def migration_mesh(model: Path, workdir: Path, **router_env: str) -> Iterator[MigrationMesh]:
    """directory, prefill-0, decode-0, decode-1 and a router (MIGRATION_ENV, then `router_env`)."""
    m = Mesh(model, workdir, {**FAST_ENV, "XAVIER_ENGINE__NUM_PAGES": "2048"})
    routers: list[Router] = []
    try:
        m.start_directory()
        m.start_peer("prefill-0", "prefill")
        for name in DECODES:
            m.start_peer(name, "decode")
        routers.append(start_router(m, "router", **{**MIGRATION_ENV, **router_env}))
        yield MigrationMesh(m, routers[0], TextTokenizer.load(model), routers)
    finally:
        for r in routers:
            r.proc.stop()
        m.stop()


@dataclass
class Streamed:
    """One gRPC stream as the client saw it."""

    request_id: str
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish: int = 0
    usage: types_pb2.Usage | None = None
    error: grpc.aio.AioRpcError | None = None


def prompt_ids(seed: int, n: int = 24) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def request(rid: str, ids: list[int], max_tokens: int, **sampling: object) -> rpb.GenerateRequest:
    s = types_pb2.SamplingParams(**{"max_tokens": max_tokens, "ignore_eos": True, **sampling})  # type: ignore[arg-type]
    return rpb.GenerateRequest(request_id=rid, token_ids=rpb.TokenIds(ids=ids), sampling=s)


async def stream(
    address: str, req: rpb.GenerateRequest, on_tokens: Callable[[Streamed], None] | None = None
) -> Streamed:
    out = Streamed(req.request_id)
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            async for resp in rpb_grpc.RouterServiceStub(ch).Generate(req, timeout=120):
                out.tokens += resp.token_ids
                out.text += resp.text
                if resp.finish_reason:
                    out.finish, out.usage = resp.finish_reason, resp.usage
                if on_tokens is not None:
                    on_tokens(out)
        except grpc.aio.AioRpcError as exc:
            out.error = exc
    return out


@dataclass(frozen=True)
class Move:
    """One move as the router's request line records it."""

    cause: str
    at: int  # tokens the client had
    cached: int | None  # prompt tokens the new prefill found cached
    prompt: int  # tokens of the new prompt
    seam_s: float | None  # failure to the new attempt's first token


def migrations(router: Router) -> dict[str, list[Move]]:
    """request id -> its moves, from the router's log."""
    return moves_in(router.proc.log())


def moves_in(log: str) -> dict[str, list[Move]]:
    """request id -> its moves, from the text of a router's log."""
    out: dict[str, list[Move]] = {}
    for line in log.splitlines():
        if not line.startswith("{"):
            continue
        event = json.loads(line)
        if event.get("event") in ("request", "request failed") and event.get("migrations"):
            moves = []
            for move in event["migrations"].split(","):
                cause, _, rest = move.partition(":")
                at, cached, prompt, seam = rest.rpartition("@")[2].split("/")
                moves.append(
                    Move(
                        cause,
                        int(at),
                        None if cached == "cached=?" else int(cached.split("=")[1]),
                        int(prompt.split("=")[1]),
                        None if seam == "seam=?" else float(seam.split("=")[1]),
                    )
                )
            out[event["request_id"]] = moves
    return out


async def serving_decode(mesh: Mesh, exclude: str = "", prefer: list[str] | None = None) -> str:
    """The decode that runs a request now (polled, in `prefer`'s order, within a generous bound),
    leaving `exclude` (a stopped one) out."""
    for _ in range(3000):
        for name in prefer or DECODES:
            proc = mesh.procs.get(name)
            if name == exclude or proc is None or proc.proc.poll() is not None:
                continue
            async with grpc.aio.insecure_channel(proc.address) as ch:
                st = await dec_grpc.DecodeServiceStub(ch).GetDecodeStats(
                    dec.GetDecodeStatsRequest(), timeout=5
                )
            if st.engine.running:
                return name
        await asyncio.sleep(0.02)
    raise AssertionError("no decode is running a request")


async def fresh(mig: MigrationMesh, ids: list[int], max_tokens: int, **sampling: object) -> Streamed:
    out = await stream(mig.router.grpc, request("", ids, max_tokens, **sampling))
    assert out.error is None and len(out.tokens) == max_tokens, out
    return out


async def idle(mig: MigrationMesh) -> None:
    for r in mig.routers:
        stats = await wait_all_idle(mig.mesh, r.grpc, timeout=30.0)
        assert not any(stats.values()), stats


async def when(cond: Callable[[], bool], bound: float = 60.0) -> None:
    """Waits for `cond` (a generous bound, so a broken router fails the test instead of hanging it)."""
    for _ in range(int(bound / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")
