"""Hypothesis-generated hostile HTTP requests to every endpoint: never a 5xx, always OpenAI-shaped JSON
errors, no crash, nothing leaked."""

from __future__ import annotations

import http.client
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.cli.mesh import Mesh
from tests.fuzz.conftest import OUTCOMES, TRIED, assert_nothing_leaked
from tests.fuzz.strategies import dump, fuzz, mangled_bodies, openai_bodies

pytestmark = pytest.mark.integration
_POSTS = ("/v1/completions", "/v1/chat/completions")


def _send(mesh: Mesh, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes, str]:
    host, port = mesh.http.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read(), resp.getheader("Content-Type") or ""
    finally:
        conn.close()


def _check(status: int, data: bytes, content_type: str) -> None:
    OUTCOMES[f"http {status}"] += 1
    assert status < 500, (status, data[:500])
    if status == 200:
        if content_type.startswith("text/event-stream"):
            frames = [f for f in data.decode().split("\n\n") if f]
            assert frames[-1] == "data: [DONE]", frames[-3:]
            for frame in frames[:-1]:
                chunk = json.loads(frame.removeprefix("data: "))
                assert "choices" in chunk or "error" in chunk
        else:
            assert {"choices", "data", "status"} & set(json.loads(data)), data[:200]
        return
    assert content_type.startswith("application/json"), (status, content_type, data[:200])
    err = json.loads(data)["error"]
    assert err["type"] and err["code"] and isinstance(err["message"], str)


@fuzz(180)
@given(body=openai_bodies(chat=False))
def test_completions_json_shapes(mesh: Mesh, body: dict[str, object]) -> None:
    TRIED["http completions"] += 1
    _check(*_send(mesh, "POST", "/v1/completions", dump(body)))


@fuzz(150)
@given(body=openai_bodies(chat=True))
def test_chat_json_shapes(mesh: Mesh, body: dict[str, object]) -> None:
    TRIED["http chat"] += 1
    _check(*_send(mesh, "POST", "/v1/chat/completions", dump(body)))


@fuzz(140)
@given(raw=mangled_bodies(), path=st.sampled_from(_POSTS))
def test_raw_bytes(mesh: Mesh, raw: bytes, path: str) -> None:
    TRIED["http raw bytes"] += 1
    _check(*_send(mesh, "POST", path, raw))


@fuzz(40)
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
    path=st.sampled_from(["/v1/models", "/health", *_POSTS, "/v1/embeddings", "/", "/v1/completions/x"]),
    body=st.one_of(st.none(), st.binary(max_size=32)),
)
def test_every_endpoint_and_method(mesh: Mesh, method: str, path: str, body: bytes | None) -> None:
    TRIED["http endpoints"] += 1
    status, data, content_type = _send(mesh, method, path, body)
    if status in (200, 400, 413):
        _check(status, data, content_type)
    else:
        assert status in (404, 405), (status, data[:200])
        assert json.loads(data)["error"]["code"] == "INVALID_REQUEST"


def test_oversize_body_is_a_json_413(mesh: Mesh) -> None:
    TRIED["http oversize"] += 1
    status, data, _ = _send(mesh, "POST", "/v1/completions", b'{"prompt": "' + b"a" * (9 << 20) + b'"}')
    assert status == 413 and json.loads(data)["error"]["code"] == "REQUEST_TOO_LARGE"


@pytest.mark.parametrize("stream", [False, True])
def test_a_mode_this_router_does_not_serve_is_a_bad_request(mesh: Mesh, stream: bool) -> None:
    """Native mode on a router with no native servers configured: a 400 naming the field (asking again
    cannot help), not a 503."""
    TRIED["http targeted"] += 1
    body = {"prompt": "Hello", "max_tokens": 1, "xavier_mode": "native", "stream": stream}
    status, data, content_type = _send(mesh, "POST", "/v1/completions", dump(body))
    assert status == 400 and content_type.startswith("application/json"), (status, data[:300])
    err = json.loads(data)["error"]
    assert (err["code"], err["param"]) == ("INVALID_MODE", "xavier_mode")
    assert err["type"] == "invalid_request_error"
    assert "native mode is not configured" in err["message"]


def test_nothing_leaked_after_http_fuzz(mesh: Mesh) -> None:
    assert_nothing_leaked(mesh)
