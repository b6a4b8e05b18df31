"""A real P/D mesh for the tests: directory, prefill, decode and unified services as processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from xavier.v1 import decode_service_pb2 as dec
from xavier.v1 import decode_service_pb2_grpc as dec_grpc
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import directory_service_pb2_grpc as dpb_grpc
from xavier.v1 import prefill_service_pb2 as pre
from xavier.v1 import prefill_service_pb2_grpc as pre_grpc

from tests.support.procs import ServiceProc, start_service
from xavier_core.engine.tiny import make_tiny

# Short leases so fault tests finish fast; every wait in the services is bounded by these.
FAST_ENV = {
    "XAVIER_DIRECTORY__PEER_LEASE_SECONDS": "2",
    "XAVIER_DIRECTORY__HEARTBEAT_INTERVAL_SECONDS": "0.5",
    "XAVIER_DIRECTORY__ROOM_LEASE_SECONDS": "4",
    "XAVIER_DIRECTORY__SWEEP_INTERVAL_SECONDS": "0.1",
    "XAVIER_HANDOFF__ROOM_LEASE_SECONDS": "4",
    "XAVIER_HANDOFF__TRANSFER_TIMEOUT_SECONDS": "5",
    "XAVIER_HANDOFF__PARK_TIMEOUT_SECONDS": "5",
    "XAVIER_ENGINE__NUM_PAGES": "256",
}


def peer_device(role: str) -> str:
    """XAVIER_TEST_DEVICE=cuda runs the P/D suite GPU to GPU: prefill on cuda:0, decode on the last GPU."""
    if os.environ.get("XAVIER_TEST_DEVICE", "cpu") != "cuda":
        return "cpu"
    import torch

    last = max(torch.cuda.device_count() - 1, 0)
    return "cuda:0" if role in ("prefill", "unified") else f"cuda:{last}"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("models") / "tiny-qwen2", "qwen2")


@dataclass
class Mesh:
    model: Path
    workdir: Path
    env: dict[str, str]
    procs: dict[str, ServiceProc] = field(default_factory=dict)

    @property
    def directory(self) -> str:
        return self.procs["directory"].address

    def start_directory(self) -> ServiceProc:
        proc = start_service("xavier-directory", ["--listen", "127.0.0.1:0"], self.workdir, env=self.env)
        self.procs["directory"] = proc
        return proc

    def start_peer(self, name: str, role: str, *extra: str) -> ServiceProc:
        binary = "xavier-prefill" if role == "prefill" else "xavier-decode"
        args = ["--model", str(self.model), "--directory", self.directory, "--peer-id", name]
        args += ["--device", peer_device(role)]
        args += ["--listen", "127.0.0.1:0", *extra]
        if role != "prefill":
            args += ["--role", role]
        proc = start_service(binary, args, self.workdir, name=name, env=self.env, timeout=120)
        self.procs[name] = proc
        return proc

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            proc.stop()


@contextlib.contextmanager
def pair_mesh(model: Path, workdir: Path, env: dict[str, str]) -> Iterator[Mesh]:
    """Directory, prefill-0 and decode-0 under `env`, stopped on exit (with what the test added)."""
    m = Mesh(model, workdir, env)
    try:
        m.start_directory()
        m.start_peer("prefill-0", "prefill")
        m.start_peer("decode-0", "decode")
        yield m
    finally:
        m.stop()


@contextlib.contextmanager
def standard_mesh(tiny_model: Path, workdir: Path, env: dict[str, str]) -> Iterator[Mesh]:
    """Directory, prefill-0, decode-0 and unified-0, stopped on exit."""
    with pair_mesh(tiny_model, workdir, env) as m:
        m.start_peer("unified-0", "unified")
        yield m


@pytest.fixture(scope="module")
def mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with standard_mesh(tiny_model, tmp_path_factory.mktemp("mesh"), dict(FAST_ENV)) as m:
        yield m


def rpc_count(proc: ServiceProc, method: str) -> float:
    """`xavier_rpc_total` of `method` on `proc`, every code together."""
    with urllib.request.urlopen(f"http://{proc.metrics}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("xavier_rpc_total{") and f'method="{method}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def mesh_stats(mesh: Mesh) -> dict[str, int]:
    """Live rooms, pinned and parked pages across the mesh (all must return to 0: invariant I2)."""
    out: dict[str, int] = {}
    async with grpc.aio.insecure_channel(mesh.directory) as ch:
        d = await dpb_grpc.DirectoryServiceStub(ch).GetDirectoryStats(
            dpb.GetDirectoryStatsRequest(), timeout=5
        )
        out["directory.rooms_active"] = d.rooms_active
    for name, proc in mesh.procs.items():
        if proc.proc.poll() is not None or name == "directory":
            continue
        async with grpc.aio.insecure_channel(proc.address) as ch:
            if name.startswith("prefill"):
                p = await pre_grpc.PrefillServiceStub(ch).GetPrefillStats(
                    pre.GetPrefillStatsRequest(), timeout=5
                )
            else:
                p = await dec_grpc.DecodeServiceStub(ch).GetDecodeStats(
                    dec.GetDecodeStatsRequest(), timeout=5
                )
            out[f"{name}.rooms_active"] = p.rooms_active
            out[f"{name}.pages_pinned"] = p.engine.pages_pinned
            out[f"{name}.pages_parked"] = p.engine.pages_parked
            out[f"{name}.running"] = p.engine.running + p.engine.waiting
    return out


async def wait_drained(mesh: Mesh, timeout: float = 15.0) -> dict[str, int]:
    """Polls the stats RPCs until every counter is 0 (test-side only) and returns the last reading."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        stats = await mesh_stats(mesh)
        if not any(stats.values()) or asyncio.get_running_loop().time() > deadline:
            return stats
        await asyncio.sleep(0.1)
