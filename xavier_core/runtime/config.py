"""Service configuration: TOML file, then ``XAVIER_*`` environment, then flags.

Later sources win key by key. The merged dict is validated once, at start,
by a frozen pydantic model with ``extra="forbid"``; any problem raises
:class:`ConfigError` naming the dotted key path and where the value came from.

Environment mapping (``env`` argument, usually ``os.environ``):

* ``XAVIER_<KEY>`` sets the top-level field ``<key>`` (lower-cased), e.g.
  ``XAVIER_LISTEN=0.0.0.0:7000`` or ``XAVIER_GRACE_SECONDS=2``.
* ``XAVIER_<SECTION>__<KEY>`` (double underscore) sets ``<section>.<key>``,
  nesting as deep as the model does: ``XAVIER_DIRECTORY__MAX_ROOMS=4096``.
* Values stay strings and pydantic converts them to the field type ("4096"
  becomes an int, "true" a bool); a value starting with ``[`` or ``{`` is
  parsed as JSON (then as a TOML inline value) to fill list and table fields.
  Strings are not pre-parsed as TOML scalars, so a string field set to
  ``"5"`` stays ``"5"`` instead of failing as an int.
* ``XAVIER_CONFIG`` names the config file when no ``--config`` flag is given.
* A variable whose first segment names no field of the model is ignored:
  the environment is shared with other programs (the CLI, the client SDK);
  under a known section every key is checked, so a typo there is an error.

Flags arrive as ``overrides``: keys are dotted paths (``"directory.max_rooms"``)
or nested dicts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = [
    "Address",
    "AddressOrOff",
    "Addresses",
    "ConfigError",
    "ServiceConfig",
    "TlsSettings",
    "add_common_args",
    "config_from_args",
    "exit_on_config_error",
    "load_config",
    "parse_host_port",
]

ENV_PREFIX = "XAVIER_"
ENV_CONFIG_FILE = "XAVIER_CONFIG"
MiB = 1024 * 1024

M = TypeVar("M", bound=BaseModel)


class ConfigError(Exception):
    """Invalid configuration. ``issues`` holds (key path, message, source) triples."""

    def __init__(self, issues: list[tuple[str, str, str]]) -> None:
        self.issues = issues
        super().__init__("\n".join(f"{key}: {msg} ({src})" for key, msg, src in issues))


def parse_host_port(value: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (IPv6 as ``[::1]:PORT``) and check the port is in 0..65535."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            raise ValueError(f"bad IPv6 host in {value!r}")
    elif ":" in host:
        raise ValueError(f"IPv6 hosts need brackets, e.g. [::1]:PORT, got {value!r}")
    if not port_text.isdigit():
        raise ValueError(f"port must be an integer, got {port_text!r}")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} out of range 0..65535")
    return host, port


def _address(value: str) -> str:
    parse_host_port(value)
    return value


def _address_or_off(value: str) -> str:
    return _address(value) if value else value


def _addresses(value: str) -> str:
    for address in value.split(","):
        parse_host_port(address)
    return value


Address = Annotated[str, AfterValidator(_address)]
"""A ``HOST:PORT`` setting."""
AddressOrOff = Annotated[str, AfterValidator(_address_or_off)]
"""A ``HOST:PORT`` setting, or "" for off."""
Addresses = Annotated[str, AfterValidator(_addresses)]
"""One ``HOST:PORT``, or several joined by commas (replicas of one service, e.g. directories on etcd)."""


class TlsSettings(BaseModel):
    """mTLS between services (``[tls]``): PEM files, re-read on SIGHUP (see ``xavier_core.runtime.tls``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cert_file: Path
    """This service's certificate chain, presented to callers and, as a client, to servers."""
    key_file: Path
    """The private key of ``cert_file``."""
    ca_file: Path
    """CA bundle that peers' certificates must chain to (client and server side)."""
    server_name: str = ""
    """As a client: the name checked against the server's certificate; empty uses the target host."""

    def env(self) -> dict[str, str]:
        """The files as the environment variables that set them (``XAVIER_TLS__CERT_FILE``, ...): for a
        child process (a service `xavier up` starts, the SGLang server a hosting service starts)."""
        return {name: str(getattr(self, key)) for key, name in TLS_FILE_ENV.items()}


TLS_FILE_ENV = {key: f"XAVIER_TLS__{key.upper()}" for key in ("cert_file", "key_file", "ca_file")}
"""The environment variable of each ``[tls]`` file."""


class ServiceConfig(BaseModel):
    """Settings every service shares; services subclass it and add their own sections."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    listen: Address = "127.0.0.1:0"
    """gRPC address; port 0 binds a free port (reported in the ready file)."""
    metrics_listen: AddressOrOff = "127.0.0.1:0"
    """Prometheus HTTP address, loopback by default; "" disables it."""
    ready_file: Path | None = None
    """Written atomically with the bound addresses once the service is SERVING."""
    grace_seconds: float = Field(default=5.0, ge=0.0, le=3600.0)
    """On SIGTERM: how long in-flight RPCs (and the on_stop drain) may take."""
    max_message_bytes: int = Field(default=16 * MiB, ge=1024, le=2**31 - 1)
    log_level: Literal["debug", "info", "warning", "error", "critical"] = "info"
    log_format: Literal["auto", "json", "console"] = "auto"
    watchdog_seconds: float | None = Field(default=None, ge=0.0)
    """sd_notify WATCHDOG=1 interval; None: half of systemd's WATCHDOG_USEC; 0: off."""
    tls: TlsSettings | None = None
    """mTLS for gRPC: with it the service serves TLS only and requires a client certificate."""

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_level(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value


# --- merging with provenance -------------------------------------------------


def _set_path(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[path[-1]] = value


def _flatten(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    items: list[tuple[tuple[str, ...], Any]] = []
    for key, value in tree.items():
        path = (*prefix, str(key))
        if isinstance(value, Mapping) and value:
            items.extend(_flatten(value, path))
        else:
            items.append((path, value))
    return items


def _env_value(raw: str) -> Any:
    if raw[:1] in ("[", "{"):
        try:
            return json.loads(raw)
        except ValueError:
            try:
                return tomllib.loads(f"v = {raw}")["v"]
            except tomllib.TOMLDecodeError:
                return raw
    return raw


def _env_layer(model_cls: type[BaseModel], env: Mapping[str, str]) -> list[tuple[tuple[str, ...], Any, str]]:
    fields = set(model_cls.model_fields)
    layer = []
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or name == ENV_CONFIG_FILE:
            continue
        path = tuple(part.lower() for part in name[len(ENV_PREFIX) :].split("__"))
        if not path[0] or path[0] not in fields or any(not p for p in path):
            continue
        layer.append((path, _env_value(env[name]), f"env {name}"))
    return layer


def _read_file(config_file: Path) -> dict[str, Any]:
    try:
        with config_file.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError([("config", f"file not found: {config_file}", "flag --config")]) from None
    except OSError as exc:
        raise ConfigError([("config", f"cannot read {config_file}: {exc}", "flag --config")]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([("config", f"invalid TOML: {exc}", f"file {config_file}")]) from None


def _source_of(loc: tuple[str, ...], sources: Mapping[tuple[str, ...], str]) -> str:
    for end in range(len(loc), 0, -1):
        src = sources.get(loc[:end])
        if src is not None:
            return src
    # A nested error under a table given whole: report the first source inside it.
    for path, src in sources.items():
        if path[: len(loc)] == loc:
            return src
    return "default"


def _flag_source(key: str) -> str:
    return f"flag --{key.replace('_', '-')}" if "." not in key else f"flag {key}"


def load_config(
    model_cls: type[M],
    config_file: Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> M:
    """Merge file < env < overrides and validate into ``model_cls``.

    Raises :class:`ConfigError` naming each offending key and its source.
    """
    merged: dict[str, Any] = {}
    sources: dict[tuple[str, ...], str] = {}

    def apply(path: tuple[str, ...], value: Any, source: str) -> None:
        _set_path(merged, path, value)
        for known in [p for p in sources if p[: len(path)] == path]:
            del sources[known]
        sources[path] = source

    if config_file is not None:
        for path, value in _flatten(_read_file(config_file)):
            apply(path, value, f"file {config_file}")
    for path, value, source in _env_layer(model_cls, env if env is not None else {}):
        apply(path, value, source)
    for key, value in (overrides or {}).items():
        base = tuple(key.split("."))
        if isinstance(value, Mapping):
            for path, leaf in _flatten(value, base):
                apply(path, leaf, _flag_source(key))
        else:
            apply(base, value, _flag_source(key))
    try:
        return model_cls.model_validate(merged)
    except ValidationError as exc:
        issues = []
        for error in exc.errors(include_url=False):
            loc = tuple(str(p) for p in error["loc"])
            key = ".".join(loc) or "<root>"
            msg = error["msg"]
            if error["type"] == "extra_forbidden":
                msg = "unknown key"
            issues.append((key, msg, _source_of(loc, sources)))
        raise ConfigError(issues) from None


# --- command line ------------------------------------------------------------

_COMMON_FLAGS = {
    "listen": "listen",
    "ready_file": "ready_file",
    "metrics_listen": "metrics_listen",
    "log_level": "log_level",
    "log_format": "log_format",
}


def add_common_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--config --listen --ready-file --metrics-listen --log-level --log-format``."""
    parser.add_argument("--config", type=Path, default=None, metavar="FILE", help="TOML config file")
    parser.add_argument("--listen", default=None, metavar="HOST:PORT", help="gRPC address (port 0: any)")
    parser.add_argument("--ready-file", default=None, metavar="PATH", help="write bound addresses here")
    parser.add_argument("--metrics-listen", default=None, metavar="HOST:PORT", help='"" disables')
    parser.add_argument("--log-level", default=None, help="debug|info|warning|error|critical")
    parser.add_argument("--log-format", default=None, choices=["auto", "json", "console"])
    return parser


def config_from_args(
    model_cls: type[M],
    args: argparse.Namespace,
    extra_overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> M:
    """Load ``model_cls`` from ``--config`` (else ``$XAVIER_CONFIG``), env and the common flags.

    ``extra_overrides`` (dotted keys) carry a service's own flags; ``None``
    values are skipped so unset flags do not override the file or env.
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    config_file: Path | None = getattr(args, "config", None)
    if config_file is None and environ.get(ENV_CONFIG_FILE):
        config_file = Path(environ[ENV_CONFIG_FILE])
    overrides: dict[str, Any] = {}
    for attr, key in _COMMON_FLAGS.items():
        value = getattr(args, attr, None)
        if value is not None:
            overrides[key] = value
    for key, value in (extra_overrides or {}).items():
        if value is not None:
            overrides[key] = value
    return load_config(model_cls, config_file, environ, overrides)


def exit_on_config_error(err: ConfigError) -> NoReturn:
    """Print ``config error: <key>: <msg> (<source>)`` per issue to stderr and exit 2."""
    for key, msg, src in err.issues:
        print(f"config error: {key}: {msg} ({src})", file=sys.stderr)
    raise SystemExit(2)
