"""A migration soak: greedy P/D streams at concurrency 12 over 1 prefill + 2 decodes while decodes are
killed (kill -9) mid-stream, each started again (a new epoch) before the next kill.

Kills land at seeded points of the run (once the router has streamed a seeded number of tokens), each on
a decode that is streaming requests then (the two in turn where both are); together they take about
10% of the run's streams mid-stream. No new request starts while a killed decode restarts, so the
kill points fall within the run however long a restart takes. Zero requests may fail; every stream's
answer must be correct (greedy: one that never moved equals its prompt's fresh run, and what follows
each seam equals a fresh run of prompt + the tokens before it); afterwards every counter on every
service is 0.
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import grpc
import pytest
from xavier.v1 import decode_service_pb2 as dec
from xavier.v1 import decode_service_pb2_grpc as dec_grpc
from xavier.v1 import types_pb2

from tests.faults.conftest import metric_values, metrics_page
from tests.faults.migration_mesh import (
    DECODES,
    MigrationMesh,
    Streamed,
    fresh,
    idle,
    migration_mesh,
    migrations,
    prompt_ids,
    request,
    stream,
)

pytestmark = pytest.mark.integration

REQUESTS = 120
CONCURRENCY = 12
MAX_TOKENS = 96
PROMPTS = 30  # distinct prompts, each sent REQUESTS / PROMPTS times (one fresh run checks them all)
KILLS = 4  # each takes the streams on one decode mid-stream: about 10% of the run's in all
KILL_SPACING = 2200  # router output tokens between two kill points (the run streams 11,520)


@pytest.fixture(scope="module")
def mig(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MigrationMesh]:
    with migration_mesh(tiny_model, tmp_path_factory.mktemp("soak-migration")) as m:
        yield m


async def _running(mig: MigrationMesh, name: str) -> bool:
    """Whether `name` is decoding requests now (False while it is down or starting)."""
    proc = mig.mesh.procs.get(name)
    if proc is None or proc.proc.poll() is not None:
        return False
    try:
        async with grpc.aio.insecure_channel(proc.address) as ch:
            st = await dec_grpc.DecodeServiceStub(ch).GetDecodeStats(dec.GetDecodeStatsRequest(), timeout=5)
    except grpc.aio.AioRpcError:
        return False
    return st.engine.running > 0


async def _killer(
    mig: MigrationMesh, points: list[int], killed: list[str], gate: asyncio.Event, over: asyncio.Event
) -> None:
    """At each point (router output tokens), kills a decode that is streaming then (the one not killed
    last when both are: the decodes in turn) and starts it again; no new request starts while it
    restarts (`gate`), so every point comes within the run whatever a restart costs. Returns early when
    the run is `over`. (Waiting for one named victim could outlast the run: after a restart the router
    may route the rest of the run's streams to the other decode.)"""

    async def sent() -> float:
        page = await metrics_page(mig.router.proc.metrics)
        return sum(metric_values(page, "xavier_router_output_tokens_total").values())

    async def until(cond: Callable[[], Awaitable[bool]]) -> bool:
        while not await cond():
            if over.is_set():
                return False
            await asyncio.sleep(0.02)
        return True

    async def streaming() -> str | None:
        """A decode streaming now, the one not killed last first; None while neither is."""
        order = sorted(DECODES, key=lambda name: bool(killed) and name == killed[-1])
        for name in order:
            if await _running(mig, name):
                return name
        return None

    base = await sent()
    for point in points:
        if not await until(functools.partial(_past, sent, base + point)):
            return
        while (victim := await streaming()) is None:  # the kill takes streams mid-stream
            if over.is_set():
                return
            await asyncio.sleep(0.02)
        gate.clear()
        try:
            mig.mesh.procs[victim].kill()  # kill -9, reaped
            killed.append(victim)
            await asyncio.to_thread(mig.restart, victim)
        finally:
            gate.set()  # a failed restart fails the test at `await kills`, not by a stalled run


async def _past(value: Callable[[], Awaitable[float]], point: float) -> bool:
    return await value() >= point


async def _run(mig: MigrationMesh, prompts: list[list[int]], gate: asyncio.Event) -> list[Streamed]:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(REQUESTS):
        queue.put_nowait(i)
    outs: list[Streamed] = []

    async def worker() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            await gate.wait()
            outs.append(await stream(mig.router.grpc, request(f"soak-{i}", prompts[i % PROMPTS], MAX_TOKENS)))

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return outs


async def test_soak_with_decodes_killed_mid_stream(mig: MigrationMesh) -> None:
    rng = random.Random(20261201)
    prompts = [prompt_ids(9000 + p) for p in range(PROMPTS)]
    points = [KILL_SPACING * i + rng.randrange(300, 900) for i in range(KILLS)]
    killed: list[str] = []
    gate, over = asyncio.Event(), asyncio.Event()
    gate.set()
    started = time.monotonic()
    kills = asyncio.ensure_future(_killer(mig, points, killed, gate, over))
    outs = await _run(mig, prompts, gate)
    elapsed = time.monotonic() - started
    over.set()
    await kills
    assert len(killed) == KILLS, f"the run ended before every kill point {points} (killed {killed})"
    moved = migrations(mig.router)
    failed = [o for o in outs if o.error is not None or len(o.tokens) != MAX_TOKENS]
    assert not failed, [(o.request_id, o.error) for o in failed[:5]]
    assert all(o.finish == types_pb2.FINISH_REASON_LENGTH for o in outs)
    # Correct answers: the plain run of each prompt, and after each seam a fresh run from it.
    plain = {p: (await fresh(mig, prompts[p], MAX_TOKENS)).tokens for p in range(PROMPTS)}
    whole_equal = 0
    for out in outs:
        ids, p = prompts[int(out.request_id[5:]) % PROMPTS], int(out.request_id[5:]) % PROMPTS
        assert out.text == mig.text(ids, out.tokens), out.request_id
        seams = [m.at for m in moved.get(out.request_id, [])]
        assert seams or out.tokens == plain[p], out.request_id
        for at in seams:
            after = await fresh(mig, ids + out.tokens[:at], MAX_TOKENS - at)
            assert out.tokens[at:] == after.tokens, (out.request_id, at)
        whole_equal += out.tokens == plain[p]
    n_moved = sum(1 for o in outs if o.request_id in moved)
    assert n_moved >= 1, moved
    await idle(mig)
    print(
        f"migration soak: {REQUESTS} streams at concurrency {CONCURRENCY} in {elapsed:.1f}s, {KILLS} "
        f"decodes killed at router tokens {points}: {n_moved} streams moved "
        f"({100 * n_moved / REQUESTS:.0f}%), {sum(len(m) for m in moved.values())} moves, 0 failed; "
        f"whole answers equal to the plain run: {whole_equal}/{REQUESTS}"
    )
