"""Fixtures of the SGLang-host service tests: a directory, a tiny checkpoint, services whose SGLang is the
stand-in (`tests.support.sglang_standin`), and helpers to read the stand-in's state."""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.procs import ServiceProc, start_service

STANDIN = json.dumps([sys.executable, "-m", "tests.support.sglang_standin"])
DIRECTORY_ENV = {
    "XAVIER_DIRECTORY__HEARTBEAT_INTERVAL_SECONDS": "0.3",
    "XAVIER_DIRECTORY__PEER_LEASE_SECONDS": "3",
    "XAVIER_DIRECTORY__SWEEP_INTERVAL_SECONDS": "0.05",
}
ROLE_BINARY = {
    "prefill": ("xavier-prefill", []),
    "decode": ("xavier-decode", []),
    "unified": ("xavier-decode", ["--role", "unified"]),
}


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProc]:
    proc = start_service(
        "xavier-directory", ["--listen", "127.0.0.1:0"], tmp_path_factory.mktemp("dir"), env=DIRECTORY_ENV
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from xavier_core.engine.tiny import make_tiny

    return make_tiny(
        tmp_path_factory.mktemp("model") / "tiny", "qwen2", layers=2, hidden=64, heads=4, kv_heads=2
    )


Start = Callable[..., ServiceProc]


@pytest.fixture
def start_sglang_peer(directory: ServiceProc, tiny_model: Path, tmp_path: Path) -> Iterator[Start]:
    """Starts a prefill/decode/unified service with engine.kind = "sglang" and the stand-in as SGLang."""
    started: list[ServiceProc] = []

    def start(
        role: str, name: str | None = None, env: dict[str, str] | None = None, **kw: Any
    ) -> ServiceProc:
        binary, extra = ROLE_BINARY[role]
        full_env = {
            "XAVIER_SGLANG__COMMAND": STANDIN,
            "XAVIER_SGLANG__HEALTH_TIMEOUT_SECONDS": "60",
            "XAVIER_STANDIN_DIR": str(tmp_path / "rendezvous"),
            "XAVIER_STANDIN_RENDEZVOUS_SECONDS": "3",
            **(env or {}),
        }
        args = ["--engine", "sglang", "--model", str(tiny_model), "--directory", directory.address,
                "--listen", "127.0.0.1:0", *extra]  # fmt: skip
        proc = start_service(binary, args, tmp_path, name=name or role, env=full_env, **kw)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


def ready_info(proc: ServiceProc, workdir: Path) -> dict[str, Any]:
    return dict(json.loads((workdir / f"{proc.name}.ready").read_text()))


def standin_state(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/standin/state", timeout=5) as resp:
        return dict(json.loads(resp.read()))
