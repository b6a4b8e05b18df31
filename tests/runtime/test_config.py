"""Config from TOML file, XAVIER_* environment and flags; every error names the key and its source."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from xavier_core.runtime import (
    ConfigError,
    ServiceConfig,
    add_common_args,
    config_from_args,
    exit_on_config_error,
    load_config,
)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_rooms: int = 10
    name: str = "dir"
    tags: tuple[str, ...] = ()


class DirConfig(ServiceConfig):
    directory: Section = Section()


def _issue(err: ConfigError) -> tuple[str, str, str]:
    assert len(err.issues) == 1, err.issues
    return err.issues[0]


def test_defaults_and_precedence(tmp_path: Path) -> None:
    cfg_file = tmp_path / "dir.toml"
    cfg_file.write_text(
        'listen = "127.0.0.1:7000"\ngrace_seconds = 2\n[directory]\nmax_rooms = 5\nname = "a"\n'
    )
    env = {
        "XAVIER_DIRECTORY__MAX_ROOMS": "6",
        "XAVIER_DIRECTORY__TAGS": '["x", "y"]',
        "XAVIER_LOG_LEVEL": "DEBUG",
        "XAVIER_SOME_OTHER_TOOL": "ignored",
        "PATH": "/bin",
    }
    cfg = load_config(DirConfig, cfg_file, env, {"directory.max_rooms": 7, "ready_file": "/tmp/r"})
    assert cfg.listen == "127.0.0.1:7000"
    assert cfg.grace_seconds == 2.0
    assert cfg.directory == Section(max_rooms=7, name="a", tags=("x", "y"))
    assert cfg.log_level == "debug"
    assert cfg.ready_file == Path("/tmp/r")
    assert cfg.metrics_listen == "127.0.0.1:0" and cfg.max_message_bytes == 16 * 1024 * 1024
    with pytest.raises(ValueError):
        setattr(cfg, "listen", "x")  # noqa: B010 (frozen model)


def test_env_string_field_keeps_digits() -> None:
    cfg = load_config(DirConfig, None, {"XAVIER_DIRECTORY__NAME": "5"}, {})
    assert cfg.directory.name == "5"


@pytest.mark.parametrize(
    ("toml", "env", "flags", "key", "fragment", "source"),
    [
        ("[directory]\nmax_rooms = 'many'\n", {}, {}, "directory.max_rooms", "valid integer", "file"),
        ("[directory]\nbogus = 1\n", {}, {}, "directory.bogus", "unknown key", "file"),
        ("surprise = true\n", {}, {}, "surprise", "unknown key", "file"),
        ('listen = "127.0.0.1:70000"\n', {}, {}, "listen", "out of range", "file"),
        ("", {"XAVIER_DIRECTORY__MAX_ROOMS": "many"}, {}, "directory.max_rooms", "valid integer", "env"),
        ("", {"XAVIER_DIRECTORY__BOGUS": "1"}, {}, "directory.bogus", "unknown key", "env"),
        ("", {"XAVIER_LISTEN": "localhost:99999"}, {}, "listen", "out of range", "env"),
        ("", {"XAVIER_GRACE_SECONDS": "soon"}, {}, "grace_seconds", "valid number", "env"),
        ("", {}, {"directory.max_rooms": "many"}, "directory.max_rooms", "valid integer", "flag"),
        ("", {}, {"directory.bogus": 1}, "directory.bogus", "unknown key", "flag"),
        ("", {}, {"listen": "127.0.0.1:65536"}, "listen", "out of range", "flag"),
        ("", {}, {"metrics_listen": "nohostport"}, "metrics_listen", "HOST:PORT", "flag"),
    ],
)
def test_errors_name_key_and_source(
    tmp_path: Path,
    toml: str,
    env: dict[str, str],
    flags: dict[str, object],
    key: str,
    fragment: str,
    source: str,
) -> None:
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text(toml)
    with pytest.raises(ConfigError) as caught:
        load_config(DirConfig, cfg_file, env, flags)
    got_key, msg, got_source = _issue(caught.value)
    assert got_key == key
    assert fragment in msg
    assert got_source.startswith(source)
    assert str(caught.value).startswith(f"{key}: ")


def test_later_source_owns_the_error(tmp_path: Path) -> None:
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text("[directory]\nmax_rooms = 3\n")
    with pytest.raises(ConfigError) as caught:
        load_config(DirConfig, cfg_file, {"XAVIER_DIRECTORY__MAX_ROOMS": "x"}, {})
    assert _issue(caught.value)[2] == "env XAVIER_DIRECTORY__MAX_ROOMS"


def test_bad_file(tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("listen = \n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(DirConfig, broken, {}, {})
    with pytest.raises(ConfigError, match="file not found"):
        load_config(DirConfig, tmp_path / "missing.toml", {}, {})


def test_flags_and_exit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text('listen = "127.0.0.1:1"\n')
    parser = add_common_args(argparse.ArgumentParser())
    parser.add_argument("--max-rooms", type=int)
    args = parser.parse_args(["--config", str(cfg_file), "--listen", "127.0.0.1:0", "--ready-file", "r.json"])
    cfg = config_from_args(DirConfig, args, {"directory.max_rooms": args.max_rooms}, env={})
    assert (cfg.listen, cfg.ready_file, cfg.directory.max_rooms) == ("127.0.0.1:0", Path("r.json"), 10)

    env = {"XAVIER_CONFIG": str(cfg_file)}
    assert config_from_args(DirConfig, parser.parse_args([]), env=env).listen == "127.0.0.1:1"

    with pytest.raises(ConfigError) as caught:
        config_from_args(DirConfig, parser.parse_args(["--listen", "127.0.0.1:70000"]), env={})
    with pytest.raises(SystemExit) as exited:
        exit_on_config_error(caught.value)
    assert exited.value.code == 2
    assert capsys.readouterr().err.startswith("config error: listen: ")
