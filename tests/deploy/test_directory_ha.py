"""Two directories on etcd behind one P/D mesh: kill -9 of one under load loses no request and no room.

The prefill, the decode and the router are given both directory addresses (``ip:port,ip:port``: one
channel, calls spread round-robin); halfway through a stream of concurrent P/D requests one directory is
killed with SIGKILL. Every request must still complete (the directory calls that were in flight on the
dead one are retried on the other, which holds the same rooms), and afterwards the surviving
directory's books must balance with no room aborted or expired.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import directory_service_pb2_grpc as dpb_grpc
from xavier_client import AsyncClient

from tests.directory.etcd import Etcd, etcd_env
from tests.pd.conftest import FAST_ENV
from tests.support.procs import ServiceProc, start_service
from xavier_core.engine.tiny import make_tiny

pytestmark = pytest.mark.integration

REQUESTS = 24
CONCURRENCY = 4


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    server = Etcd(tmp_path_factory.mktemp("etcd"))
    yield server
    server.close()


async def _stats(address: str) -> dpb.GetDirectoryStatsResponse:
    async with grpc.aio.insecure_channel(address) as ch:
        stats: dpb.GetDirectoryStatsResponse = await dpb_grpc.DirectoryServiceStub(ch).GetDirectoryStats(
            dpb.GetDirectoryStatsRequest(), timeout=10
        )
        return stats


@pytest.mark.parametrize("protocol", ["directory", "pair"])
async def test_kill_9_of_one_directory_under_pd_load(etcd: Etcd, tmp_path: Path, protocol: str) -> None:
    """Directory rooms survive on the other directory; a pair handoff never needs the directory."""
    model = make_tiny(tmp_path / "tiny-qwen2", "qwen2")
    # Leases long enough that only the kill (not a slow shared machine) could cost a room.
    env = {
        **FAST_ENV,
        **etcd_env(etcd),
        "XAVIER_DIRECTORY__PEER_LEASE_SECONDS": "20",
        "XAVIER_DIRECTORY__ROOM_LEASE_SECONDS": "30",
        "XAVIER_HANDOFF__ROOM_LEASE_SECONDS": "30",
        "XAVIER_HANDOFF__TRANSFER_TIMEOUT_SECONDS": "20",
        "XAVIER_HANDOFF__PARK_TIMEOUT_SECONDS": "20",
        "XAVIER_HANDOFF__PROTOCOL": protocol,
    }
    procs: dict[str, ServiceProc] = {}
    try:
        for i in range(2):
            procs[f"dir{i}"] = start_service(
                "xavier-directory", ["--listen", "127.0.0.1:0"], tmp_path, name=f"dir{i}", env=env
            )
        both = f"{procs['dir0'].address},{procs['dir1'].address}"
        common = ["--model", str(model), "--directory", both, "--listen", "127.0.0.1:0", "--device", "cpu"]
        for name, binary, extra in (
            ("prefill-0", "xavier-prefill", []),
            ("decode-0", "xavier-decode", ["--role", "decode"]),
        ):
            procs[name] = start_service(
                binary, [*common, "--peer-id", name, *extra], tmp_path, name=name, env=env, timeout=120
            )
        procs["router"] = start_service(
            "xavier-router",
            [
                "--model",
                str(model),
                "--directory",
                both,
                "--listen",
                "127.0.0.1:0",
                "--http",
                "",
                "--mode",
                "pd",
            ],
            tmp_path,
            name="router",
            env=env,
        )
        killed = asyncio.Event()
        done: list[int] = []

        async def one(client: AsyncClient, i: int) -> int:
            out = await client.generate(f"request {i} to a mesh losing a directory", max_tokens=8, mode="pd")
            done.append(i)
            if len(done) == REQUESTS // 3 and not killed.is_set():
                procs["dir0"].kill()
                killed.set()
            return out.completion_tokens

        async with AsyncClient(procs["router"].address, timeout=60) as client:
            sem = asyncio.Semaphore(CONCURRENCY)

            async def bounded(i: int) -> int:
                async with sem:
                    return await one(client, i)

            tokens = await asyncio.gather(*(bounded(i) for i in range(REQUESTS)))
        assert killed.is_set() and procs["dir0"].proc.poll() is not None
        assert tokens == [8] * REQUESTS
        # The survivor's books: every room that was opened completed; none aborted, expired or still open.
        stats = await _stats(procs["dir1"].address)
        assert stats.rooms_opened >= REQUESTS if protocol == "directory" else stats.rooms_opened == 0
        assert (stats.rooms_active, stats.rooms_aborted, stats.rooms_expired) == (0, 0, 0)
        assert stats.rooms_completed == stats.rooms_opened
        assert stats.peers_by_role == {"ROLE_PREFILL": 1, "ROLE_DECODE": 1}
    finally:
        for proc in reversed(list(procs.values())):
            proc.stop()
