"""`xavier up` starts a page store by default and points its engines at it; OpenAI usage reports the
reused prompt tokens (stream and not); `xavier status` shows the store, `--json` prints peers and store."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from xavier_client import Client

from tests.cli.mesh import Mesh, shared_cache, start_up
from tests.pagestore.engines import prompt
from tests.pagestore.support import stats

pytestmark = pytest.mark.integration

XAVIER = [sys.executable, "-m", "xavier_cli"]
PREFIX = 2000


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Mesh, str, Path]]:
    base = tmp_path_factory.mktemp("up-store")
    cache = shared_cache(tmp_path_factory)
    mesh = start_up(base, cache, "--mode", "colocated", "--unified", "2")
    try:
        yield mesh, json.loads((base / "up.json").read_text())["pagestore"], cache
    finally:
        mesh.stop()


def _complete(http: httpx.Client, url: str, ids: list[int], stream: bool) -> dict[str, object]:
    body = {"model": "tiny-qwen2", "prompt": ids, "max_tokens": 4, "temperature": 0, "stream": stream}
    if not stream:
        resp = http.post(url, json=body)
        assert resp.status_code == 200, resp.text
        usage: dict[str, object] = resp.json()["usage"]
        return usage
    body["stream_options"] = {"include_usage": True}
    with http.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    (usage,) = [c["usage"] for c in chunks if c.get("usage")]
    return usage


def test_up_shares_pages_and_reports_them(up: tuple[Mesh, str, Path]) -> None:
    mesh, store, cache = up
    assert store, "xavier up started no page store"
    url = f"http://{mesh.http}/v1/completions"
    shared = prompt(41, PREFIX)
    with httpx.Client(timeout=120) as http:
        cold = _complete(http, url, shared + prompt(42, 30), stream=False)
        assert cold["prompt_tokens_details"] == {"cached_tokens": 0}
        # The write-through is asynchronous: the next request may land on the other replica.
        deadline = time.monotonic() + 30
        while stats(store).pages < PREFIX // 16 and time.monotonic() < deadline:
            time.sleep(0.05)
        warm = _complete(http, url, shared + prompt(43, 30), stream=False)
        streamed = _complete(http, url, shared + prompt(44, 30), stream=True)
    for usage in (warm, streamed):
        details = usage["prompt_tokens_details"]
        assert isinstance(details, dict) and details["cached_tokens"] >= 0.9 * PREFIX, usage
    # The router's gRPC answer splits the reuse into the replica's own cache and the store.
    with Client(mesh.grpc) as client:
        res = client.generate(shared + prompt(45, 30), max_tokens=4)
    assert res.cached_tokens >= 0.9 * PREFIX
    assert res.cached_tokens == res.cached_tokens_local + res.cached_tokens_store

    # No --pagestore: status finds the store of the `xavier up` serving that router address.
    text = subprocess.run(
        [*XAVIER, "status", "--address", mesh.grpc],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "XAVIER_CACHE_DIR": str(cache)},
    )
    assert text.returncode == 0, text.stderr
    assert f"pagestore {store}:" in text.stdout and "unified-1" in text.stdout
    out = subprocess.run(
        [*XAVIER, "status", "--address", mesh.grpc, "--pagestore", store, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert sorted(p["peer_id"] for p in doc["peers"]) == ["unified-0", "unified-1"]
    assert int(doc["pagestore"]["pages"]) >= PREFIX // 16 and doc["pagestore"]["error"] == ""
    reused = sum(int(p["engine"].get("prompt_tokens_cached", 0)) for p in doc["peers"])
    assert reused >= 2 * 0.9 * PREFIX


def test_status_reports_an_unreachable_store(up: tuple[Mesh, str, Path]) -> None:
    mesh, _, _ = up
    out = subprocess.run(
        [*XAVIER, "status", "--address", mesh.grpc, "--pagestore", "127.0.0.1:1", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["pagestore"]["error"].startswith("UNAVAILABLE")


@pytest.fixture(scope="module")
def up_pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Mesh, str]]:
    base = tmp_path_factory.mktemp("up-store-pd")
    mesh = start_up(base, shared_cache(tmp_path_factory), "--unified", "1")  # 1 prefill, 1 decode, 1 unified
    try:
        yield mesh, json.loads((base / "up.json").read_text())["pagestore"]
    finally:
        mesh.stop()


def _salt_pages(store: str, salt: str) -> int:
    digest = hashlib.sha256(salt.encode()).digest()[:8].hex()
    return sum(n.pages for n in stats(store).namespaces if n.salt_digest == digest)


def test_a_pd_answer_is_in_the_store_for_the_next_turn(up_pd: tuple[Mesh, str]) -> None:
    """The prefill writes the prompt's pages through and the decode the answer's, so the next turn of a
    chat (prompt, answer, a new message), asked of a replica that saw none of it, reads both."""
    mesh, store = up_pd
    first = prompt(51, 200)  # 12 full pages and 8 tokens
    with Client(mesh.grpc, timeout=120) as client:
        turn1 = client.generate(first, max_tokens=100, mode="pd", cache_salt="chat-pd", ignore_eos=True)
        full = (len(first) + len(turn1.token_ids) - 1) // 16  # the last token's KV is never computed
        deadline = time.monotonic() + 30
        while _salt_pages(store, "chat-pd") < full and time.monotonic() < deadline:
            time.sleep(0.05)
        second = first + turn1.token_ids + prompt(52, 20)
        cold = client.generate(second, max_tokens=4, mode="colocated", cache_salt="chat-pd-cold")
        warm = client.generate(second, max_tokens=4, mode="colocated", cache_salt="chat-pd")
    assert len(turn1.token_ids) == 100
    assert cold.cached_tokens == 0
    assert warm.cached_tokens_store == full * 16 > (len(first) // 16) * 16, warm
    assert warm.token_ids == cold.token_ids
