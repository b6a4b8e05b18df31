"""`xavier up` supervises: a killed decode comes back under a new epoch and serves; the mesh never exits."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest
from xavier_client import Client

from tests.cli.mesh import shared_cache, start_up

pytestmark = pytest.mark.integration


def _ready_pid(workdir: Path, name: str) -> int | None:
    try:
        return int(json.loads((workdir / f"{name}.ready").read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def _decodes_served(workdir: Path, name: str) -> float:
    """Decode RPCs the service answered OK, from its own /metrics (its address is in its ready file)."""
    metrics = json.loads((workdir / f"{name}.ready").read_text())["metrics"]
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("xavier_rpc_total{") and 'method="Decode"' in line and 'code="OK"' in line
    )


def _epochs(client: Client) -> dict[str, int]:
    return {p.peer_id: p.epoch for p in client.cluster_status().peers if not p.error}


def test_a_killed_decode_is_restarted_and_serves(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    up = start_up(
        tmp_path,
        shared_cache(tmp_path_factory),
        "--prefill",
        "2",
        "--decode",
        "2",
        "--restart-backoff",
        "0.2",
        "--max-restarts",
        "3",
    )
    try:
        log = up.log.read_text()
        assert "metrics " in log and "/metrics" in log  # the metrics endpoints are printed at start
        with Client(up.grpc, timeout=60) as client:
            before = _epochs(client)
            assert set(before) == {"prefill-0", "prefill-1", "decode-0", "decode-1"}
            victim = _ready_pid(up.workdir, "decode-1")
            assert victim is not None
            os.kill(victim, signal.SIGKILL)
            deadline = time.monotonic() + 120
            after: dict[str, int] = {}
            while time.monotonic() < deadline:
                assert up.proc.poll() is None, up.log.read_text()  # the mesh never exits
                pid = _ready_pid(up.workdir, "decode-1")
                after = _epochs(client)
                if pid not in (None, victim) and after.get("decode-1", 0) > before["decode-1"]:
                    break
                time.sleep(0.2)
            else:
                raise AssertionError(f"decode-1 did not come back: {after}\n{up.log.read_text()}")
            assert after["decode-0"] == before["decode-0"]  # the others kept their registrations
            # Equal peers share work at random: 16 requests reach the restarted decode (all but 2^-16).
            served = {
                client.generate("Hello there", max_tokens=4, mode="pd").completion_tokens for _ in range(16)
            }
            assert served == {4}
            assert _decodes_served(up.workdir, "decode-1") >= 1
        text = up.log.read_text()
        assert "decode-1 exited (signal SIGKILL)" in text and "decode-1 is back at" in text
        assert up.proc.poll() is None
    finally:
        assert up.stop() == 0
