"""Fixtures of the SGLang conformance tests: a directory process, a tiny model, the plugin's entry point.

These tests need the real `sglang` package (the optional `sglang-test` extra; docs/sglang.md has the
recipe); each module skips with the reason when it cannot be imported. The default CI venv has no SGLang.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from tests.cli.mesh import Mesh, start_up
from tests.support.procs import ServiceProc, start_service

DIRECTORY_ENV = {
    "XAVIER_DIRECTORY__HEARTBEAT_INTERVAL_SECONDS": "0.3",
    "XAVIER_DIRECTORY__PEER_LEASE_SECONDS": "3",
    "XAVIER_DIRECTORY__SWEEP_INTERVAL_SECONDS": "0.05",
    "XAVIER_DIRECTORY__ROOM_LEASE_SECONDS": "30",
}


@pytest.fixture(scope="session")
def plugin_entry_point(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Makes `xavier_sglang.plugin:register` discoverable in group `sglang.srt.plugins` (as an install
    of this project does) and returns the path added to `sys.path`, or "" when already installed."""
    if any(ep.name == "xavier" for ep in entry_points(group="sglang.srt.plugins")):
        return ""
    root = tmp_path_factory.mktemp("plugin-dist")
    info = root / "xavier_sglang_probe-0.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: xavier-sglang-probe\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text("[sglang.srt.plugins]\nxavier = xavier_sglang.plugin:register\n")
    sys.path.insert(0, str(root))
    return str(root)


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProc]:
    proc = start_service(
        "xavier-directory", ["--listen", "127.0.0.1:0"], tmp_path_factory.mktemp("dir"), env=DIRECTORY_ENV
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Qwen2-shaped checkpoint: 2 KV heads of 16 dims, float32 (what `peer` allocates for)."""
    from xavier_core.engine.tiny import make_tiny

    return make_tiny(
        tmp_path_factory.mktemp("model") / "tiny", "qwen2", layers=2, hidden=64, heads=4, kv_heads=2
    )


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GPU modules' checkpoint: a tiny random FP16 Qwen2 with a tokenizer (4 layers, hidden 256)."""
    from xavier_core.engine.tiny import make_tiny

    return make_tiny(
        tmp_path_factory.mktemp("m") / "tiny",
        "qwen2",
        layers=4,
        hidden=256,
        heads=4,
        kv_heads=2,
        dtype="float16",
    )


def sglang_args(mem_fraction: float = 0.3) -> list[str]:
    """The GPU modules' SGLang flags: Triton attention, the PyTorch sampler, `mem_fraction` of the GPU
    for each server's weights and KV pool (servers that share a GPU take less each)."""
    return [
        "--attention-backend", "triton", "--sampling-backend", "pytorch",
        "--mem-fraction-static", str(mem_fraction), "--cuda-graph-max-bs", "16", "--log-level", "warning",
    ]  # fmt: skip


def start_sglang(
    tmp: Path, model: Path, mode: str, *flags: str, mem_fraction: float = 0.3, timeout: float = 900
) -> Mesh:
    """`xavier up --engine sglang --mode <mode>` on `model` (no page store) with the GPU modules' SGLang
    flags; `flags` are more of `xavier up`'s (replicas, --gpus)."""
    command = json.dumps([sys.executable, "-m", "sglang.launch_server"])
    args = ["--engine", "sglang", "--model", str(model), "--mode", mode, "--no-pagestore",
            "--sglang-command", command, *flags,
            *(f"--sglang-arg={a}" for a in sglang_args(mem_fraction))]  # fmt: skip
    return start_up(tmp, tmp / "cache", *args, timeout=timeout)


@pytest.fixture(scope="module")
def sglang_env(plugin_entry_point: str) -> Iterator[None]:
    """SGLang's processes find the plugin's entry point through PYTHONPATH (an install of Xavier into
    SGLang's environment does the same)."""
    saved = os.environ.get("PYTHONPATH")
    root = Path(__file__).resolve().parents[2]
    parts = [plugin_entry_point, str(root), str(root / "services"), str(root / "clients"),
             str(root / "protos" / "python"), str(root / "engines"), saved or ""]  # fmt: skip
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in parts if p)
    yield
    if saved is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = saved
