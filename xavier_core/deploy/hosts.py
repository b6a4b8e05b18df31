"""The cluster description the renderer reads: hosts, their roles and GPUs, ports, TLS files.

One TOML file describes the whole mesh (see ``deploy/examples/hosts.toml``); every host renders its own
units from it, so addresses and ports agree everywhere by construction. Validation is pydantic with
``extra="forbid"`` through :func:`xavier_core.runtime.config.load_config`, so an error names the key
(``hosts.gpu-a.prefill_gpus``) and the file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from xavier_core.runtime.config import ConfigError, load_config

__all__ = ["Cluster", "ClusterSection", "HostSpec", "Ports", "Role", "TlsFiles", "load_cluster"]

Role = Literal["directory", "router", "pagestore", "prefill", "decode"]
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HOST_NAME = re.compile(r"[a-z0-9][a-z0-9-]*")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_env(env: dict[str, str]) -> dict[str, str]:
    for name, value in env.items():
        if not _ENV_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not an environment variable name")
        if "\n" in value or '"' in value or "\\" in value:
            raise ValueError(f"{name}: newlines, quotes and backslashes are not allowed in values")
    return env


class ClusterSection(_Model):
    """Settings of the whole mesh."""

    directory: str | list[str]
    """Name of the host (a key of ``[hosts]``) whose directory every peer and router uses; or several
    (directory replicas, which need ``[service.directory.directory] backend = "etcd"``)."""

    @property
    def directory_hosts(self) -> list[str]:
        return [self.directory] if isinstance(self.directory, str) else list(self.directory)

    model: Path
    """Checkpoint directory, at the same path on every host that runs a router or an engine."""
    prefix: Path = Path("/opt/xavier/.venv")
    """Installed virtualenv; the units' ExecStart lines point at its ``bin/``."""
    env: dict[str, str] = {}
    """Environment for every unit (e.g. ``UCX_TLS``); a host's ``env`` wins key by key."""

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_env(value)


class Ports(_Model):
    """gRPC ports; engine instance N listens on its base plus N."""

    directory: int = Field(default=7100, ge=1, le=65535)
    router: int = Field(default=50051, ge=1, le=65535)
    router_http: int = Field(default=8000, ge=1, le=65535)
    pagestore: int = Field(default=7300, ge=1, le=65535)
    prefill: int = Field(default=7400, ge=1, le=65535)
    decode: int = Field(default=7500, ge=1, le=65535)
    metrics_offset: int = Field(default=1000, ge=1, le=60000)
    """Each service's /metrics port is its gRPC port plus this."""
    metrics_host: str = "127.0.0.1"
    """Where /metrics binds: loopback unless a scraper on another host needs it."""


class TlsFiles(_Model):
    """mTLS files as they lie on each host; ``{host}`` in a path becomes the host's name."""

    ca_file: str
    cert_file: str
    key_file: str


class HostSpec(_Model):
    """One machine of the mesh."""

    address: str
    """Address the other hosts reach this one at (advertised to the directory and the router)."""
    bind: str = ""
    """Address the services bind; empty: ``address``."""
    roles: list[Role] = Field(min_length=1)
    prefill_gpus: list[int] = []
    decode_gpus: list[int] = []
    env: dict[str, str] = {}
    """Environment for this host's units (e.g. ``UCX_NET_DEVICES``), over ``cluster.env``."""

    @field_validator("roles")
    @classmethod
    def _unique_roles(cls, value: list[Role]) -> list[Role]:
        if len(set(value)) != len(value):
            raise ValueError("a role is listed twice")
        return value

    @field_validator("prefill_gpus", "decode_gpus")
    @classmethod
    def _gpu_indices(cls, value: list[int]) -> list[int]:
        if any(gpu < 0 or gpu > 63 for gpu in value) or len(set(value)) != len(value):
            raise ValueError("GPU indices must be distinct and within 0..63")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_env(value)

    @model_validator(mode="after")
    def _gpus_match_roles(self) -> HostSpec:
        for role in ("prefill", "decode"):
            gpus = getattr(self, f"{role}_gpus")
            if (role in self.roles) != bool(gpus):
                raise ValueError(f"{role}_gpus must list GPUs exactly when roles has {role!r}")
        if set(self.prefill_gpus) & set(self.decode_gpus):
            raise ValueError("prefill_gpus and decode_gpus share a GPU")
        return self

    @property
    def bind_host(self) -> str:
        return self.bind or self.address


class Cluster(_Model):
    """The whole description: ``[cluster]``, ``[ports]``, optional ``[tls]``, ``[hosts.NAME]`` and
    ``[service.ROLE]`` (extra config merged into every unit of that role, e.g. ``[service.prefill.engine]``).
    """

    cluster: ClusterSection
    ports: Ports = Ports()
    tls: TlsFiles | None = None
    hosts: dict[str, HostSpec] = Field(min_length=1)
    service: dict[Role, dict[str, Any]] = {}

    @field_validator("hosts")
    @classmethod
    def _host_names(cls, value: dict[str, HostSpec]) -> dict[str, HostSpec]:
        for name in value:
            if not _HOST_NAME.fullmatch(name):
                raise ValueError(f"host name {name!r}: lower-case letters, digits and '-' only")
        return value

    @property
    def directory_address(self) -> str:
        """The directory address peers and routers dial: ``ip:port``, comma-separated for replicas."""
        return ",".join(
            f"{self.hosts[h].address}:{self.ports.directory}" for h in self.cluster.directory_hosts
        )


def load_cluster(path: Path) -> Cluster:
    """Read and validate a hosts file; :class:`~xavier_core.runtime.config.ConfigError` names the key."""
    if not path.is_file():
        raise ConfigError([("hosts", f"file not found: {path}", "flag --hosts")])
    cluster = load_config(Cluster, path)
    source = f"file {path}"
    names = cluster.cluster.directory_hosts
    holders = [host for host, spec in cluster.hosts.items() if "directory" in spec.roles]
    for name in names:
        if name not in cluster.hosts:
            raise ConfigError([("cluster.directory", f"{name!r} is not a host in [hosts]", source)])
    if sorted(holders) != sorted(names) or not names:
        raise ConfigError(
            [
                (
                    "cluster.directory",
                    f"{names} must be the hosts with the 'directory' role, found {holders}",
                    source,
                )
            ]
        )
    backend = cluster.service.get("directory", {}).get("directory", {}).get("backend", "memory")
    if len(names) > 1 and backend != "etcd":
        why = 'several directories share their state only through etcd: set backend = "etcd"'
        raise ConfigError([("service.directory.directory.backend", why, source)])
    return cluster
