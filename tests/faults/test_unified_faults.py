"""kill -9 of one of two unified replicas under load: colocated requests move to the other one."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.conftest import FaultMesh, assert_failed_over, start_router, under_load, wait_idle
from tests.pd.conftest import FAST_ENV, Mesh

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
    async with under_load(unified_mesh.router.http, 6, lambda w, i: f"unified {w} {i}") as outcomes:
        await asyncio.sleep(2.0)
        killed_at = time.monotonic()
        mesh.procs.pop("unified-0").stop(signal.SIGKILL)
        await asyncio.sleep(4.0)

    # Only a stream that already had tokens from the dead replica may end in an SSE error.
    after = assert_failed_over(outcomes, killed_at, tokens_from_peer=0)
    assert len(after) >= 6, len(after)
    stats = await wait_idle(mesh, timeout=20.0)
    assert not any(stats.values()), stats
    print("unified fault: requests served", len(outcomes))
