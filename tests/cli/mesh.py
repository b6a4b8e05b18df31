"""One `xavier up` (pd default, plus a unified replica) shared by the router, client and CLI tests.

The first test that asks for it starts it; the session's end stops it. Every test module gets the same
instance through `mesh_fixture`, whichever conftest registered it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

_MESH: Mesh | None = None


@dataclass
class Mesh:
    proc: subprocess.Popen[bytes]
    grpc: str
    http: str
    directory: str
    model: Path
    workdir: Path
    log: Path

    def child_pids(self) -> dict[str, int]:
        """pid of each child, from their ready files."""
        pids = {}
        for ready in self.workdir.glob("*.ready"):
            pids[ready.stem] = int(json.loads(ready.read_text())["pid"])
        return pids

    def metrics_page(self, name: str) -> str:
        """The Prometheus page of the child `name` (its ready file's metrics address)."""
        address = json.loads((self.workdir / f"{name}.ready").read_text())["metrics"]
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
            return str(resp.read().decode())

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Waits until every service reports zero live rooms, pinned pages and running requests."""
        from xavier_client import Client

        deadline = time.monotonic() + timeout
        with Client(self.grpc) as client:
            while True:
                st = client.cluster_status()
                busy = [
                    (p.peer_id, p.rooms_active, p.engine.pages_pinned, p.engine.running)
                    for p in st.peers
                    if not p.error and (p.rooms_active or p.engine.pages_pinned or p.engine.running)
                ]
                if not busy and st.HasField("rooms") and st.rooms.active == 0 and st.requests_active == 0:
                    return
                if time.monotonic() > deadline:
                    raise AssertionError(f"still busy: {busy}, rooms {st.rooms}")
                time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(10)


def start_up(workdir: Path, cache: Path, *extra: str, timeout: float = 180.0, insecure: bool = True) -> Mesh:
    """Runs `xavier up` with ephemeral ports and waits for its ready file. Plaintext (`--insecure`)
    unless `insecure` is False: most tests dial the mesh's services directly; `tests/deploy/test_mtls.py`
    runs the default, mTLS with identities."""
    workdir.mkdir(parents=True, exist_ok=True)
    ready = workdir / "up.json"
    log = workdir / "up.log"
    env = {**os.environ, "XAVIER_CACHE_DIR": str(cache)}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "xavier_cli",
                "up",
                "--grpc",
                "127.0.0.1:0",
                "--http",
                "127.0.0.1:0",
                "--workdir",
                str(workdir / "svc"),
                "--ready-file",
                str(ready),
                *(["--insecure"] if insecure else []),
                *extra,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"xavier up failed:\n{log.read_text(errors='replace')}")
        time.sleep(0.1)
    info = json.loads(ready.read_text())
    return Mesh(
        proc, info["grpc"], info["http"], info["directory"], Path(info["model"]), workdir / "svc", log
    )


def shared_mesh(tmp_path_factory: pytest.TempPathFactory) -> Mesh:
    global _MESH
    if _MESH is None or _MESH.proc.poll() is not None:
        base = tmp_path_factory.mktemp("mesh")
        _MESH = start_up(base, shared_cache(tmp_path_factory), "--unified", "1")
    return _MESH


def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One model cache per session (the tiny checkpoint is made once)."""
    return tmp_path_factory.getbasetemp() / "xavier-cache"


def stop_shared_mesh() -> None:
    global _MESH
    if _MESH is not None:
        _MESH.stop()
        _MESH = None


@pytest.fixture(scope="session")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Mesh:
    return shared_mesh(tmp_path_factory)
