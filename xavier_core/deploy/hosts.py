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

__all__ = [
    "ENGINE_ROLES",
    "Cluster",
    "ClusterSection",
    "HostSpec",
    "Ports",
    "Role",
    "SglangCluster",
    "TlsFiles",
    "load_cluster",
]

Role = Literal["directory", "router", "pagestore", "prefill", "decode", "unified"]
ENGINE_ROLES: tuple[Role, ...] = ("prefill", "decode", "unified")
"""Roles that run one engine instance per GPU (``xavier-ROLE@GPU``)."""
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
    insecure: bool = False
    """Plaintext gRPC between the services, no identities: anyone who reaches a port can register,
    evict or impersonate a peer. Without ``[tls]`` the renderer refuses the cluster unless this is set."""

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
    unified: int = Field(default=7600, ge=1, le=65535)
    sglang: int = Field(default=30000, ge=1, le=65535)
    """SGLang's HTTP port (on 127.0.0.1) of the SGLang-hosting instance on GPU N: this plus N."""
    sglang_bootstrap: int = Field(default=8998, ge=1, le=65535)
    """Native mode (``[sglang] transfer_backend = "nixl"``): the SGLang prefill's bootstrap port, plus N."""
    metrics_offset: int = Field(default=1000, ge=1, le=60000)
    """Each service's /metrics port is its gRPC port plus this."""
    metrics_host: str = "127.0.0.1"
    """Where /metrics binds: loopback unless a scraper on another host needs it."""


class TlsFiles(_Model):
    """mTLS files as they lie on each host; ``{host}`` in a path becomes the host's name and
    ``{service}`` the unit's identity peer id (an engine's peer id ``{host}-{role}-{gpu}``, else the
    role: ``router``, ``directory``, ``pagestore``). Each service's certificate must name its identity
    as the URI SAN ``spiffe://xavier/<role>/<peer id>`` (``xavier_core.runtime.identity``): the
    directory and the engines refuse what an identity may not do (another peer's registration, a
    Prefill call not from a router, ...)."""

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
    unified_gpus: list[int] = []
    engine: Literal["reference", "sglang"] = "reference"
    """The engine of this host's prefill, decode and unified instances: Xavier's reference engine, or an
    SGLang server each instance starts and supervises on its GPU (``[sglang]``)."""
    env: dict[str, str] = {}
    """Environment for this host's units (e.g. ``UCX_NET_DEVICES``), over ``cluster.env``."""

    @field_validator("roles")
    @classmethod
    def _unique_roles(cls, value: list[Role]) -> list[Role]:
        if len(set(value)) != len(value):
            raise ValueError("a role is listed twice")
        return value

    @field_validator("prefill_gpus", "decode_gpus", "unified_gpus")
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
        for role in ENGINE_ROLES:
            gpus = getattr(self, f"{role}_gpus")
            if (role in self.roles) != bool(gpus):
                raise ValueError(f"{role}_gpus must list GPUs exactly when roles has {role!r}")
        listed = [*self.prefill_gpus, *self.decode_gpus, *self.unified_gpus]
        if len(set(listed)) != len(listed):
            raise ValueError("prefill_gpus, decode_gpus and unified_gpus share a GPU")
        return self

    @property
    def bind_host(self) -> str:
        return self.bind or self.address


class SglangCluster(_Model):
    """``[sglang]``: how the SGLang-hosting instances (hosts with ``engine = "sglang"``) launch SGLang.
    Per-role SGLang settings (``extra_args``, ``env``, health timings) go in ``[service.ROLE.sglang]``."""

    python: str = ""
    """The interpreter SGLang and Xavier's plugin are installed in; empty: ``{cluster.prefix}/bin/python``."""
    transfer_backend: Literal["xavier", "nixl"] = "xavier"
    """P/D instances: "xavier" (KV through Xavier, the router pairs peers through the directory) or "nixl"
    (SGLang's own NIXL P/D: one prefill and one decode on the router's host, the router's native mode)."""
    api_key: str = ""
    """Native mode: the key both SGLang servers and the router share (required there; a secret: the
    rendered configs are mode 0640). The xavier backend uses a fresh key per start instead."""

    @field_validator("python")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if value and not value.startswith("/"):
            raise ValueError(f"must be an absolute path (units run without a PATH to search), got {value!r}")
        return value

    @model_validator(mode="after")
    def _native_key(self) -> SglangCluster:
        if self.transfer_backend == "nixl" and not self.api_key:
            raise ValueError("api_key is required with transfer_backend = 'nixl' (the router calls SGLang)")
        return self


class Cluster(_Model):
    """The whole description: ``[cluster]``, ``[ports]``, optional ``[tls]`` and ``[sglang]``,
    ``[hosts.NAME]`` and ``[service.ROLE]`` (extra config merged into every unit of that role, e.g.
    ``[service.prefill.engine]``).
    """

    cluster: ClusterSection
    ports: Ports = Ports()
    tls: TlsFiles | None = None
    sglang: SglangCluster = SglangCluster()
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
    if cluster.tls is None and not cluster.cluster.insecure:
        raise ConfigError(
            [
                (
                    "tls",
                    "missing: give every service a certificate naming its identity ([tls]), or say "
                    "[cluster] insecure = true for a plaintext mesh anyone on the network can take over",
                    source,
                )
            ]
        )
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
