"""What an SGLang process tells Xavier about itself, checked at start.

SGLang hands its transfer backend a `KVArgs` (buffer pointers, lengths, bytes per page) and its
`ServerArgs`; both shapes vary between releases (0.5.17 … 0.5.23), so they are read defensively, by
attribute name, into `PoolShape` and `ProcessShape`. `check_supported` then refuses, at start and naming
the SGLang option to change, every set-up the Xavier contract does not describe: tensor, pipeline or
data parallelism above 1, MLA, state buffers (Mamba / SWA / DSA), a KV page size or dtype that does not
match the model's geometry. `contract_layout` builds the `KvLayout` whose fingerprint every peer of a
fleet must share. Nothing here imports SGLang.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xavier_core.contract import DEFAULT_MEMORY_LAYOUT, KvLayout, layout_from_model_dir
from xavier_core.runtime.config import TLS_FILE_ENV, TlsSettings
from xavier_core.runtime.errors import InvalidArgument
from xavier_core.transfer.common.buffers import KvBuffer

__all__ = [
    "DTYPE_BYTES",
    "ENV_ADVERTISE",
    "ENV_DIRECTORY",
    "ENV_PEER_ID",
    "ENV_TRANSFER_TIMEOUT",
    "PoolShape",
    "ProcessShape",
    "UnsupportedSetupError",
    "XavierSettings",
    "check_supported",
    "contract_layout",
    "xavier_configured",
]

ENV_DIRECTORY = "XAVIER_DIRECTORY"
ENV_ADVERTISE = "XAVIER_SGLANG_ADVERTISE"
ENV_PEER_ID = "XAVIER_SGLANG_PEER_ID"
ENV_BOOTSTRAP_TIMEOUT = "XAVIER_SGLANG_BOOTSTRAP_TIMEOUT"
ENV_WAITING_TIMEOUT = "XAVIER_SGLANG_WAITING_TIMEOUT"
ENV_TRANSFER_TIMEOUT = "XAVIER_SGLANG_TRANSFER_TIMEOUT"
ENV_PROGRESS_THREAD = "XAVIER_SGLANG_NIXL_PROGRESS_THREAD"
ENV_CUDA_IPC = "XAVIER_SGLANG_CUDA_IPC"
ENV_CALL_SESSIONS = "XAVIER_SGLANG_CALL_SESSIONS"

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}
"""KV element dtypes the contract describes, by the names SGLang's `--kv-cache-dtype` resolves to."""
# The directory's rule for a peer id (RegisterPeerRequest.peer_id): checked here too, so a bad id stops
# SGLang at start naming the variable instead of failing every registration attempt.
_PEER_ID = re.compile(r"[A-Za-z0-9._:@\-]{1,128}")


class UnsupportedSetupError(ValueError):
    """An SGLang set-up the Xavier backend cannot serve; `option` is the SGLang option to change."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"{option}: {message}")
        self.option = option


def xavier_configured(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> bool:
    """True when this process is meant to use Xavier: the directory is configured, or the command line
    asks for `--disaggregation-transfer-backend xavier` (also as `--...=xavier`)."""
    env = os.environ if environ is None else environ
    if env.get(ENV_DIRECTORY):
        return True
    args = list(argv if argv is not None else [])
    for i, arg in enumerate(args):
        if arg == "--disaggregation-transfer-backend" and i + 1 < len(args) and args[i + 1] == "xavier":
            return True
        if arg == "--disaggregation-transfer-backend=xavier":
            return True
    return False


@dataclass(frozen=True)
class XavierSettings:
    """Where the directory is and how long rooms may wait; from the environment (the service that hosts
    SGLang sets it)."""

    directory: str
    advertise: str
    peer_id: str = ""
    """The stable peer id to register under (the hosting service's `peer.peer_id`): a restarted SGLang
    keeps it and gets a new epoch. Empty: the directory assigns one per start."""
    bootstrap_timeout_s: float = 300.0
    waiting_timeout_s: float = 300.0
    transfer_timeout_s: float = 30.0
    progress_thread: bool = True
    """NIXL's own progress thread (`XAVIER_SGLANG_NIXL_PROGRESS_THREAD`, default on): transfers move
    and notifications arrive without SGLang's scheduler driving them, so its polls only read states.
    Off (`0`) the scheduler's polls drive NIXL, which costs it a large share of every iteration."""
    tls: TlsSettings | None = None
    """mTLS to the directory (`XAVIER_TLS__CERT_FILE`, `__KEY_FILE`, `__CA_FILE`: the hosting service's
    own `[tls]`, whose certificate names the peer this process registers as); None: plaintext."""
    call_sessions: bool = True
    """Whether the peer declares call sessions (`XAVIER_SGLANG_CALL_SESSIONS`, default on: the hosting
    service's `peer.call_sessions`): the service at the registered address serves them."""
    cuda_ipc: bool = True
    """Same-host GPU pairs copy KV through CUDA IPC (`XAVIER_SGLANG_CUDA_IPC`, default on): the decode
    exports its pool, the prefill maps it once per decode epoch and writes each chunk with one fused
    copy kernel, then notifies over NIXL. NIXL WRITEs cost a few microseconds per descriptor (one per
    page run per buffer), tens of milliseconds for a scattered prompt. Off (`0`), or where the pool
    cannot be shared (another host, DRAM pools, no Triton), the prefill WRITEs over NIXL."""

    @classmethod
    def from_env(cls, default_advertise: str, environ: dict[str, str] | None = None) -> XavierSettings:
        env = os.environ if environ is None else environ
        directory = env.get(ENV_DIRECTORY, "")
        if not directory:
            raise UnsupportedSetupError(
                ENV_DIRECTORY, "the xavier transfer backend needs the directory's address (host:port)"
            )
        return cls(
            directory=directory,
            advertise=env.get(ENV_ADVERTISE) or default_advertise,
            peer_id=_peer_id(env),
            bootstrap_timeout_s=_seconds(env, ENV_BOOTSTRAP_TIMEOUT, 300.0),
            waiting_timeout_s=_seconds(env, ENV_WAITING_TIMEOUT, 300.0),
            transfer_timeout_s=_seconds(env, ENV_TRANSFER_TIMEOUT, 30.0),
            progress_thread=_flag(env, ENV_PROGRESS_THREAD, True),
            cuda_ipc=_flag(env, ENV_CUDA_IPC, True),
            call_sessions=_flag(env, ENV_CALL_SESSIONS, True),
            tls=_tls(env),
        )


def _tls(env: Any) -> TlsSettings | None:
    files = {key: str(env.get(name) or "") for key, name in TLS_FILE_ENV.items()}
    if not any(files.values()):
        return None
    missing = [TLS_FILE_ENV[key] for key, value in files.items() if not value]
    if missing:
        raise UnsupportedSetupError(missing[0], "mTLS needs a certificate, its key and the CA bundle")
    return TlsSettings.model_validate(files)


def _flag(env: Any, key: str, default: bool) -> bool:
    raw = str(env.get(key) or "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise UnsupportedSetupError(key, f"expected 1 or 0, got {raw[:16]!r}")


def _peer_id(env: Any) -> str:
    raw = str(env.get(ENV_PEER_ID) or "")
    if raw and not _PEER_ID.fullmatch(raw):
        raise UnsupportedSetupError(ENV_PEER_ID, f"expected 1..128 of [A-Za-z0-9._:@-], got {raw[:64]!r}")
    return raw


def _seconds(env: Any, key: str, default: float) -> float:
    raw = env.get(key)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise UnsupportedSetupError(key, f"expected seconds, got {raw!r}") from None
    if not 0 < value <= 86400:
        raise UnsupportedSetupError(key, f"expected 0 < seconds <= 86400, got {value}")
    return value


@dataclass(frozen=True)
class PoolShape:
    """The KV and aux buffers of one SGLang process, read from its `KVArgs`."""

    kv: tuple[KvBuffer, ...]
    aux: tuple[KvBuffer, ...]
    page_size: int
    kv_head_num: int
    dtype: str  # SGLang's kv_cache_dtype_str ("auto" means the model's dtype)
    device: str
    has_state: bool
    kv_layout: str | None = None  # 0.5.23 names non-default pool layouts (DeepSeek V4); None is MHA

    @classmethod
    def from_kv_args(cls, args: Any, device: str) -> PoolShape:
        """Reads the fields every release has, and the optional ones (state buffers, layout) if present.
        `device` is where the KV pool lives ("cpu" or "cuda:N"); the aux buffers are always in host memory."""
        kv = _buffers(args, "kv_data_ptrs", "kv_data_lens", "kv_item_lens", device)
        aux = _buffers(args, "aux_data_ptrs", "aux_data_lens", "aux_item_lens", "cpu")
        state_ptrs = getattr(args, "state_data_ptrs", None) or []
        has_state = any(bool(p) for p in state_ptrs) or bool(getattr(args, "state_types", None) or [])
        return cls(
            kv=kv,
            aux=aux,
            page_size=int(getattr(args, "page_size", 0) or 0),
            kv_head_num=int(getattr(args, "kv_head_num", 0) or 0),
            dtype=str(getattr(args, "kv_cache_dtype_str", "") or "auto"),
            device=device,
            has_state=has_state,
            kv_layout=getattr(args, "kv_layout", None),
        )


def _buffers(args: Any, ptrs: str, lens: str, items: str, device: str) -> tuple[KvBuffer, ...]:
    p, n, i = (list(getattr(args, name, None) or []) for name in (ptrs, lens, items))
    if not (len(p) == len(n) == len(i)):
        raise UnsupportedSetupError(ptrs, f"{ptrs}, {lens} and {items} differ in length")
    return tuple(KvBuffer(int(a), int(b), int(c), device) for a, b, c in zip(p, n, i, strict=True))


@dataclass(frozen=True)
class ProcessShape:
    """The parallelism and model of one SGLang process, read from its `ServerArgs`."""

    model_path: str
    tp_size: int
    pp_size: int
    dp_size: int
    is_mla: bool
    host: str
    bootstrap_port: int
    engine_version: str
    device: str = "cuda"
    gpu_id: int = 0

    @property
    def kv_device(self) -> str:
        """The KV pool's device in transfer-layer terms."""
        return "cpu" if self.device == "cpu" else f"cuda:{self.gpu_id}"

    @classmethod
    def from_server_args(
        cls, server_args: Any, is_mla: bool, engine_version: str, gpu_id: int = 0
    ) -> ProcessShape:
        return cls(
            model_path=str(getattr(server_args, "model_path", "") or ""),
            tp_size=int(getattr(server_args, "tp_size", 1) or 1),
            pp_size=int(getattr(server_args, "pp_size", 1) or 1),
            dp_size=int(getattr(server_args, "dp_size", 1) or 1),
            is_mla=bool(is_mla),
            host=str(getattr(server_args, "host", "127.0.0.1") or "127.0.0.1"),
            bootstrap_port=int(getattr(server_args, "disaggregation_bootstrap_port", 8998) or 8998),
            engine_version=engine_version,
            device=str(getattr(server_args, "device", "cuda") or "cuda"),
            gpu_id=gpu_id,
        )


def check_supported(proc: ProcessShape, pool: PoolShape) -> None:
    """Raises `UnsupportedSetupError` naming the option for a set-up the contract does not describe."""
    for option, size in (
        ("--tp-size", proc.tp_size),
        ("--pp-size", proc.pp_size),
        ("--dp-size", proc.dp_size),
    ):
        if size != 1:
            raise UnsupportedSetupError(option, f"the xavier transfer backend supports 1, got {size}")
    if proc.is_mla:
        raise UnsupportedSetupError(
            "--attention-backend", "MLA KV pools are not described by the Xavier contract (MHA only)"
        )
    if pool.has_state:
        raise UnsupportedSetupError(
            "--model-path",
            "models with state buffers (Mamba, SWA, DSA) are not supported by the xavier backend",
        )
    if pool.kv_layout is not None:
        raise UnsupportedSetupError(
            "--model-path", f"KV pool layout {pool.kv_layout!r} is not described by the Xavier contract"
        )
    if proc.device not in ("cuda", "cpu"):
        raise UnsupportedSetupError(
            "--device", f"the xavier backend moves cuda or cpu KV, not {proc.device!r}"
        )
    if pool.page_size < 1:
        raise UnsupportedSetupError("--page-size", f"must be positive, got {pool.page_size}")
    if not pool.kv or len(pool.kv) % 2:
        raise UnsupportedSetupError(
            "--disaggregation-transfer-backend",
            f"expected one K and one V buffer per layer, got {len(pool.kv)}",
        )
    sizes = {b.bytes_per_page for b in pool.kv}
    if len(sizes) != 1:
        raise UnsupportedSetupError(
            "--kv-cache-dtype", f"KV buffers differ in bytes per page: {sorted(sizes)}"
        )


def contract_layout(proc: ProcessShape, pool: PoolShape, model_name: str = "") -> KvLayout:
    """The contract layout of this process: geometry and fingerprints from the model directory, checked
    against what SGLang actually allocated (a page size or dtype that does not fit fails here)."""
    model_dir = Path(proc.model_path)
    if not (model_dir / "config.json").is_file():
        raise UnsupportedSetupError("--model-path", f"{model_dir} is not a local model directory")
    dtype = _resolve_dtype(pool.dtype, model_dir)
    try:
        layout = layout_from_model_dir(
            model_dir,
            engine="sglang",
            engine_version=proc.engine_version,
            dtype=dtype,
            page_size=pool.page_size,
            memory_layout=DEFAULT_MEMORY_LAYOUT,
            model_name=model_name,
        )
    except InvalidArgument as err:  # no weights or tokenizer files, a malformed config.json
        raise UnsupportedSetupError("--model-path", err.message) from None
    if len(pool.kv) != 2 * layout.num_layers:
        raise UnsupportedSetupError(
            "--model-path",
            f"the model has {layout.num_layers} layers but SGLang registered {len(pool.kv)} buffers",
        )
    if pool.kv_head_num and pool.kv_head_num != layout.num_kv_heads:
        raise UnsupportedSetupError(
            "--tp-size",
            f"KV heads per process {pool.kv_head_num} differ from the model's {layout.num_kv_heads}",
        )
    want = layout.bytes_per_page(DTYPE_BYTES[dtype])
    got = pool.kv[0].bytes_per_page
    if got != want:
        # SGLang's page size is trusted: bytes that divide into whole elements of another size point at
        # the dtype, anything else at the page size.
        per_page_elems = pool.page_size * layout.num_kv_heads * layout.head_dim
        option = "--kv-cache-dtype" if got % per_page_elems == 0 else "--page-size"
        raise UnsupportedSetupError(
            option,
            f"a KV page holds {got} bytes; the contract for page size {pool.page_size} and dtype {dtype} "
            f"describes {want}",
        )
    return layout


def _resolve_dtype(name: str, model_dir: Path) -> str:
    if name in ("auto", ""):
        try:
            raw = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise UnsupportedSetupError("--model-path", f"cannot read config.json: {exc}") from None
        name = str(raw.get("torch_dtype") or raw.get("dtype") or "")
    if name not in DTYPE_BYTES:
        raise UnsupportedSetupError(
            "--kv-cache-dtype", f"KV dtype {name!r} is not described by the contract ({sorted(DTYPE_BYTES)})"
        )
    return name
