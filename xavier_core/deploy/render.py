"""Render one host's systemd units, env files and service configs from the cluster description.

Output, laid out as on the target host (copy the tree to ``/``, then ``systemctl daemon-reload`` and
``systemctl start xavier.target``)::

    etc/xavier/<unit>.toml                         the service's config (--config), validated here
    etc/xavier/<unit>.env                          its process environment (EnvironmentFile=)
    etc/systemd/system/<unit file>                 the unit files of deploy/systemd this host uses (a GPU
                                                   role's is xavier-engine@.service, under the role's name)
    etc/systemd/system/<unit file>.d/<name>.conf   their drop-ins in deploy/systemd (what a GPU role changes)
    etc/systemd/system/xavier.target.wants/<unit>  the enabled instances, as `systemctl enable` links them
    etc/systemd/system/<unit>.service.d/credentials.conf   LoadCredential= for DynamicUser units

Every rendered config is validated by the service's own config model before anything is written, so a
bad ``[service.ROLE]`` key fails here, naming it, not at start on the host.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from xavier_core.runtime.config import ConfigError

from .hosts import ENGINE_ROLES, Cluster, HostSpec, Role

__all__ = ["DEFAULT_UNITS_DIR", "RenderedUnit", "plan_host", "render_host", "to_toml"]

DEFAULT_UNITS_DIR = Path(__file__).resolve().parents[2] / "deploy" / "systemd"
"""The unit files in a source checkout (``deploy/systemd``)."""
_UNIT_PREFIX = "/opt/xavier/.venv/"
_ENGINE_UNIT = "xavier-engine@.service"
"""The one unit file of the GPU roles; each installs it as ``xavier-<role>@.service`` beside its drop-ins."""
_CREDENTIALS = "/run/credentials"
# The services whose units run under DynamicUser=: files they read are handed over with LoadCredential=.
_DYNAMIC_USER: frozenset[Role] = frozenset({"directory", "router", "pagestore"})
_CONFIG_MODELS: dict[Role, str] = {
    "directory": "xavier_services.directory.config:DirectoryConfig",
    "router": "xavier_services.router.config:RouterConfig",
    "pagestore": "xavier_core.runtime.config:ServiceConfig",
    "prefill": "xavier_services.peer.config:PeerServiceConfig",
    "decode": "xavier_services.peer.config:PeerServiceConfig",
    "unified": "xavier_services.peer.config:PeerServiceConfig",
}


@dataclass
class RenderedUnit:
    """One unit instance of a host: its names, its config and environment, the files it loads."""

    role: Role
    unit: str
    """Instance name without ``.service``: ``xavier-directory``, ``xavier-prefill@3``."""
    template: str
    """Unit file it is an instance of: ``xavier-prefill@.service``."""
    config: dict[str, Any]
    env: dict[str, str]
    credentials: dict[str, str] = field(default_factory=dict)
    """LoadCredential= name → path on the host."""


def _merge(base: dict[str, Any], extra: Mapping[str, Any], key: str) -> None:
    """Merge ``extra`` (the user's ``[service.ROLE]``) into the rendered ``base``; overlap is an error."""
    for name, value in extra.items():
        path = f"{key}.{name}"
        if isinstance(value, Mapping) and isinstance(base.get(name), dict):
            _merge(base[name], value, path)
        elif name in base:
            raise ConfigError(
                [(path, "set by the renderer from [cluster], [ports] and [hosts]", "hosts file")]
            )
        else:
            base[name] = json.loads(json.dumps(value))  # a deep copy of plain TOML data


def _file_for(unit: RenderedUnit, name: str, path: str) -> str:
    """The path the service reads ``path`` at: in place, or its LoadCredential= copy under DynamicUser."""
    if unit.role not in _DYNAMIC_USER:
        return path
    unit.credentials[name] = path
    return f"{_CREDENTIALS}/{unit.unit}.service/{name}"


def _unit(cluster: Cluster, host_name: str, host: HostSpec, role: Role, gpu: int | None) -> RenderedUnit:
    ports, bind = cluster.ports, host.bind_host
    port = int(getattr(ports, role)) + (gpu or 0)
    name = f"xavier-{role}" if gpu is None else f"xavier-{role}@{gpu}"
    template = f"xavier-{role}.service" if gpu is None else f"xavier-{role}@.service"
    config: dict[str, Any] = {
        "listen": f"{bind}:{port}",
        "metrics_listen": f"{ports.metrics_host}:{port + ports.metrics_offset}",
    }
    if role == "router":
        config |= {
            "http_listen": f"{bind}:{ports.router_http}",
            "model": str(cluster.cluster.model),
            "directory": cluster.directory_address,
        }
    if gpu is not None:
        config["engine"] = {"model": str(cluster.cluster.model), "device": f"cuda:{gpu}"}
        config["peer"] = {
            "peer_id": f"{host_name}-{role}-{gpu}",
            "directory": cluster.directory_address,
            "advertise_host": host.address,
        }
        if host.engine == "sglang":
            config["engine"]["kind"] = "sglang"
            config["sglang"] = _sglang(cluster, role, gpu)
    if role == "router" and cluster.sglang.transfer_backend == "nixl":
        config["native"] = _native_router(cluster, host_name)
    unit = RenderedUnit(role, name, template, config, {**cluster.cluster.env, **host.env})
    if cluster.tls is not None:
        service = config["peer"]["peer_id"] if gpu is not None else role
        tls = {
            k: getattr(cluster.tls, k).replace("{host}", host_name).replace("{service}", service)
            for k in ("ca_file", "cert_file", "key_file")
        }
        config["tls"] = {k: _file_for(unit, f"tls-{k.removesuffix('_file')}.pem", v) for k, v in tls.items()}
    extra = dict(cluster.service.get(role, {}))
    token_file = extra.pop("api_token_file", None)
    if role == "router" and isinstance(token_file, str):
        config["api_token_file"] = _file_for(unit, "api-token", token_file)
    elif token_file is not None:
        extra["api_token_file"] = token_file  # let the config model report it
    _merge(config, extra, f"service.{role}")
    return unit


def _sglang(cluster: Cluster, role: Role, gpu: int) -> dict[str, Any]:
    """The ``[sglang]`` section of the instance on ``gpu``: the launcher in the installed venv (a unit has
    no PATH to find ``python`` with SGLang in), the GPU by index (like ``engine.device``: every GPU stays
    visible for CUDA IPC), fixed loopback ports (a restart keeps them; native mode's router needs them)."""
    python = cluster.sglang.python or f"{str(cluster.cluster.prefix).rstrip('/')}/bin/python"
    section: dict[str, Any] = {
        "command": [python, "-m", "sglang.launch_server"],
        "base_gpu_id": gpu,
        "port": cluster.ports.sglang + gpu,
    }
    if cluster.sglang.transfer_backend == "nixl" and role != "unified":
        section |= {"transfer_backend": "nixl", "api_key": cluster.sglang.api_key}
        if role == "prefill":
            section["bootstrap_port"] = cluster.ports.sglang_bootstrap + gpu
    return section


def _native_router(cluster: Cluster, host_name: str) -> dict[str, Any]:
    """The router's ``[native]`` section: SGLang serves HTTP and its bootstrap on loopback only, so the
    one native prefill and decode must run on the router's host."""
    found: dict[str, list[tuple[str, int]]] = {"prefill": [], "decode": []}
    for name, spec in cluster.hosts.items():
        if spec.engine == "sglang":
            for role, gpus in found.items():
                gpus.extend((name, gpu) for gpu in getattr(spec, f"{role}_gpus"))
    if any(len(v) != 1 or v[0][0] != host_name for v in found.values()):
        where = ", ".join(f"{role} on {v}" for role, v in found.items())
        why = (
            f"native mode needs one SGLang prefill and one decode on the router's host {host_name!r}: {where}"
        )
        raise ConfigError([("sglang.transfer_backend", why, "hosts file")])
    (_, prefill), (_, decode) = found["prefill"][0], found["decode"][0]
    ports = cluster.ports
    return {
        "prefill_url": f"http://127.0.0.1:{ports.sglang + prefill}",
        "decode_url": f"http://127.0.0.1:{ports.sglang + decode}",
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": ports.sglang_bootstrap + prefill,
        "api_key": cluster.sglang.api_key,
    }


def plan_host(cluster: Cluster, host_name: str) -> list[RenderedUnit]:
    """The unit instances ``host_name`` runs, configs validated; ConfigError names the offending key."""
    host = cluster.hosts.get(host_name)
    if host is None:
        raise ConfigError(
            [("host", f"{host_name!r} is not in [hosts] ({', '.join(cluster.hosts)})", "flag --host")]
        )
    units: list[RenderedUnit] = []
    for role in ("directory", "pagestore", "router", *ENGINE_ROLES):
        if role not in host.roles:
            continue
        gpus: list[int | None] = list(getattr(host, f"{role}_gpus")) if role in ENGINE_ROLES else [None]
        units.extend(_unit(cluster, host_name, host, role, gpu) for gpu in gpus)
    for unit in units:
        _validate(unit)
    _check_ports(units, host_name)
    return units


def _check_ports(units: list[RenderedUnit], host_name: str) -> None:
    taken: dict[int, str] = {}
    for unit in units:
        used = {
            key: int(address.rpartition(":")[2])
            for key in ("listen", "metrics_listen", "http_listen")
            if isinstance(address := unit.config.get(key), str) and address
        }
        sglang = unit.config.get("sglang", {})
        used |= {f"sglang.{k}": int(sglang[k]) for k in ("port", "bootstrap_port") if k in sglang}
        for key, port in used.items():
            if port in taken:
                clash = f"{unit.unit} {key} and {taken[port]} both use port {port} on host {host_name}"
                raise ConfigError([("ports", clash, "hosts file")])
            taken[port] = f"{unit.unit} {key}"


def _validate(unit: RenderedUnit) -> None:
    module, _, cls = _CONFIG_MODELS[unit.role].partition(":")
    model: type[BaseModel] = getattr(importlib.import_module(module), cls)
    # The token file lives on the target host (the router reads it at start); every other key is checked.
    checked = {k: v for k, v in unit.config.items() if k != "api_token_file"}
    try:
        model.model_validate(checked)
    except ValidationError as exc:
        raise ConfigError(
            [
                (
                    f"service.{unit.role}.{'.'.join(str(p) for p in e['loc'])}",
                    e["msg"],
                    f"rendered {unit.unit}",
                )
                for e in exc.errors(include_url=False)
            ]
        ) from None


# --- writing -----------------------------------------------------------------


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def to_toml(data: Mapping[str, Any], table: tuple[str, ...] = ()) -> str:
    """Plain TOML for the nested str/int/float/bool/list/dict data of a service config."""
    lines = [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, Mapping)]
    out = "\n".join(lines) + ("\n" if lines else "")
    for key, value in data.items():
        if isinstance(value, Mapping):
            path = (*table, key)
            out += f"\n[{'.'.join(_toml_key(p) for p in path)}]\n" + to_toml(value, path)
    return out


def _env_text(unit: RenderedUnit) -> str:
    body = "".join(f'{name}="{value}"\n' for name, value in sorted(unit.env.items()))
    return f"# {unit.unit}: process environment (EnvironmentFile=); its config is {unit.unit}.toml.\n{body}"


def _unit_text(path: Path, prefix: Path) -> str:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError([("units", f"cannot read {path}: {exc.strerror or exc}", "flag --units")]) from None
    return text.replace(_UNIT_PREFIX, f"{str(prefix).rstrip('/')}/")


def render_host(
    cluster: Cluster, host_name: str, out: Path, units_dir: Path = DEFAULT_UNITS_DIR
) -> list[Path]:
    """Write ``host_name``'s files under ``out`` (see the module doc); returns the paths written."""
    units = plan_host(cluster, host_name)
    header = f"# Rendered for host {host_name} from the cluster description; re-render rather than edit.\n"
    written: list[Path] = []

    def write(path: Path, text: str, mode: int = 0o644) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(mode)
        written.append(path)

    etc, systemd = out / "etc" / "xavier", out / "etc" / "systemd" / "system"
    prefix = cluster.cluster.prefix
    for template in ["xavier.target", *dict.fromkeys(u.template for u in units)]:
        source = _ENGINE_UNIT if template.endswith("@.service") else template
        write(systemd / template, _unit_text(units_dir / source, prefix))
        for conf in sorted((units_dir / f"{template}.d").glob("*.conf")):
            write(systemd / f"{template}.d" / conf.name, _unit_text(conf, prefix))
    wants = systemd / "xavier.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    for unit in units:
        # Configs may name key files: readable by root and the service only (the env file too).
        write(etc / f"{unit.unit}.toml", header + to_toml(unit.config), 0o640)
        write(etc / f"{unit.unit}.env", header + _env_text(unit), 0o640)
        link = wants / f"{unit.unit}.service"
        link.unlink(missing_ok=True)
        link.symlink_to(f"../{unit.template}")
        written.append(link)
        if unit.credentials:
            creds = "".join(f"LoadCredential={n}:{p}\n" for n, p in sorted(unit.credentials.items()))
            write(systemd / f"{unit.unit}.service.d" / "credentials.conf", f"{header}[Service]\n{creds}")
    return written
