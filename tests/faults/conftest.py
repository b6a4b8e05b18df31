"""A mesh with a spare prefill and decode and a router, as processes, for the fault suites.

directory, prefill-0, prefill-1, decode-0, decode-1 (the P/D mesh of tests/pd with short leases) and a
router whose progress deadline, keepalive and health probe are short so faults resolve in seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from tests.pd.conftest import FAST_ENV, Mesh, mesh_stats, tiny_model
from tests.support.procs import ServiceProc, start_service

__all__ = ["tiny_model"]

ROUTER_ENV = {
    "XAVIER_PROGRESS_TIMEOUT_SECONDS": "4",
    "XAVIER_KEEPALIVE_SECONDS": "0.5",
    "XAVIER_HEALTH_INTERVAL_SECONDS": "0.3",
    "XAVIER_HEALTH_TIMEOUT_SECONDS": "0.5",
    "XAVIER_STATUS_PEER_TIMEOUT_SECONDS": "0.5",
    "XAVIER_FAILOVER_ATTEMPTS": "3",
    "XAVIER_PEER_REFRESH_SECONDS": "0.2",
}


@dataclass
class Router:
    proc: ServiceProc
    http: str

    @property
    def grpc(self) -> str:
        return self.proc.address


def start_router(mesh: Mesh, name: str, mode: str = "pd", **env: str) -> Router:
    args = ["--model", str(mesh.model), "--directory", mesh.directory, "--listen", "127.0.0.1:0"]
    args += ["--http", "127.0.0.1:0", "--mode", mode]
    proc = start_service(
        "xavier-router", args, mesh.workdir, name=name, env={**mesh.env, **ROUTER_ENV, **env}, timeout=120
    )
    info = json.loads((mesh.workdir / f"{name}.ready").read_text())
    return Router(proc, info["http"])


@dataclass
class FaultMesh:
    mesh: Mesh
    router: Router


@pytest.fixture(scope="module")
def fault_mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultMesh]:
    # Long streams on one decode need more pages than the P/D suite's 256.
    m = Mesh(tiny_model, tmp_path_factory.mktemp("faults"), {**FAST_ENV, "XAVIER_ENGINE__NUM_PAGES": "2048"})
    router: Router | None = None
    try:
        m.start_directory()
        m.start_peer("prefill-0", "prefill")
        m.start_peer("prefill-1", "prefill")
        m.start_peer("decode-0", "decode")
        m.start_peer("decode-1", "decode")
        router = start_router(m, "router")
        yield FaultMesh(m, router)
    finally:
        if router is not None:
            router.proc.stop()
        m.stop()


@dataclass
class Outcome:
    """One HTTP streaming request as the client saw it."""

    started: float
    ended: float = 0.0
    status: int = 0
    finish: str | None = None
    sse_error: dict[str, object] | None = None
    tokens: int = 0
    keepalives: int = 0
    body: str = ""


async def stream_completion(
    session: aiohttp.ClientSession, http: str, prompt: str, max_tokens: int, timeout: float = 60
) -> Outcome:
    """POSTs a streaming completion and reads it to the end (or to an error)."""
    out = Outcome(started=time.monotonic())
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    async with session.post(
        f"http://{http}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout)
    ) as resp:
        out.status = resp.status
        if resp.status != 200:
            out.body = await resp.text()
            out.ended = time.monotonic()
            return out
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith(":"):
                out.keepalives += 1
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                out.sse_error = event["error"]
                continue
            out.tokens += 1
            choice = event["choices"][0]
            if choice.get("finish_reason"):
                out.finish = choice["finish_reason"]
    out.ended = time.monotonic()
    return out


@contextlib.asynccontextmanager
async def under_load(
    http: str, workers: int, prompt: Callable[[int, int], str], max_tokens: int = 8, timeout: float = 60
) -> AsyncIterator[list[Outcome]]:
    """Workers stream completions back to back through the router at `http` while the block runs
    (`prompt(worker, i)` is each one's i-th prompt). The list yielded fills with outcomes as requests
    end; once the block exits, the workers have stopped and every request they began has ended."""
    until = asyncio.Event()
    outcomes: list[Outcome] = []

    async def worker(w: int) -> None:
        async with aiohttp.ClientSession() as session:
            i = 0
            while not until.is_set():
                i += 1
                outcomes.append(await stream_completion(session, http, prompt(w, i), max_tokens, timeout))

    tasks = [asyncio.ensure_future(worker(w)) for w in range(workers)]
    try:
        yield outcomes
    finally:
        until.set()
        await asyncio.gather(*tasks)


def no_internal_addresses(o: Outcome) -> None:
    text = o.body + json.dumps(o.sse_error or {})
    assert "127.0.0.1" not in text and "ipv4:" not in text, text


def assert_failed_over(outcomes: list[Outcome], killed_at: float, tokens_from_peer: int) -> list[Outcome]:
    """What clients saw when one of two peers of a role was killed at `killed_at`; returns the requests
    begun a second after it, which all succeeded.

    No answer names an internal address; HTTP 200 then an error only where more than `tokens_from_peer`
    tokens had come (tokens only the dead peer could have sent: nothing to fail over with); any other
    status is a 503 of a request begun before that second was over.
    """
    for o in outcomes:
        no_internal_addresses(o)
        assert not (o.status == 200 and o.sse_error and o.tokens <= tokens_from_peer), o
        if o.status != 200:
            assert o.status == 503 and o.started < killed_at + 1.0, o
    after = [o for o in outcomes if o.started >= killed_at + 1.0]
    for o in after:
        assert o.status == 200 and o.sse_error is None and o.finish == "length", o
    return after


async def wait_idle(mesh: Mesh, timeout: float) -> dict[str, int]:
    """Polls every live service's counters until all are 0 (rooms, pinned and parked pages, requests)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await mesh_stats(mesh)
        if not any(stats.values()) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.2)


async def metrics_page(address: str) -> str:
    def fetch() -> str:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
            return str(resp.read().decode())

    return await asyncio.to_thread(fetch)


def metric_values(text: str, name: str) -> dict[str, float]:
    """Sample lines of one metric family from a Prometheus text page: {labels: value}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
