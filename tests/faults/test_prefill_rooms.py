"""A prefill whose decode is gone frees its room at once (invariant I2), instead of waiting out two room
leases and a park timeout for a room the directory never opened."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import prefill_service_pb2 as pre
from xavier.v1 import prefill_service_pb2_grpc as pre_grpc
from xavier.v1 import types_pb2

from tests.faults.conftest import FaultMesh, wait_idle
from tests.support.pd_driver import new_room_id, prefill_request

pytestmark = pytest.mark.integration


async def test_publication_to_a_dead_decode_unpins_at_once(fault_mesh: FaultMesh) -> None:
    mesh = fault_mesh.mesh
    gone = dpb.Peer(peer_id="decode-gone", epoch=7)  # as a router that still lists a dead decode would
    sampling = types_pb2.SamplingParams(max_tokens=8, ignore_eos=True)
    async with grpc.aio.insecure_channel(mesh.procs["prefill-0"].address) as ch:
        stub = pre_grpc.PrefillServiceStub(ch)
        started = time.monotonic()
        for _ in range(4):
            resp = await stub.Prefill(
                prefill_request(new_room_id(), gone, [5, 6, 7, 8] * 20, sampling), timeout=10
            )
            assert resp.num_pages > 0
        while True:
            stats = await stub.GetPrefillStats(pre.GetPrefillStatsRequest(), timeout=5)
            if stats.rooms_active == 0 and stats.engine.pages_pinned == 0:
                break
            # Before the fix: 2 room leases (8 s here) + the park timeout (5 s).
            assert time.monotonic() - started < 3.0, stats
            await asyncio.sleep(0.05)
    stats_all = await wait_idle(mesh, timeout=10.0)
    assert not any(stats_all.values()), stats_all
