"""The router's public bearer token from a file (``api_token_file``), validated at start."""

from __future__ import annotations

from pathlib import Path

import pytest
from xavier_services.router.config import RouterConfig

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
