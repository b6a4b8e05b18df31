"""Opt-in, two GPUs: real SGLang prefill and decode servers with `--disaggregation-transfer-backend xavier`,
compared with the same pair on SGLang's native NIXL backend (greedy outputs must be identical).

Skipped unless `XAVIER_TEST_SGLANG=1`, two CUDA devices, and sglang importable. Run on the 2-GPU H200 machine
(SGLang 0.5.17 staged as in ../shared/reference/sglang-gpu/, Xavier installed into the same Python):

    XAVIER_TEST_SGLANG=1 python -m pytest -q -p no:cacheprovider tests/sglang/test_gpu_pd.py

Each pair: a directory process; prefill on GPU 0 (HTTP 30000, bootstrap 8998), decode on GPU 1 (HTTP 30001);
Triton attention, FP16, a tiny random Qwen2 with a tokenizer (Xavier's contract fingerprints it). The same
`/generate` body goes to both servers with `bootstrap_host`, `bootstrap_port` and a 63-bit `bootstrap_room`.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("XAVIER_TEST_SGLANG") != "1":
    pytest.skip("opt-in: set XAVIER_TEST_SGLANG=1 (needs two GPUs)", allow_module_level=True)
torch = pytest.importorskip("torch")
if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA devices", allow_module_level=True)
pytest.importorskip(
    "sglang.srt.disaggregation.common.conn", reason="the real sglang package is not installed"
)
requests = pytest.importorskip("requests")

pytestmark = [pytest.mark.sglang, pytest.mark.gpu, pytest.mark.slow]

PREFILL, DECODE, BOOTSTRAP = "http://127.0.0.1:30000", "http://127.0.0.1:30001", 8998
COMMON = [
    "--skip-tokenizer-init", "--attention-backend", "triton", "--sampling-backend", "pytorch",
    "--dtype", "float16", "--mem-fraction-static", "0.5", "--host", "127.0.0.1", "--log-level", "warning",
]  # fmt: skip


def _launch(model: Path, backend: str, env: dict[str, str], logs: Path) -> list[subprocess.Popen[bytes]]:
    procs = []
    for role, port, gpu in (("prefill", 30000, 0), ("decode", 30001, 1)):
        args = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), *COMMON,
                "--port", str(port), "--base-gpu-id", str(gpu), "--disaggregation-mode", role,
                "--disaggregation-transfer-backend", backend]  # fmt: skip
        if role == "prefill":
            args += ["--disaggregation-bootstrap-port", str(BOOTSTRAP)]
        with open(logs / f"{backend}-{role}.log", "wb") as log:  # the child keeps its own descriptor
            procs.append(
                subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})
            )
    deadline = time.monotonic() + 600
    for url, proc in zip((PREFILL, DECODE), procs, strict=True):
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{url} exited {proc.returncode}; see {logs}")
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not healthy; see {logs}")
            time.sleep(2)
    return procs


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()


def _generate(ids: list[int]) -> list[int]:
    body: dict[str, Any] = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": BOOTSTRAP,
        "bootstrap_room": random.getrandbits(62) | 1,
    }
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        p = pool.submit(requests.post, PREFILL + "/generate", json=body, timeout=300)
        d = pool.submit(requests.post, DECODE + "/generate", json=body, timeout=300)
        p.result().raise_for_status()
        out = d.result()
    out.raise_for_status()
    return list(out.json()["output_ids"])


PROMPTS = [[(7 * i + j) % 500 + 10 for j in range(n)] for i, n in enumerate((5, 17, 64, 300, 1000))]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
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


@pytest.fixture(scope="module")
def native_outputs(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[list[int]]]:
    procs = _launch(model, "nixl", {}, tmp_path_factory.mktemp("native"))
    try:
        yield [_generate(ids) for ids in PROMPTS]
    finally:
        _stop(procs)


def test_xavier_backend_matches_native_nixl(
    model: Path, native_outputs: list[list[int]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    from tests.support.procs import start_service

    logs = tmp_path_factory.mktemp("xavier")
    directory = start_service("xavier-directory", ["--listen", "127.0.0.1:0"], logs)
    env = {"SGLANG_PLUGINS": "xavier", "XAVIER_DIRECTORY": directory.address}
    procs = _launch(model, "xavier", env, logs)
    try:
        got = [_generate(ids) for ids in PROMPTS]
    finally:
        _stop(procs)
        directory.stop()
    assert got == native_outputs
    assert all(len(o) == 32 for o in got)
