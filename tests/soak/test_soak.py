"""A soak through the router: 2,000 requests at concurrency 32, mixed P/D and colocated, 10% cancelled
by the client at a random point of the stream.

Every request not cancelled must finish normally (zero unexpected errors); afterwards every counter on
every service (router streams, directory rooms, rooms, pinned and parked pages, running and waiting
requests on each peer) must be 0, and each service's RSS growth over the soak is reported.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from tests.faults.conftest import Router, start_router
from tests.faults.leaks import rss_kib, wait_all_idle
from tests.pd.conftest import FAST_ENV, Mesh

pytestmark = pytest.mark.integration

REQUESTS = 2000
CONCURRENCY = 32
CANCEL_SHARE = 0.10
MAX_TOKENS = 6
WARMUP = 64
RSS_GROWTH_LIMIT_KIB = 500 * 1024


@pytest.fixture(scope="module")
def soak_mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Mesh, Router]]:
    m = Mesh(tiny_model, tmp_path_factory.mktemp("soak"), {**FAST_ENV, "XAVIER_ENGINE__NUM_PAGES": "2048"})
    router: Router | None = None
    try:
        m.start_directory()
        m.start_peer("prefill-0", "prefill")
        m.start_peer("decode-0", "decode")
        m.start_peer("unified-0", "unified")
        router = start_router(m, "router", mode="pd")
        yield m, router
    finally:
        if router is not None:
            router.proc.stop()
        m.stop()


@dataclass
class Tally:
    ok: int = 0
    cancelled: int = 0
    by_mode: dict[str, int] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)


async def one_request(
    session: aiohttp.ClientSession, http: str, i: int, mode: str, cancel_after: int | None, tally: Tally
) -> None:
    """Streams one completion; with `cancel_after` set, closes the connection after that many events."""
    body = {
        "prompt": f"soak request {i} " * (1 + i % 7),
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "ignore_eos": True,
        "xavier_mode": mode,
    }
    events = 0
    finish = None
    async with session.post(
        f"http://{http}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=60)
    ) as resp:
        if resp.status != 200:
            tally.unexpected.append(f"#{i} {mode}: HTTP {resp.status} {await resp.text()}")
            return
        if cancel_after == 0:
            resp.close()
            tally.cancelled += 1
            return
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                tally.unexpected.append(f"#{i} {mode}: {event['error']}")
                return
            events += 1
            finish = event["choices"][0].get("finish_reason") or finish
            if cancel_after is not None and events >= cancel_after:
                resp.close()
                tally.cancelled += 1
                return
    if finish != "length":
        tally.unexpected.append(f"#{i} {mode}: finish {finish} after {events} events")
        return
    tally.ok += 1
    tally.by_mode[mode] = tally.by_mode.get(mode, 0) + 1


async def run_requests(http: str, count: int, rng: random.Random, tally: Tally) -> None:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(count):
        queue.put_nowait(i)
    conn = aiohttp.TCPConnector(limit=CONCURRENCY * 2)
    async with aiohttp.ClientSession(connector=conn) as session:

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                mode = "pd" if rng.random() < 0.5 else "colocated"
                cancel = rng.randrange(MAX_TOKENS) if rng.random() < CANCEL_SHARE else None
                try:
                    await one_request(session, http, i, mode, cancel, tally)
                except (aiohttp.ClientError, TimeoutError) as err:
                    tally.unexpected.append(f"#{i} {mode}: {type(err).__name__} {err}")

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))


async def test_soak_mixed_with_cancels(soak_mesh: tuple[Mesh, Router]) -> None:
    mesh, router = soak_mesh
    rng = random.Random(20261130)
    # Warm every path first so the RSS baseline holds the allocator's and the model's steady state.
    await run_requests(router.http, WARMUP, rng, Tally())
    await wait_all_idle(mesh, router.grpc, timeout=30.0)
    pids = {name: p.proc.pid for name, p in mesh.procs.items()} | {"router": router.proc.proc.pid}
    rss_before = {name: rss_kib(pid) for name, pid in pids.items()}

    tally = Tally()
    started = time.monotonic()
    await run_requests(router.http, REQUESTS, rng, tally)
    elapsed = time.monotonic() - started

    stats = await wait_all_idle(mesh, router.grpc, timeout=30.0)
    rss_after = {name: rss_kib(pid) for name, pid in pids.items()}
    growth = {name: rss_after[name] - rss_before[name] for name in pids}
    leaks = {k: v for k, v in stats.items() if v}
    print(
        f"soak: {REQUESTS} requests at concurrency {CONCURRENCY} in {elapsed:.1f}s: served {tally.ok} "
        f"{tally.by_mode}, cancelled {tally.cancelled}, unexpected errors {len(tally.unexpected)}, "
        f"leaks found {len(leaks)}"
    )
    for name in pids:
        print(
            f"soak RSS {name}: {rss_before[name] / 1024:.1f} MiB -> {rss_after[name] / 1024:.1f} MiB "
            f"({growth[name] / 1024:+.1f} MiB)"
        )
    assert not tally.unexpected, tally.unexpected[:20]
    assert tally.ok + tally.cancelled == REQUESTS
    assert tally.cancelled >= REQUESTS * CANCEL_SHARE / 2, tally.cancelled
    assert min(tally.by_mode.values()) > REQUESTS / 4, tally.by_mode
    assert not leaks, stats
    for name, kib in growth.items():
        assert kib < RSS_GROWTH_LIMIT_KIB, f"{name} grew {kib / 1024:.1f} MiB"
