"""The `[sglang]` section of a peer service's config: how a prefill, decode or unified service starts the
SGLang server it hosts (`sglang_host/`).

Every option Xavier owns (model, listen address, API key, disaggregation role and backend, radix cache
and HiCache wiring, parallelism the xavier backend cannot carry) is set by the service; `extra_args` carry
the rest of SGLang's flags through and are refused, naming the flag, when they touch one of those.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["OWNED_FLAGS", "SglangSection", "check_extra_args"]

# Flags the service sets itself (or that the xavier backend cannot carry). SGLang's parser accepts any
# unambiguous prefix of a flag (argparse's allow_abbrev), so a prefix of one of these is refused too.
OWNED_FLAGS: dict[str, str] = {
    "--model-path": "engine.model",
    "--model": "engine.model",
    "--tokenizer-path": "engine.model",
    "--host": "the service (loopback)",
    "--port": "sglang.port",
    "--api-key": "the service (a per-replica key)",
    "--disaggregation-mode": "the service's role",
    "--disaggregation-transfer-backend": "sglang.transfer_backend",
    "--disaggregation-bootstrap-port": "sglang.bootstrap_port",
    "--disaggregation-decode-enable-radix-cache": "the service (decode radix cache is off)",
    "--disable-radix-cache": "the service (decode radix cache is off)",
    "--enable-hierarchical-cache": "sglang.hicache",
    "--hicache-storage-backend": "sglang.hicache",
    "--hicache-storage-backend-extra-config": "sglang.hicache",
    "--base-gpu-id": "sglang.base_gpu_id",
    "--tp-size": "the xavier backend (one rank per server)",
    "--tensor-parallel-size": "the xavier backend (one rank per server)",
    "--tp": "the xavier backend (one rank per server)",
    "--pp-size": "the xavier backend (one rank per server)",
    "--pipeline-parallel-size": "the xavier backend (one rank per server)",
    "--dp-size": "the xavier backend (one rank per server)",
    "--data-parallel-size": "the xavier backend (one rank per server)",
    "--dp": "the xavier backend (one rank per server)",
    "--page-size": "engine.page_size",
    "--grammar-backend": "the service (xgrammar: structured output as Xavier declares it)",
    "--constrained-json-disable-any-whitespace": "the service (compact JSON, as Xavier's grammars are)",
    "--incremental-streaming-output": "the service (it reads SGLang's cumulative stream events)",
    "--stream-output": "the service (it reads SGLang's cumulative stream events)",
    "--config": "the service (an SGLang config file could set any flag above)",
    "--dtype": "engine.dtype",
}


def _flag_of(token: str) -> str:
    return token.split("=", 1)[0]


def check_extra_args(args: list[str]) -> list[str]:
    """Refuses a flag Xavier owns (or any prefix SGLang would expand to one), a value with no flag before
    it, and single-dash flags; raises ValueError naming the offending token."""
    expect_flag = True
    for token in args:
        if token.startswith("--"):
            flag = _flag_of(token)
            if flag == "--":
                raise ValueError("'--' is not allowed: every extra argument must be an SGLang flag")
            owned = [f for f in OWNED_FLAGS if f == flag or (len(flag) > 3 and f.startswith(flag))]
            if owned:
                raise ValueError(
                    f"{flag} is set by Xavier ({OWNED_FLAGS[owned[0]]}), not through sglang.extra_args"
                )
            expect_flag = False
        elif token.startswith("-") and not _is_number(token):
            raise ValueError(f"{token!r}: SGLang flags are spelled --name")
        elif expect_flag:
            raise ValueError(f"{token!r} is a value without a flag before it")
    return args


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


class SglangSection(BaseModel):
    """How the service launches and reaches its SGLang server (used when `engine.kind = "sglang"`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    command: list[str] = Field(default_factory=lambda: ["python", "-m", "sglang.launch_server"])
    """The launcher; SGLang's flags follow it. Tests point it at a stand-in."""
    extra_args: list[str] = Field(default_factory=list)
    """More SGLang flags, passed through (e.g. ["--mem-fraction-static", "0.5"]); flags Xavier owns are
    refused."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment of the SGLang process (on top of the service's own)."""
    transfer_backend: Literal["xavier", "nixl"] = "xavier"
    """P/D roles: "xavier" (KV through the Xavier directory and transfer layer; the router pairs peers) or
    "nixl" (SGLang's own NIXL backend: the router's native mode talks to the server directly)."""
    port: int = Field(default=0, ge=0, le=65535)
    """SGLang's HTTP port on 127.0.0.1; 0 picks a free one at start."""
    bootstrap_port: int = Field(default=8998, ge=1, le=65535)
    """The prefill's bootstrap port in "nixl" mode (the xavier backend meets through the directory)."""
    api_key: str = ""
    """SGLang's API key; empty: a random key per start (the service is SGLang's only client)."""
    base_gpu_id: int | None = Field(default=None, ge=0, le=1023)
    """`--base-gpu-id`; None: SGLang's default (0 of the visible devices)."""
    cuda_visible_devices: str = ""
    """CUDA_VISIBLE_DEVICES of the SGLang process; empty: inherited."""
    hicache: bool = False
    """Prefill and unified roles: SGLang's HiCache, its L3 on `hicache_backend`."""
    hicache_backend: Literal["xavier", "file"] = "xavier"
    """HiCache's L3: "xavier" (the page store of `[pagestore] address`) or "file" (SGLang's own file
    backend in SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, no page store: the choice without Xavier)."""
    health_timeout_seconds: float = Field(default=900.0, gt=0, le=86400)
    """Longest wait for SGLang's /health at start (model load, CUDA graph capture)."""
    health_interval_seconds: float = Field(default=10.0, gt=0, le=3600)
    """After start, how often SGLang's /health is probed (SGLang answers it by generating a token)."""
    health_probe_timeout_seconds: float = Field(default=30.0, gt=0, le=3600)
    """Deadline of one probe."""
    unhealthy_after: int = Field(default=3, ge=1, le=1000)
    """Failed probes in a row after which the service reports NOT_SERVING (the router leaves it out) until
    a probe passes again. A hung SGLang is not killed: its requests' deadlines end them."""
    request_timeout_seconds: float = Field(default=600.0, gt=0, le=86400)
    """Longest one request to SGLang may take (the router's request deadline usually ends it first)."""
    stop_grace_seconds: float = Field(default=15.0, gt=0, le=600)
    """After SIGTERM, how long SGLang may take to exit before SIGKILL."""

    @field_validator("command")
    @classmethod
    def _check_command(cls, value: list[str]) -> list[str]:
        if not value or not value[0]:
            raise ValueError("command must name a program")
        return value

    @field_validator("extra_args")
    @classmethod
    def _check_extra(cls, value: list[str]) -> list[str]:
        return check_extra_args(value)

    @field_validator("env")
    @classmethod
    def _check_env(cls, value: dict[str, str]) -> dict[str, str]:
        owned = sorted(k for k in value if k.startswith("XAVIER_") or k == "SGLANG_PLUGINS")
        if owned:
            raise ValueError(f"{owned[0]} is set by Xavier, not through sglang.env")
        return value

    @field_validator("api_key")
    @classmethod
    def _check_key(cls, value: str) -> str:
        if value.startswith("-") or any(c.isspace() for c in value):
            raise ValueError(
                "must not start with '-' or contain whitespace (SGLang reads it as a flag value)"
            )
        return value

    @field_validator("cuda_visible_devices")
    @classmethod
    def _check_devices(cls, value: str) -> str:
        if value and not all(part.strip().isdigit() for part in value.split(",")):
            raise ValueError(f"expected GPU indices like '0' or '0,1', got {value!r}")
        return value
