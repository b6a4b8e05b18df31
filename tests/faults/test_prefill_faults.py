"""kill -9 of one of two prefills under load: requests move to the other prefill, nothing leaks."""

from __future__ import annotations

import asyncio
import signal
import time

import aiohttp
import pytest

from tests.faults.conftest import FaultMesh, Outcome, stream_completion, wait_idle

pytestmark = pytest.mark.integration


async def test_kill_one_prefill_under_load_fails_over(fault_mesh: FaultMesh) -> None:
    mesh = fault_mesh.mesh
    until = asyncio.Event()
    outcomes: list[Outcome] = []

    async def load(worker: int) -> None:
        async with aiohttp.ClientSession() as session:
            i = 0
            while not until.is_set():
                i += 1
                prompt = f"prefill fault worker {worker} request {i} " * 8
                outcomes.append(await stream_completion(session, fault_mesh.router.http, prompt, 8))

    workers = [asyncio.ensure_future(load(w)) for w in range(6)]
    await asyncio.sleep(2.0)
    killed_at = time.monotonic()
    mesh.procs.pop("prefill-0").stop(signal.SIGKILL)
    await asyncio.sleep(5.0)
    until.set()
    await asyncio.gather(*workers)

    after = [o for o in outcomes if o.started >= killed_at + 1.0]
    assert len(after) >= 6, len(after)
    for o in outcomes:
        assert "127.0.0.1" not in o.body + str(o.sse_error or ""), o
        # The client's first token comes from a prefill that answered; what fails after it fails over.
        assert not (o.status == 200 and o.sse_error and o.tokens <= 1), o
        if o.status != 200:
            assert o.status == 503 and o.started < killed_at + 1.0, o
    for o in after:
        assert o.status == 200 and o.sse_error is None and o.finish == "length", o
    stats = await wait_idle(mesh, timeout=20.0)
    assert not any(stats.values()), stats
    print("prefill fault: requests served", len(outcomes))
