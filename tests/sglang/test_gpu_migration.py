"""Opt-in, one GPU or more: request migration between real SGLang pairs (`xavier up --engine sglang --mode
pd --prefill 1 --decode 2`, every replica on GPU 0 unless `XAVIER_TEST_GPUS` says otherwise).

16 greedy streams run through the router; once they have streamed a seeded number of tokens in all, the
SGLang server under one decode is killed (kill -9 of it and everything it started, as a crashed GPU
process dies). Every stream must complete with every token, none repeated, and what follows each seam
(the `migrations` field of the router's request line says where) must be a greedy continuation of prompt +
the tokens before it: equal to a fresh greedy run of that prompt, except that SGLang's kernels are not
batch-invariant (the streams ran in a batch of 16, the fresh run alone), so the two may part at a near tie
— where they part, each run's token has a logprob within `NEAR_TIE` of the other's, i.e. both were the
top choice by a rounding margin. Afterwards the mesh holds no room, pinned page or running request.

    export PYTHONPATH=$PWD:$PWD/services:$PWD/clients:$PWD/protos/python:$PWD/engines:$PYTHONPATH
    XAVIER_TEST_SGLANG=1 python3 -m pytest -q -s -p no:cacheprovider -o timeout=1800 \
        tests/sglang/test_gpu_migration.py

It prints the streams moved, how many whole answers equal an uninterrupted run, the seam times and the
prompt tokens each new prefill found cached (the figures issue "No request lost mid-stream" asks for).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

if os.environ.get("XAVIER_TEST_SGLANG") != "1":
    pytest.skip("opt-in: set XAVIER_TEST_SGLANG=1 (needs a GPU)", allow_module_level=True)
torch = pytest.importorskip("torch")
if torch.cuda.device_count() < 1:
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip(
    "sglang.srt.disaggregation.common.conn", reason="the real sglang package is not installed"
)

from xavier.v1 import types_pb2  # noqa: E402

from tests.cli.mesh import Mesh  # noqa: E402
from tests.faults.conftest import metric_values  # noqa: E402
from tests.faults.migration_mesh import Streamed, moves_in, prompt_ids, request, stream  # noqa: E402
from tests.sglang.conftest import start_sglang  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.gpu, pytest.mark.slow]

GPUS = os.environ.get("XAVIER_TEST_GPUS") or "0"
STREAMS, MAX_TOKENS = 16, 160
NEAR_TIE = 0.05  # nats: two runs' top choices this close are a tie that rounding may break either way


@pytest.fixture(scope="module")
def mesh(gpu_model: Path, sglang_env: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    tmp = tmp_path_factory.mktemp("migration")
    # Three SGLang servers share the GPU: each takes a smaller share of its memory.
    m = start_sglang(
        tmp,
        gpu_model,
        "pd",
        "--prefill",
        "1",
        "--decode",
        "2",
        "--gpus",
        GPUS,
        mem_fraction=0.2,
        timeout=1200,
    )
    try:
        yield m
    finally:
        m.stop(timeout=180)  # a replica was killed: the exit status is the supervisor's, not this test's


def _descendants(pid: int) -> list[int]:
    """Every process under `pid` (children first found, then theirs)."""
    by_parent: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        by_parent.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in by_parent.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _output_tokens(mesh: Mesh) -> float:
    return sum(metric_values(mesh.metrics_page("router"), "xavier_router_output_tokens_total").values())


async def _fresh(mesh: Mesh, ids: list[int], max_tokens: int) -> Streamed:
    out = await stream(mesh.grpc, request("", ids, max_tokens, temperature=0.0, logprobs=True))
    assert out.error is None and len(out.tokens) == max_tokens, out
    return out


def _parts_at(got: Streamed, start: int, fresh: Streamed) -> int | None:
    """Where `got`'s tokens from `start` on first differ from `fresh`'s (None: nowhere), after checking
    that they part at a near tie (both tokens their run's top choice within NEAR_TIE)."""
    for i, (a, b) in enumerate(zip(got.tokens[start:], fresh.tokens, strict=True)):
        if a != b:
            assert len(got.logprobs) == len(got.tokens) and len(fresh.logprobs) == len(fresh.tokens), (
                f"parted at {start + i}, and the streams carry no logprob for every token to judge the tie"
            )
            la, lb = got.logprobs[start + i], fresh.logprobs[i]
            assert abs(la - lb) <= NEAR_TIE, (
                f"parted at {start + i} on no tie: {a} ({la:.4f}) vs {b} ({lb:.4f})"
            )
            return start + i
    return None


async def test_kill_an_sglang_decode_under_16_streams_loses_no_token(mesh: Mesh) -> None:
    rng = random.Random(2022)
    victim = rng.choice(["decode-0", "decode-1"])
    at = rng.randrange(STREAMS * 4, STREAMS * 40)
    prompts = [prompt_ids(900 + i, n=24 + 37 * i) for i in range(STREAMS)]
    host = int(json.loads((mesh.workdir / f"{victim}.ready").read_text())["pid"])
    base = _output_tokens(mesh)

    async def killer() -> None:
        for _ in range(30000):
            if _output_tokens(mesh) - base >= at:
                engines = _descendants(host)
                assert engines, f"{victim} runs no SGLang server"
                for pid in engines:
                    os.kill(pid, signal.SIGKILL)
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the streams never reached the kill point")

    kill = asyncio.ensure_future(killer())
    outs: list[Streamed] = await asyncio.gather(
        *(
            stream(mesh.grpc, request(f"gpu-kill-{i}", p, MAX_TOKENS, temperature=0.0, logprobs=True))
            for i, p in enumerate(prompts)
        )
    )
    await kill
    moved = moves_in((mesh.workdir / "router.log").read_text())
    whole_equal, continued_equal, parted = 0, 0, []
    for i, (ids, out) in enumerate(zip(prompts, outs, strict=True)):
        assert out.error is None, (i, out.error)
        assert len(out.tokens) == MAX_TOKENS and out.finish == types_pb2.FINISH_REASON_LENGTH, (i, out)
        seams = [m.at for m in moved.get(out.request_id, [])]
        for seam in seams:
            where = _parts_at(out, seam, await _fresh(mesh, ids + out.tokens[:seam], MAX_TOKENS - seam))
            continued_equal += where is None
            if where is not None:
                parted.append((i, seam, where))
        whole = await _fresh(mesh, ids, MAX_TOKENS)
        if seams:  # reported: a re-prefill and a decode step round differently
            whole_equal += out.tokens == whole.tokens
        else:  # an unmoved stream is a plain greedy run (up to a near tie: it ran in a batch of 16)
            whole_equal += _parts_at(out, 0, whole) is None
    every = [m for ms in moved.values() for m in ms]
    assert every, f"no stream was on {victim}"
    seams_ms = sorted(round(1000 * (m.seam_s or 0), 1) for m in every)
    print(
        f"\nSGLang migration: {len({r for r in moved})}/{STREAMS} streams moved off {victim} at {at} tokens; "
        f"continuations equal to a fresh run {continued_equal}/{len(every)} (parted at a near tie: "
        f"{parted}); whole answers equal to an uninterrupted run {whole_equal}/{STREAMS}; "
        f"seam ms {seams_ms}; "
        f"cached/new prompt tokens {[(m.cached, m.prompt) for m in every]}"
    )
    mesh.wait_idle(60.0)
