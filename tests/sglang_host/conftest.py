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

from tests.sglang.conftest import directory, tiny_model
from tests.support.procs import ServiceProc, start_service

__all__ = ["directory", "tiny_model"]  # the SGLang conformance tests' fixtures, shared

STANDIN = json.dumps([sys.executable, "-m", "tests.support.sglang_standin"])
ROLE_BINARY = {
    "prefill": ("xavier-prefill", []),
    "decode": ("xavier-decode", []),
    "unified": ("xavier-decode", ["--role", "unified"]),
}


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
