"""kill -9 of one of two unified replicas under load: colocated requests move to the other one."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.faults.conftest import (
    FAST_ENV,
    FaultMesh,
    Mesh,
    Outcome,
    start_router,
    stream_completion,
    wait_idle,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def unified_mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultMesh]:
    m = Mesh(tiny_model, tmp_path_factory.mktemp("unified"), dict(FAST_ENV))
    router = None
    try:
        m.start_directory()
        m.start_peer("unified-0", "unified")
        m.start_peer("unified-1", "unified")
        router = start_router(m, "router", mode="colocated")
        yield FaultMesh(m, router)
    finally:
        if router is not None:
            router.proc.stop()
        m.stop()


async def test_kill_one_unified_under_load_fails_over(unified_mesh: FaultMesh) -> None:
    mesh = unified_mesh.mesh
    until = asyncio.Event()
    outcomes: list[Outcome] = []

    async def load(worker: int) -> None:
        async with aiohttp.ClientSession() as session:
            i = 0
            while not until.is_set():
                i += 1
                outcomes.append(
                    await stream_completion(session, unified_mesh.router.http, f"unified {worker} {i}", 8)
                )

    workers = [asyncio.ensure_future(load(w)) for w in range(6)]
    await asyncio.sleep(2.0)
    killed_at = time.monotonic()
    mesh.procs.pop("unified-0").stop(signal.SIGKILL)
    await asyncio.sleep(4.0)
    until.set()
    await asyncio.gather(*workers)

    after = [o for o in outcomes if o.started >= killed_at + 1.0]
    assert len(after) >= 6, len(after)
    for o in outcomes:
        assert "127.0.0.1" not in o.body + str(o.sse_error or ""), o
        # Only a stream that already had tokens from the dead replica may end in an SSE error.
        assert not (o.status == 200 and o.sse_error and o.tokens == 0), o
        if o.status != 200:
            assert o.status == 503 and o.started < killed_at + 1.0, o
    for o in after:
        assert o.status == 200 and o.sse_error is None and o.finish == "length", o
    stats = await wait_idle(mesh, timeout=20.0)
    assert not any(stats.values()), stats
    print("unified fault: requests served", len(outcomes))
