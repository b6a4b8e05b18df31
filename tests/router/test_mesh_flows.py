"""P/D and colocated routing end to end: equality, concurrency, abort and disconnect leave nothing live."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from xavier_client import AsyncClient, Client, InvalidArgumentError

from tests.cli.mesh import Mesh
from tests.faults.conftest import metric_values

pytestmark = pytest.mark.integration


def test_greedy_pd_equals_colocated(mesh: Mesh) -> None:
    with Client(mesh.grpc) as client:
        for prompt in ("Hello there", "The capital of France is", "Numbers: one, two, three"):
            pd = client.generate(prompt, max_tokens=12, mode="pd", ignore_eos=True)
            co = client.generate(prompt, max_tokens=12, mode="colocated", ignore_eos=True)
            assert pd.mode == "pd" and co.mode == "colocated"
            assert pd.token_ids == co.token_ids
            assert pd.text == co.text
            assert pd.completion_tokens == 12 and pd.finish_reason == "length"
    mesh.wait_idle()


def _release_sources(mesh: Mesh) -> float:
    """ReleaseSource calls the prefills have served (`xavier_rpc_total`, every status code)."""
    return sum(
        value
        for ready in mesh.workdir.glob("prefill-*.ready")
        for labels, value in metric_values(mesh.metrics_page(ready.stem), "xavier_rpc_total{").items()
        if 'method="ReleaseSource"' in labels
    )


def test_a_finished_request_releases_nothing_a_cancelled_one_does(mesh: Mesh) -> None:
    """The decode read the source and notified the prefill: a request that finished costs no
    ReleaseSource. One the client gives up on mid-stream does (the source is unpinned then)."""
    with Client(mesh.grpc) as client:
        before = _release_sources(mesh)
        for n in range(4):
            res = client.generate(f"Finish number {n}", max_tokens=3 + n, mode="pd", ignore_eos=True)
            assert res.finish_reason == "length"
        assert _release_sources(mesh) == before
        stream = client.generate_stream("Cancel me early", max_tokens=400, mode="pd", ignore_eos=True)
        for n, _ in enumerate(stream):
            if n == 2:
                stream.cancel()
    mesh.wait_idle()
    assert _release_sources(mesh) == before + 1


def test_first_token_only_request(mesh: Mesh) -> None:
    """A request the first token ends stops at the prefill: no room is opened, no decode is called."""
    with Client(mesh.grpc) as client:
        opened = client.cluster_status().rooms.opened
        res = client.generate("Hello", max_tokens=1, mode="pd")
        assert len(res.token_ids) == 1 and res.finish_reason == "length"
        assert client.cluster_status().rooms.opened == opened
        # The one token's text is the engine's, flushed (an incomplete UTF-8 byte ends as U+FFFD), the
        # same as a colocated replica's: sampled with seeds, so byte-level tokens turn up too.
        for seed in range(12):
            kw = {"max_tokens": 1, "temperature": 1.0, "seed": seed}
            pd = client.generate("Hello", mode="pd", **kw)
            co = client.generate("Hello", mode="colocated", **kw)
            assert pd.token_ids == co.token_ids and pd.text == co.text
    mesh.wait_idle()


async def test_32_concurrent_clients(mesh: Mesh) -> None:
    async with AsyncClient(mesh.grpc) as client:
        modes = ["pd", "colocated"] * 16
        results = await asyncio.gather(
            *(
                client.generate(f"Request {i}: tell me", max_tokens=6, mode=m, ignore_eos=True)  # type: ignore[arg-type]
                for i, m in enumerate(modes)
            )
        )
    assert all(r.completion_tokens == 6 for r in results)
    assert {r.mode for r in results} == {"pd", "colocated"}
    mesh.wait_idle()


@pytest.mark.parametrize("mode", ["pd", "colocated"])
def test_abort_mid_stream(mesh: Mesh, mode: str) -> None:
    with Client(mesh.grpc) as client:
        stream = client.generate_stream("Long answer please", max_tokens=400, mode=mode, ignore_eos=True)  # type: ignore[arg-type]
        chunks = []
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 3:
                assert client.abort(stream.request_id)
        assert chunks[-1].finish_reason == "abort"
        assert sum(len(c.token_ids) for c in chunks) < 400
        assert not client.abort(stream.request_id)
    mesh.wait_idle()


@pytest.mark.parametrize("mode", ["pd", "colocated"])
def test_client_cancel_mid_stream(mesh: Mesh, mode: str) -> None:
    with Client(mesh.grpc) as client:
        stream = client.generate_stream("Cancel me", max_tokens=400, mode=mode, ignore_eos=True)  # type: ignore[arg-type]
        for n, _ in enumerate(stream):
            if n == 2:
                stream.cancel()
    mesh.wait_idle()


def test_http_disconnect_mid_stream(mesh: Mesh) -> None:
    body = {
        "model": mesh.model.name,
        "prompt": "Disconnect",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"http://{mesh.http}/v1/completions", json=body) as r,
    ):
        for n, _ in enumerate(r.iter_lines()):
            if n == 4:
                break
    mesh.wait_idle()


def test_bad_requests_over_grpc(mesh: Mesh) -> None:
    cases = [
        ({"prompt": ""}, "EMPTY_PROMPT"),
        ({"prompt": [], "max_tokens": 4}, "EMPTY_PROMPT"),
        ({"prompt": "hi", "max_tokens": 0}, "INVALID_MAX_TOKENS"),
        ({"prompt": "hi", "max_tokens": 5000}, "MAX_TOKENS_TOO_LARGE"),
        ({"prompt": list(range(5000)), "max_tokens": 1}, "INVALID_TOKEN_ID"),
        ({"prompt": [1] * 5000, "max_tokens": 1}, "PROMPT_TOO_LONG"),
        ({"prompt": "hi", "model": "other"}, "UNKNOWN_MODEL"),
    ]
    with Client(mesh.grpc) as client:
        for kw, reason in cases:
            prompt = kw.pop("prompt")
            with pytest.raises(InvalidArgumentError) as info:
                client.generate(prompt, **kw)  # type: ignore[arg-type]
            assert info.value.reason == reason, (kw, info.value)
    mesh.wait_idle()


_BUF = shutil.which("buf") or str(Path(sys.executable).parent / "buf")


@pytest.mark.skipif(not Path(_BUF).exists(), reason="buf is not installed")
def test_buf_curl_with_reflection(mesh: Mesh) -> None:
    buf = _BUF
    out = subprocess.run(
        [
            buf,
            "curl",
            "--protocol",
            "grpc",
            "--http2-prior-knowledge",
            "-d",
            '{"text": "Hello", "sampling": {"max_tokens": 3}, "mode": "ROUTING_MODE_COLOCATED"}',
            f"http://{mesh.grpc}/xavier.v1.RouterService/Generate",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert '"finishReason": "FINISH_REASON_LENGTH"' in out.stdout
