"""Opt-in, one or two GPUs: real SGLang through `xavier up --engine sglang` in its three modes, the same
greedy prompts through the router's public API each time, outputs compared:

- pd: an SGLang prefill (GPU 0) and decode (GPU 1, or GPU 0 on a one-GPU machine) with
  `--disaggregation-transfer-backend xavier`, hosted by Xavier's prefill and decode services and paired
  by the router;
- native: the same pair on SGLang's own NIXL backend, the router's native mode calling them over HTTP;
- colocated: one unified SGLang server (GPU 0).

Skipped unless `XAVIER_TEST_SGLANG=1`, a CUDA device and sglang importable. Both roles share GPU 0 when
there is one device (`xavier up` starts them one after another; `XAVIER_TEST_GPUS=0,0` forces it on two).
On the H200 machine (SGLang 0.5.17 staged as in ../shared/reference/sglang-gpu/one-gpu/, Xavier's runtime
dependencies importable):

    export PYTHONPATH=$PWD:$PWD/services:$PWD/clients:$PWD/protos/python:$PWD/engines:$PYTHONPATH
    XAVIER_TEST_SGLANG=1 python3 -m pytest -q -p no:cacheprovider -o timeout=1500 tests/sglang/test_gpu_pd.py

The fixtures start SGLang servers (a pair takes 100-150 s there, one after another on one GPU): pytest's
default timeout counts fixtures too, hence `-o timeout=1500` (native + pd took 285 s on one H200).

The model is a tiny random FP16 Qwen2 with a tokenizer (Xavier's contract fingerprints it), Triton
attention, the PyTorch sampler. pd and native must match exactly (the same kernels on the same GPUs);
colocated is compared too (one server: a different batch shape could flip a near tie, and the message
then names the prompt).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

if os.environ.get("XAVIER_TEST_SGLANG") != "1":
    pytest.skip("opt-in: set XAVIER_TEST_SGLANG=1 (needs a GPU)", allow_module_level=True)
torch = pytest.importorskip("torch")
if torch.cuda.device_count() < 1:
    pytest.skip("needs a CUDA device", allow_module_level=True)
PD_GPUS = os.environ.get("XAVIER_TEST_GPUS") or ("0,1" if torch.cuda.device_count() > 1 else "0,0")
pytest.importorskip(
    "sglang.srt.disaggregation.common.conn", reason="the real sglang package is not installed"
)

from xavier_client import Client  # noqa: E402

from tests.cli.mesh import Mesh  # noqa: E402
from tests.sglang.conftest import start_sglang  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.gpu, pytest.mark.slow]

PROMPTS = [[(7 * i + j) % 500 + 10 for j in range(n)] for i, n in enumerate((5, 17, 64, 300, 1000))]
MAX_TOKENS = 32


def _run(model: Path, tmp: Path, mode: str, *flags: str) -> list[list[int]]:
    mesh: Mesh = start_sglang(tmp, model, mode, *flags)
    try:
        with Client(mesh.grpc, timeout=300) as client:
            outs = []
            for ids in PROMPTS:
                res = client.generate(ids, max_tokens=MAX_TOKENS, mode=mode, ignore_eos=True, temperature=0.0)
                outs.append(list(res.token_ids))
        return outs
    finally:
        assert mesh.stop(timeout=120) == 0


@pytest.fixture(scope="module")
def native(gpu_model: Path, sglang_env: None, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    return _run(gpu_model, tmp_path_factory.mktemp("native"), "native", "--gpus", PD_GPUS)


def test_xavier_pd_matches_native_nixl(
    gpu_model: Path, native: list[list[int]], sglang_env: None, tmp_path_factory: pytest.TempPathFactory
) -> None:
    got = _run(gpu_model, tmp_path_factory.mktemp("pd"), "pd", "--gpus", PD_GPUS)
    assert all(len(o) == MAX_TOKENS for o in got)
    assert got == native


def test_colocated_matches_native_nixl(
    gpu_model: Path, native: list[list[int]], sglang_env: None, tmp_path_factory: pytest.TempPathFactory
) -> None:
    got = _run(gpu_model, tmp_path_factory.mktemp("colocated"), "colocated", "--unified", "1", "--gpus", "0")
    for ids, a, b in zip(PROMPTS, got, native, strict=True):
        assert a == b, f"prompt of {len(ids)} tokens: colocated {a} vs native {b}"
