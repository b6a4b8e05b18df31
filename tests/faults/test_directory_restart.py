"""kill -9 of the directory under P/D load through the router, then a restart on the same address.

The directory keeps soft state: peers register again (new epochs) and rooms of requests in flight are
gone. Every client gets an answer (a success or a clear status) within its deadline, requests begun a
second after the directory is back succeed, and every counter on every service returns to 0.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.conftest import Router, no_internal_addresses, start_router, under_load
from tests.faults.leaks import wait_all_idle
from tests.pd.conftest import FAST_ENV, Mesh
from tests.support.procs import start_service

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pd_router_mesh(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Mesh, Router]]:
    m = Mesh(
        tiny_model, tmp_path_factory.mktemp("dir-restart"), {**FAST_ENV, "XAVIER_ENGINE__NUM_PAGES": "1024"}
    )
    router: Router | None = None
    try:
        m.start_directory()
        m.start_peer("prefill-0", "prefill")
        m.start_peer("decode-0", "decode")
        router = start_router(m, "router")
        yield m, router
    finally:
        if router is not None:
            router.proc.stop()
        m.stop()


async def test_directory_killed_and_restarted_under_load(pd_router_mesh: tuple[Mesh, Router]) -> None:
    mesh, router = pd_router_mesh
    prompt = "directory fault worker {} request {} "
    async with under_load(router.http, 4, lambda w, i: prompt.format(w, i) * 4, timeout=30) as outcomes:
        await asyncio.sleep(2.0)
        old = mesh.procs["directory"]
        address = old.address
        killed_at = time.monotonic()
        old.stop(signal.SIGKILL)
        await asyncio.sleep(1.0)
        mesh.procs["directory"] = start_service(
            "xavier-directory", ["--listen", address], mesh.workdir, name="directory-2", env=mesh.env
        )
        back_at = time.monotonic()
        await asyncio.sleep(6.0)

    during = [o for o in outcomes if killed_at <= o.ended and o.started < back_at + 1.0]
    after = [o for o in outcomes if o.started >= back_at + 1.0]
    failed = [o for o in outcomes if o.status != 200 or o.sse_error is not None]
    assert len(after) >= 4, f"only {len(after)} requests after the directory came back"
    for o in outcomes:
        no_internal_addresses(o)
        assert o.ended - o.started < 30.0, o
        if o.status != 200:
            assert o.status == 503 and json.loads(o.body)["error"]["code"], o
        elif o.sse_error is None:
            assert o.finish == "length", o
        else:
            assert o.sse_error.get("code"), o
    for o in failed:
        assert o.started < back_at + 1.0, o
    for o in after:
        assert o.status == 200 and o.sse_error is None and o.finish == "length", o

    stats = await wait_all_idle(mesh, router.grpc, timeout=30.0)
    leaks = sum(1 for v in stats.values() if v)
    print(
        f"directory restart: faults injected 1, requests served {len(outcomes)} "
        f"({len(during)} across the outage, {len(failed)} failed with a clear status, {len(after)} after), "
        f"leaks found {leaks}"
    )
    assert not any(stats.values()), stats
