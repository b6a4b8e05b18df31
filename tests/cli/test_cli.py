"""`xavier up` end to end: endpoints, generate and status commands, and a clean stop on SIGTERM and SIGINT."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from tests.cli.mesh import Mesh, shared_cache, start_up
from tests.pagestore.support import stats

pytestmark = pytest.mark.integration
# The `xavier` command, run as a module so it needs no installed script.
XAVIER = (sys.executable, "-m", "xavier_cli")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie of an already-reaped tree is gone for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_generate_and_status_commands(mesh: Mesh) -> None:
    out = subprocess.run(
        [*XAVIER, "generate", "Hello there", "--address", mesh.grpc, "--max-tokens", "5", "-v"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "finish=" in out.stderr and "+5 ttft" in out.stderr.replace("tokens=", "")
    out = subprocess.run(
        [*XAVIER, "generate", "Hi", "--stream", "--mode", "colocated", "--address", mesh.grpc, "--chat"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    out = subprocess.run(
        [*XAVIER, "status", "--address", mesh.grpc], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    for word in ("prefill-0", "decode-0", "unified-0", "rooms:", "default mode pd"):
        assert word in out.stdout
    bad = subprocess.run(
        [*XAVIER, "generate", "", "--address", mesh.grpc],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 1 and "EMPTY_PROMPT" in bad.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_up_stops_every_child_and_exits_zero(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, sig: int
) -> None:
    up = start_up(tmp_path, shared_cache(tmp_path_factory), "--mode", "colocated")
    pids = up.child_pids()
    assert set(pids) == {"directory", "pagestore", "unified-0", "router"}
    assert all(_alive(p) for p in pids.values())
    assert "Xavier is up" in up.log.read_text()
    started = time.monotonic()
    assert up.stop(sig) == 0
    assert time.monotonic() - started < 30
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [n for n, p in pids.items() if _alive(p)]
    assert not list(up.workdir.glob("*.ready"))


def test_cli_names_what_is_wrong(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        up = subprocess.run([*XAVIER, "up", "--grpc", address], capture_output=True, text=True, timeout=60)
    assert up.returncode == 2 and "Choose another with --grpc" in up.stderr and "Traceback" not in up.stderr
    status = subprocess.run(
        [*XAVIER, "status", "--address", address, "--timeout", "3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 1 and "is `xavier up` running" in status.stderr
    version = subprocess.run([*XAVIER, "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("xavier ")


def test_make_tiny_command(tmp_path: Path) -> None:
    out = subprocess.run(
        [*XAVIER, "models", "make-tiny", str(tmp_path / "m"), "--arch", "llama", "--layers", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "m" / "config.json").is_file() and (tmp_path / "m" / "tokenizer.json").is_file()


def test_up_sizes_the_page_store_arena_alone(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`--pagestore-arena-bytes` reaches the store's command line, not the environment every child reads:
    the engines' own `pagestore` settings (a client's) would refuse an arena key and stop `xavier up`."""
    arena = 48 << 20
    up = start_up(
        tmp_path, shared_cache(tmp_path_factory), "--mode", "colocated", "--pagestore-arena-bytes", str(arena)
    )
    try:
        assert set(up.child_pids()) == {"directory", "pagestore", "unified-0", "router"}
        store = json.loads((up.workdir / "pagestore.ready").read_text())["address"]
        assert stats(store).capacity_bytes == arena
    finally:
        assert up.stop(signal.SIGTERM) == 0


def test_up_share_prefixes_lists_the_unified_replicas_endpoints(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`--share-prefixes` turns on `handoff.share_prefixes` in the replicas: each unified replica opens a
    transfer port and the directory lists its endpoint, where its peers' store fetches find it; without
    the flag a unified replica has none. Asked of a mesh without the store, it is refused."""
    from xavier.v1 import directory_service_pb2 as dpb
    from xavier.v1 import directory_service_pb2_grpc as dpb_grpc
    from xavier.v1 import types_pb2

    refused = subprocess.run(
        [sys.executable, "-m", "xavier_cli", "up", "--insecure", "--no-pagestore", "--share-prefixes"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "--share-prefixes" in refused.stderr
    up = start_up(
        tmp_path, shared_cache(tmp_path_factory), "--mode", "colocated", "--unified", "2", "--share-prefixes"
    )
    try:
        directory = json.loads((tmp_path / "up.json").read_text())["directory"]
        with grpc.insecure_channel(directory) as ch:
            listed = dpb_grpc.DirectoryServiceStub(ch).ListPeers(
                dpb.ListPeersRequest(role=types_pb2.ROLE_UNIFIED), timeout=10
            )
        assert sorted(p.peer_id for p in listed.peers) == ["unified-0", "unified-1"]
        assert all(p.HasField("endpoint") and p.endpoint.agent_name for p in listed.peers)
    finally:
        assert up.stop(signal.SIGTERM) == 0
