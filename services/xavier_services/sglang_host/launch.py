"""The SGLang command line and environment of one hosted server, built from the service's config.

Nothing here starts a process: `Launch` is the validated argv + environment the child runs with, so the
same builder serves the service, `xavier up` and the conformance test that parses the argv with SGLang's
real `ServerArgs` parser.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from xavier.v1 import types_pb2
from xavier_sglang.config import (
    ENV_ADVERTISE,
    ENV_CALL_SESSIONS,
    ENV_DIRECTORY,
    ENV_PEER_ID,
    ENV_TRANSFER_TIMEOUT,
    UnsupportedSetupError,
    XavierSettings,
)

from xavier_core.runtime.channels import client_tls
from xavier_core.runtime.errors import InvalidArgument
from xavier_services.peer.sglang_section import SglangSection

__all__ = ["Launch", "LaunchSpec", "build_launch"]

PLUGIN_NAME = "xavier"
"""The plugin's entry-point name (group `sglang.srt.plugins`), allow-listed through SGLANG_PLUGINS."""
HICACHE_BACKEND = {
    "backend_name": "xavier",
    "module_path": "xavier_sglang.hicache",
    "class_name": "XavierHiCacheStorage",
    "interface_v1": 1,
}
_MODES = {types_pb2.ROLE_PREFILL: "prefill", types_pb2.ROLE_DECODE: "decode"}
# The service's config key behind each variable the plugin reads, for errors that name the key.
_ENV_KEYS = {
    ENV_DIRECTORY: "peer.directory",
    ENV_PEER_ID: "peer.peer_id",
    ENV_TRANSFER_TIMEOUT: "handoff.transfer_timeout_seconds",
}


@dataclass(frozen=True)
class LaunchSpec:
    """What the service knows when it launches SGLang (besides the `[sglang]` section)."""

    role: types_pb2.Role.ValueType
    model: Path | None
    port: int
    """SGLang's HTTP port (already chosen: `sglang.port` or a free one)."""
    advertise: str = ""
    """host:port of the hosting service as peers know it; the xavier backend registers under it."""
    peer_id: str = ""
    """The hosting service's stable peer id; the xavier backend registers the SGLang process under it,
    so a restart keeps the id and gets a new epoch. Empty: the directory assigns one per start."""
    directory: str = ""
    page_size: int = 16
    dtype: str | None = None
    pagestore: str = ""
    transfer_timeout_seconds: float = 30.0
    call_sessions: bool = True
    """The service's `peer.call_sessions`: the plugin declares them in the registration it makes."""


@dataclass(frozen=True)
class Launch:
    """The validated argv and environment of one SGLang server, and how to reach it."""

    argv: list[str]
    env: dict[str, str]
    url: str
    api_key: str = field(repr=False)


def build_launch(cfg: SglangSection, spec: LaunchSpec) -> Launch:
    """SGLang's argv and environment for `spec`; `InvalidArgument` naming the key for a set-up that
    cannot work (no model, a role without a mode, HiCache on a decode)."""
    if spec.model is None:
        raise InvalidArgument("engine.model is required (a local checkpoint directory)", key="engine.model")
    if not (spec.model / "config.json").is_file():
        raise InvalidArgument(f"{spec.model} has no config.json", key="engine.model")
    if not 1 <= spec.port <= 65535:
        raise InvalidArgument(f"SGLang's port must be 1..65535, got {spec.port}", key="sglang.port")
    # Hex: a key that starts with '-' would read as a flag to SGLang's argparse.
    api_key = cfg.api_key or secrets.token_hex(24)
    argv = [
        *cfg.command,
        "--model-path",
        str(spec.model),
        "--host",
        "127.0.0.1",
        "--port",
        str(spec.port),
        "--api-key",
        api_key,
        "--page-size",
        str(spec.page_size),
        # Structured output as Xavier declares it (SamplingParams.grammar): xgrammar, compact JSON.
        "--grammar-backend",
        "xgrammar",
        "--constrained-json-disable-any-whitespace",
    ]
    if spec.dtype is not None:
        argv += ["--dtype", spec.dtype]
    if cfg.base_gpu_id is not None:
        argv += ["--base-gpu-id", str(cfg.base_gpu_id)]
    env = dict(cfg.env)
    if cfg.cuda_visible_devices:
        env["CUDA_VISIBLE_DEVICES"] = cfg.cuda_visible_devices
    mode = _MODES.get(spec.role)
    if mode is not None:
        argv += ["--disaggregation-mode", mode, "--disaggregation-transfer-backend", cfg.transfer_backend]
        if mode == "decode":
            # Decode pages come from the prefill: a radix hit there would skip the transfer the room
            # expects (SGLang turns it off by itself too; said here so no extra arg turns it back on).
            argv.append("--disable-radix-cache")
        if cfg.transfer_backend == "nixl":
            if mode == "prefill":
                argv += ["--disaggregation-bootstrap-port", str(cfg.bootstrap_port)]
        else:
            env.update(_xavier_env(spec))
    elif spec.role != types_pb2.ROLE_UNIFIED:
        raise InvalidArgument(f"role {spec.role} cannot host SGLang", key="role")
    if cfg.hicache:
        argv += _hicache_args(cfg, spec)
    argv += cfg.extra_args
    return Launch(argv, env, f"http://127.0.0.1:{spec.port}", api_key)


def _xavier_env(spec: LaunchSpec) -> dict[str, str]:
    if not spec.directory:
        raise InvalidArgument("the xavier transfer backend needs peer.directory", key="peer.directory")
    if not spec.advertise:
        raise InvalidArgument("the hosting service's address is not known yet", key="peer.advertise_host")
    env = {
        "SGLANG_PLUGINS": PLUGIN_NAME,
        ENV_DIRECTORY: spec.directory,
        # The plugin registers the SGLang process under the service's gRPC address (the router calls the
        # service there, and a decode finds its prefill by that address: bootstrap_host:bootstrap_port)
        # and under the service's peer id, so a restart keeps the id and only the epoch changes.
        ENV_ADVERTISE: spec.advertise,
        ENV_TRANSFER_TIMEOUT: str(spec.transfer_timeout_seconds),
        ENV_CALL_SESSIONS: "1" if spec.call_sessions else "0",
    }
    if spec.peer_id:
        env[ENV_PEER_ID] = spec.peer_id
    tls = client_tls()  # the service's own [tls]: the plugin registers as this service's peer
    if tls is not None:
        env.update(tls.env())
    try:
        # The plugin's own parser: what it would refuse inside SGLang is refused here, before the launch.
        XavierSettings.from_env(default_advertise=spec.advertise, environ=env)
    except UnsupportedSetupError as err:
        raise InvalidArgument(str(err), key=_ENV_KEYS.get(err.option, "sglang")) from None
    return env


def _hicache_args(cfg: SglangSection, spec: LaunchSpec) -> list[str]:
    if spec.role == types_pb2.ROLE_DECODE:
        raise InvalidArgument("HiCache serves prompts: not on a decode", key="sglang.hicache")
    if cfg.hicache_backend == "file":
        return ["--enable-hierarchical-cache", "--hicache-storage-backend", "file"]
    if not spec.pagestore:
        raise InvalidArgument("sglang.hicache needs [pagestore] address", key="pagestore.address")
    extra = {**HICACHE_BACKEND, "pagestore": spec.pagestore, "model_path": str(spec.model), "cache_salt": ""}
    return [
        "--enable-hierarchical-cache",
        "--hicache-storage-backend",
        "dynamic",
        "--hicache-storage-backend-extra-config",
        json.dumps(extra, separators=(",", ":")),
    ]
