"""Reading a streamed OpenAI answer in the router tests: its `data:` chunks, decoded."""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.cli.mesh import Mesh


def stream_chunks(mesh: Mesh, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON chunks of `POST /v1/<path>` with `stream: true` (the `[DONE]` line left out)."""
    chunks = []
    body = {"model": mesh.model.name, "stream": True, **body}
    with httpx.stream("POST", f"http://{mesh.http}/v1/{path}", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks
