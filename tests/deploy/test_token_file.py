"""The router's public bearer token from a file (``api_token_file``), validated at start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from xavier_services.router.config import RouterConfig

from xavier_core.engine.tiny import make_tiny
from xavier_core.runtime.config import ConfigError, load_config


def test_token_read_from_file(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("  s3cret-token\n")
    config = load_config(RouterConfig, env={"XAVIER_API_TOKEN_FILE": str(token)})
    assert config.bearer_token == "s3cret-token"
    assert load_config(RouterConfig, env={"XAVIER_API_TOKEN": "inline"}).bearer_token == "inline"
    assert load_config(RouterConfig, env={}).bearer_token == ""


@pytest.mark.parametrize("case", ["missing", "empty", "both"])
def test_bad_token_file_names_the_key(tmp_path: Path, case: str) -> None:
    token = tmp_path / "token"
    env = {"XAVIER_API_TOKEN_FILE": str(token)}
    if case == "empty":
        token.write_text("\n")
    if case == "both":
        token.write_text("t")
        env["XAVIER_API_TOKEN"] = "inline"
    with pytest.raises(ConfigError) as info:
        load_config(RouterConfig, env=env)
    assert [(key, src) for key, _, src in info.value.issues] == [
        ("api_token_file", "env XAVIER_API_TOKEN_FILE")
    ]


@pytest.mark.integration
def test_router_http_requires_the_token_from_the_file(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("from-a-file\n")
    model = make_tiny(tmp_path / "model", "qwen2")
    ready = tmp_path / "router.ready"
    exe = str(Path(sys.executable).parent / "xavier-router")
    env = {**os.environ, "XAVIER_API_TOKEN_FILE": str(token)}
    args = [
        exe,
        "--model",
        str(model),
        "--listen",
        "127.0.0.1:0",
        "--http",
        "127.0.0.1:0",
        "--ready-file",
        str(ready),
    ]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "router did not start"
            time.sleep(0.1)
        url = f"http://{json.loads(ready.read_text())['http']}/v1/models"

        def status(headers: dict[str, str]) -> int:
            try:
                with urllib.request.urlopen(
                    urllib.request.Request(url, headers=headers), timeout=10
                ) as reply:
                    return int(reply.status)
            except urllib.error.HTTPError as err:
                return err.code

        assert status({}) == 401
        assert status({"Authorization": "Bearer wrong"}) == 401
        assert status({"Authorization": "Bearer from-a-file"}) == 200
    finally:
        proc.terminate()
        proc.wait(30)
