"""Router configuration (TOML + XAVIER_* environment + flags, validated at start)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from xavier_core.runtime import ServiceConfig, parse_host_port

ModeName = Literal["auto", "pd", "colocated", "native"]


class NativeConfig(BaseModel):
    """Native SGLang prefill/decode servers (`--disaggregation-mode prefill|decode`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefill_url: str = ""
    """Base URL of the SGLang prefill server, e.g. http://127.0.0.1:30000; empty disables native mode."""
    decode_url: str = ""
    """Base URL of the SGLang decode server."""
    bootstrap_host: str = "127.0.0.1"
    """Host of the prefill server's bootstrap server (what the decode connects to)."""
    bootstrap_port: int = Field(default=8998, ge=1, le=65535)
    api_key: str = ""
    """Bearer key of the native servers (sent as Authorization)."""

    @property
    def enabled(self) -> bool:
        return bool(self.prefill_url and self.decode_url)


def _read_token(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not token:
        raise ValueError(f"{path} is empty")
    return token


class RouterConfig(ServiceConfig):
    """Router settings; `model` names the checkpoint whose tokenizer and chat template the router uses."""

    model: Path | None = None
    model_name: str = ""
    """Served model id; defaults to the checkpoint directory's name."""
    directory: str = ""
    """Directory service address (HOST:PORT); empty serves native mode only."""
    http_listen: str = "127.0.0.1:0"
    """OpenAI-compatible HTTP address; "" disables the HTTP front."""
    http_max_body_bytes: int = Field(default=8 << 20, ge=1024, le=1 << 30)
    """Largest HTTP request body; a larger one is answered 413 with a JSON error."""
    http_max_connections: int = Field(default=1024, ge=1, le=1 << 20)
    """Open HTTP connections at most; one more is answered 503 and closed (keep the process's file
    limit, `LimitNOFILE` in the unit, well above this plus the gRPC channels)."""
    http_header_timeout_seconds: float = Field(default=10.0, ge=0, le=3600)
    """A connection must deliver a request's headers within this of its first byte (or of opening, or
    of its previous response); else it is closed. 0: no deadline."""
    http_body_timeout_seconds: float = Field(default=30.0, gt=0, le=3600)
    """A request's body must arrive within this of its headers; else 408 REQUEST_TIMEOUT."""
    default_mode: ModeName = "auto"
    """auto: pd when prefill and decode peers exist, else colocated, else native."""
    prompt_cache_size: int = Field(default=4096, ge=0, le=10_000_000)
    """Entries of the prompt-fingerprint → token ids LRU; 0 disables it."""
    max_context: int | None = Field(default=None, ge=2)
    """Context limit in tokens; defaults to the checkpoint's max_position_embeddings."""
    request_timeout_seconds: float = Field(default=600.0, gt=0)
    """Deadline of the prefill, decode and unified calls of one request."""
    rpc_timeout_seconds: float = Field(default=5.0, gt=0)
    """Deadline of each directory and other control RPC."""
    peer_refresh_seconds: float = Field(default=0.5, ge=0)
    """How long the router reuses a ListPeers answer."""
    prefix_affinity_tokens: int = Field(default=64, ge=0, le=1_000_000)
    """Leading prompt tokens that key prefix affinity in P/D pair selection; 0 turns affinity off."""
    prefix_affinity_slack: float = Field(default=4.0, ge=0)
    """Outstanding requests a remembered prefill may carry above the least-loaded one and still win."""
    retry_attempts: int = Field(default=3, ge=1, le=10)
    """Attempts of idempotent phases (peer selection) on UNAVAILABLE."""
    peer_wait_seconds: float = Field(default=2.0, ge=0, le=60)
    """How long a request waits for a peer when none is registered (a restarted directory has its peers
    back within about a second of re-registration) before it is answered 503 NO_PEERS."""
    failover_attempts: int = Field(default=3, ge=1, le=10)
    """Peers (pairs in P/D) one request may try before it has streamed a decode token: a peer that
    refuses the connection or answers UNAVAILABLE is left out and the request goes to another."""
    health_interval_seconds: float = Field(default=1.0, gt=0, le=3600)
    """How often the router probes every peer (grpc.health.v1 Check); a peer that fails is left out of
    selection until a probe finds it SERVING again."""
    health_timeout_seconds: float = Field(default=1.0, gt=0, le=60)
    """Deadline of one health probe."""
    progress_timeout_seconds: float = Field(default=60.0, gt=0)
    """A request that gets no token for this long ends with DEADLINE_EXCEEDED (PROGRESS_TIMEOUT)."""
    decode_progress_seconds: float = Field(default=5.0, gt=0, le=3600)
    """A decode that sends nothing for this long, from its call (its first token included) or from its
    previous message, is failed like a dead one: before it streamed a token the request fails over,
    after it the request migrates (unified and SGLang decodes: counted from their first message). Keep
    it below `progress_timeout_seconds`."""
    peer_sessions: bool = True
    """Carry the Prefill, ReleaseSource and Decode calls to each peer that declares call sessions as
    messages on one long-lived stream per peer (about a tenth of an RPC's CPU per call); off, every call
    is its own RPC, as to a peer that does not declare them."""
    migration_limit: int = Field(default=2, ge=0, le=10)
    """Moves to another pair one request may make when its decode fails or stalls after tokens reached
    the client (prompt + tokens sent re-prefilled there); one more failure ends it with
    MIGRATION_LIMIT. 0 turns migration off."""
    keepalive_seconds: float = Field(default=5.0, gt=0)
    """Interval of SSE comment lines sent while a started stream waits for its next token."""
    status_peer_timeout_seconds: float = Field(default=1.0, gt=0, le=60)
    """Deadline of each peer's stats call in GetClusterStatus (all peers are asked concurrently)."""
    workers: int = Field(default=1, ge=1, le=64)
    """Router processes sharing the gRPC and HTTP addresses (SO_REUSEPORT: the kernel spreads connections
    over them; `router/workers.py`). One process does at most one core's work, which at high concurrency
    caps the whole mesh. The request and connection limits are split evenly between the workers, and
    each serves its own /metrics (listed under "workers" in the ready file)."""
    max_inflight_requests: int = Field(default=256, ge=1, le=1_000_000)
    """Requests the router serves at once; more wait in the queue."""
    max_queued_requests: int = Field(default=1024, ge=0, le=1_000_000)
    """Requests that may wait for a serving slot; beyond it a request gets RESOURCE_EXHAUSTED / HTTP 429."""
    queue_timeout_seconds: float = Field(default=30.0, gt=0)
    """Longest wait in the queue before RESOURCE_EXHAUSTED."""
    retry_after_seconds: int = Field(default=1, ge=1, le=3600)
    """The Retry-After an overloaded router suggests."""
    tokenizer_threads: int = Field(default=2, ge=1, le=64)
    """Threads that tokenize and render chats, off the event loop."""
    inline_prepare_chars: int = Field(default=1024, ge=0, le=65_536)
    """Prompts smaller than this (characters of text or chat, or token ids) are validated and tokenized
    on the event loop: handing them to a tokenizer thread costs more CPU than tokenizing them (about
    0.3 ms of loop time at the default on a small machine). 0 sends every prompt to a thread."""
    offload_tokenize_chars: int = Field(default=262_144, ge=1)
    """Prompts of at least this many characters are tokenized in a helper process (the tokenizer holds
    the GIL on very large inputs, which would stall every other stream)."""
    api_token: str = ""
    """Bearer token required on the public gRPC and HTTP APIs; empty disables the check."""
    api_token_file: Path | None = None
    """File holding the bearer token (read once at start, surrounding whitespace dropped), so the secret
    stays out of the config and the environment; excludes ``api_token``."""
    native: NativeConfig = NativeConfig()
    _file_token: str = PrivateAttr(default="")

    @model_validator(mode="after")
    def _load_token_file(self) -> RouterConfig:
        """Reads ``api_token_file`` (once); a bad file is an error of that key."""
        path = self.api_token_file
        if path is None:
            return self
        try:
            if self.api_token:
                raise ValueError("set api_token or api_token_file, not both")
            self._file_token = _read_token(path)
        except ValueError as exc:
            error = PydanticCustomError("value_error", "Value error, {reason}", {"reason": str(exc)})
            detail = InitErrorDetails(type=error, loc=("api_token_file",), input=str(path))
            raise ValidationError.from_exception_data(type(self).__name__, [detail]) from None
        return self

    @model_validator(mode="after")
    def _check_inline_prepare(self) -> RouterConfig:
        """A prompt prepared on the loop must never wait there for the tokenizer process."""
        if self.inline_prepare_chars > self.offload_tokenize_chars:
            reason = f"must not exceed offload_tokenize_chars ({self.offload_tokenize_chars})"
            error = PydanticCustomError("value_error", "Value error, {reason}", {"reason": reason})
            detail = InitErrorDetails(
                type=error, loc=("inline_prepare_chars",), input=self.inline_prepare_chars
            )
            raise ValidationError.from_exception_data(type(self).__name__, [detail]) from None
        return self

    @property
    def bearer_token(self) -> str:
        """The token the public APIs require (``api_token`` or the file's); empty: no check."""
        return self.api_token or self._file_token

    @field_validator("http_listen")
    @classmethod
    def _check_http_listen(cls, value: str) -> str:
        if value:
            parse_host_port(value)
        return value

    @field_validator("directory")
    @classmethod
    def _check_directory(cls, value: str) -> str:
        for address in filter(None, value.split(",")):  # several: directory replicas on etcd
            parse_host_port(address)
        return value
