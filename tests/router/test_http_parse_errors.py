"""Requests the router's HTTP parser refuses are answered in OpenAI's JSON error shape, against a real
router process (`xavier up`): one case per class of malformed input (request line, URL, headers, body
framing, Content-Encoding, Expect). Each names the header at fault where there is one, echoes none of the
client's bytes (every request carries the marker ZQX), closes the connection, and the router keeps
serving."""

from __future__ import annotations

import json
import socket
import urllib.request

import pytest

from tests.cli.mesh import Mesh

_MARK = b"ZQX"
_POST = b"POST /v1/completions HTTP/1.1\r\nHost: zqx\r\n"
_BODY = b'{"prompt": "ZQX", "max_tokens": 1}'

# (label, raw request, status, code, param)
_CASES = [
    # The request line.
    ("method", b"GARBAGE_ZQX\r\n\r\n", 400, "MALFORMED_HTTP", None),
    ("method chars", b"P@ST /ZQX HTTP/1.1\r\nHost: x\r\n\r\n", 400, "MALFORMED_HTTP", None),
    ("unknown method", b"ZQX /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", 400, "MALFORMED_HTTP", None),
    ("version", b"POST /ZQX HTTP/9.9\r\nHost: x\r\n\r\n", 400, "MALFORMED_HTTP", None),
    ("HTTP/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\nZQX", 400, "MALFORMED_HTTP", None),
    ("bare LF", b"POST /ZQX HTTP/1.1\nHost: x\n\n", 400, "MALFORMED_HTTP", None),
    # The URL.
    ("NUL in path", b"GET /v1/ZQX\x00 HTTP/1.1\r\nHost: x\r\n\r\n", 400, "MALFORMED_HTTP", None),
    ("absolute URL", b"GET http://[ZQX HTTP/1.1\r\nHost: x\r\n\r\n", 400, "MALFORMED_HTTP", None),
    (
        "URL too long",
        b"GET /ZQX" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        400,
        "MALFORMED_HTTP",
        None,
    ),
    # Headers.
    ("header token", _POST + b"ZQX no colon\r\n\r\n", 400, "MALFORMED_HTTP", None),
    ("header value", _POST + b"X-A: ZQX\x01\r\n\r\n", 400, "MALFORMED_HTTP", None),
    ("folded header", _POST + b"X-A: a\r\n ZQX\r\n\r\n", 400, "MALFORMED_HTTP", None),
    ("header too long", _POST + b"X-A: ZQX" + b"a" * 9000 + b"\r\n\r\n", 400, "MALFORMED_HTTP", None),
    (
        "too many headers",
        _POST + b"".join(b"X-ZQX-%d: a\r\n" % i for i in range(200)) + b"\r\n",
        400,
        "MALFORMED_HTTP",
        None,
    ),
    ("no Host", b"GET /v1/models?ZQX HTTP/1.1\r\n\r\n", 400, "MALFORMED_HTTP", "Host"),
    # Body framing.
    ("Content-Length", _POST + b"Content-Length: ZQX\r\n\r\n", 400, "MALFORMED_HTTP", "Content-Length"),
    (
        "negative Content-Length",
        _POST + b"Content-Length: -1\r\n\r\nZQX",
        400,
        "MALFORMED_HTTP",
        "Content-Length",
    ),
    (
        "two Content-Lengths",
        _POST + b"Content-Length: 3\r\nContent-Length: 4\r\n\r\nZQX",
        400,
        "MALFORMED_HTTP",
        "Content-Length",
    ),
    (
        "Content-Length and chunked",
        _POST + b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\nZQX",
        400,
        "MALFORMED_HTTP",
        "Transfer-Encoding",
    ),
    (
        "Transfer-Encoding",
        _POST + b"Transfer-Encoding: zqx\r\n\r\n",
        400,
        "MALFORMED_HTTP",
        "Transfer-Encoding",
    ),
    (
        "chunk size",
        _POST + b"Transfer-Encoding: chunked\r\n\r\nZQX\r\n{}\r\n0\r\n\r\n",
        400,
        "MALFORMED_HTTP",
        None,
    ),
    (
        "chunk extension",
        _POST + b"Transfer-Encoding: chunked\r\n\r\n3;\x01ZQX\r\nZQX\r\n0\r\n\r\n",
        400,
        "MALFORMED_HTTP",
        None,
    ),
    (
        "chunk end",
        _POST + b"Transfer-Encoding: chunked\r\n\r\n3\r\nZQXZQX0\r\n\r\n",
        400,
        "MALFORMED_HTTP",
        None,
    ),
    (
        "chunk trailer",
        _POST + b"Transfer-Encoding: chunked\r\n\r\n3\r\nZQX\r\n0\r\nZQX trailer\r\n\r\n",
        400,
        "MALFORMED_HTTP",
        None,
    ),
    # A Content-Encoding the router cannot decode: the front's answer to an encoding it refuses.
    (
        "Content-Encoding br",
        _POST + b"Content-Encoding: br\r\nContent-Length: %d\r\n\r\n" % len(_BODY) + _BODY,
        400,
        "INVALID_JSON",
        "Content-Encoding",
    ),
    # An expectation other than 100-continue.
    (
        "Expect",
        _POST + b"Expect: ZQX\r\nContent-Length: %d\r\n\r\n" % len(_BODY) + _BODY,
        417,
        "MALFORMED_HTTP",
        "Expect",
    ),
]


def _exchange(address: str, raw: bytes) -> tuple[int, dict[str, str], bytes, bool]:
    """Sends `raw` on a new connection; the answer's status, headers, body, and whether the router
    closed the connection after it."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(raw)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"the connection closed before an answer: {data!r}"
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
        while len(body) < int(headers["content-length"]):
            chunk = sock.recv(65536)
            assert chunk, "the connection closed inside the answer's body"
            body += chunk
        closed = sock.recv(1) == b""
    return int(status_line.split()[1]), headers, body, closed


@pytest.mark.integration
@pytest.mark.parametrize(("label", "raw", "status", "code", "param"), _CASES, ids=[c[0] for c in _CASES])
def test_a_malformed_request_is_a_json_error(
    mesh: Mesh, label: str, raw: bytes, status: int, code: str, param: str | None
) -> None:
    got, headers, body, closed = _exchange(mesh.http, raw)
    assert got == status, (label, got, body)
    assert headers["content-type"].startswith("application/json"), headers
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error" and error["code"] == code, error
    assert error["param"] == param, error
    assert error["message"] and _MARK.decode().lower() not in error["message"].lower(), error
    assert closed, "the router kept a connection open after a request it could not parse"


@pytest.mark.integration
def test_the_router_serves_after_malformed_requests(mesh: Mesh) -> None:
    for _, raw, *_ in _CASES:
        _exchange(mesh.http, raw)
    with urllib.request.urlopen(f"http://{mesh.http}/v1/models", timeout=60) as resp:
        assert resp.status == 200 and json.loads(resp.read())["data"]
    request = urllib.request.Request(
        f"http://{mesh.http}/v1/completions",
        data=_BODY,
        headers={"Content-Type": "application/json", "Expect": "100-continue"},
    )
    with urllib.request.urlopen(request, timeout=60) as resp:  # 100-continue still gets its answer
        assert json.loads(resp.read())["usage"]["completion_tokens"] == 1
