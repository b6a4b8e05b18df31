"""Every leak counter of a mesh with a router: the peers' and directory's (mesh_stats) plus the router's
streams in progress. All must read 0 once the mesh is idle."""

from __future__ import annotations

import asyncio
import time

import grpc
from xavier.v1 import router_service_pb2 as rpb
from xavier.v1 import router_service_pb2_grpc as rpb_grpc

from tests.pd.conftest import Mesh, mesh_stats


async def all_counters(mesh: Mesh, router_grpc: str) -> dict[str, int]:
    stats = await mesh_stats(mesh)
    async with grpc.aio.insecure_channel(router_grpc) as ch:
        status = await rpb_grpc.RouterServiceStub(ch).GetClusterStatus(
            rpb.GetClusterStatusRequest(), timeout=10
        )
    stats["router.requests_active"] = status.requests_active
    return stats


async def wait_all_idle(mesh: Mesh, router_grpc: str, timeout: float) -> dict[str, int]:
    """Polls until every counter is 0 or the timeout passed; returns the last reading."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await all_counters(mesh, router_grpc)
        if not any(stats.values()) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.2)


def rss_kib(pid: int) -> int:
    """The process's resident set (VmRSS) in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise LookupError(f"no VmRSS for pid {pid}")
