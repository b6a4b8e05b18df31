"""kill -9 of one of two prefills under load: requests move to the other prefill, nothing leaks."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from tests.faults.conftest import FaultMesh, assert_failed_over, under_load, wait_idle

pytestmark = pytest.mark.integration


async def test_kill_one_prefill_under_load_fails_over(fault_mesh: FaultMesh) -> None:
    mesh = fault_mesh.mesh
    http = fault_mesh.router.http
    async with under_load(http, 6, lambda w, i: f"prefill fault worker {w} request {i} " * 8) as outcomes:
        await asyncio.sleep(2.0)
        killed_at = time.monotonic()
        mesh.procs.pop("prefill-0").stop(signal.SIGKILL)
        await asyncio.sleep(5.0)

    # The client's first token comes from a prefill that answered; what fails after it fails over.
    after = assert_failed_over(outcomes, killed_at, tokens_from_peer=1)
    assert len(after) >= 6, len(after)
    stats = await wait_idle(mesh, timeout=20.0)
    assert not any(stats.values()), stats
    print("prefill fault: requests served", len(outcomes))
