"""`cache_salt` over HTTP (vLLM's field): prefix-cache pages are shared only between requests of one salt."""

from __future__ import annotations

import httpx
import pytest

from tests.cli.mesh import Mesh

pytestmark = pytest.mark.integration

# Long enough for whole cached pages (16 tokens each) before the last one.
PROMPT = "A tenant's long shared system prompt, repeated to fill several pages of the cache. " * 6


def _cached(mesh: Mesh, mode: str, salt: str | None) -> int:
    body: dict[str, object] = {
        "model": mesh.model.name,
        "prompt": PROMPT,
        "max_tokens": 2,
        "temperature": 0.0,
        "xavier_mode": mode,
    }
    if salt is not None:
        body["cache_salt"] = salt
    resp = httpx.post(f"http://{mesh.http}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.parametrize("mode", ["pd", "colocated"])
def test_a_salt_keeps_its_pages_apart(mesh: Mesh, mode: str) -> None:
    _cached(mesh, mode, None)  # the unsalted pages are cached now
    assert _cached(mesh, mode, None) > 0
    salt = f"tenant-b-{mode}"
    assert _cached(mesh, mode, salt) == 0  # another tenant does not see them
    assert _cached(mesh, mode, salt) > 0  # but its own, once computed


def test_a_bad_salt_is_refused_naming_it(mesh: Mesh) -> None:
    for salt in (7, "x" * 10_000):
        body = {"model": mesh.model.name, "prompt": "hi", "max_tokens": 1, "cache_salt": salt}
        resp = httpx.post(f"http://{mesh.http}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "cache_salt", resp.text
