"""The KV compatibility contract: a peer's KV layout and its canonical digest (the contract fingerprint).

Two peers exchange KV pages only when their fingerprints match. The fingerprint covers everything that
changes the meaning of a KV byte: the engine and its version, dtype, the KV geometry, the page size, the
memory layout, and the content of the weights, tokenizer and ``config.json``. ``model_name`` is a label
and stays out of it, so renaming a served model never splits a fleet.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from xavier.v1 import types_pb2

from xavier_core.contract.hashing import FileHashCache, fingerprint_files
from xavier_core.runtime.errors import InvalidArgument

__all__ = [
    "DEFAULT_MEMORY_LAYOUT",
    "FINGERPRINT_FIELDS",
    "TOKENIZER_FILES",
    "KvLayout",
    "layout_from_model_dir",
]

DEFAULT_MEMORY_LAYOUT = "mha_layer_kv_slot_head_dim"
"""SGLang's MHA pool: per layer one K and one V buffer shaped ``[slots, kv_heads, head_dim]``."""

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
"""Files whose content defines tokenization; those present in the model directory are fingerprinted."""

_DIGEST_TAG = b"xavier.v1/kv-layout\n"


@dataclass(frozen=True, slots=True)
class KvLayout:
    """A peer's KV layout (mirrors ``xavier.v1.KvLayout``)."""

    engine: str
    engine_version: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    memory_layout: str
    weights_fingerprint: str
    tokenizer_fingerprint: str
    config_fingerprint: str
    model_name: str = ""

    @property
    def fingerprint(self) -> str:
        """Hex SHA-256 of the canonical encoding: sorted-key compact JSON of every field but model_name."""
        canon = json.dumps(
            {name: getattr(self, name) for name in FINGERPRINT_FIELDS},
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=True,
        )
        return hashlib.sha256(_DIGEST_TAG + canon.encode("ascii")).hexdigest()

    def to_proto(self) -> types_pb2.KvLayout:
        """The wire form."""
        return types_pb2.KvLayout(**asdict(self))

    @classmethod
    def from_proto(cls, msg: types_pb2.KvLayout) -> KvLayout:
        """From the wire form (every field is plain, so this never fails)."""
        return cls(**{f.name: getattr(msg, f.name) for f in fields(cls)})

    def bytes_per_page(self, element_size: int) -> int:
        """Bytes of one page in one K or V buffer for an element of ``element_size`` bytes."""
        return self.page_size * self.num_kv_heads * self.head_dim * element_size


FINGERPRINT_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(KvLayout) if f.name != "model_name")
"""Fields covered by the contract fingerprint, in declaration order."""


def _config_int(raw: dict[str, Any], key: str, where: Path) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidArgument(f"{where}: {key!r} must be a positive integer, got {value!r}", key=key)
    return value


def _geometry(config_path: Path) -> tuple[int, int, int]:
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read {config_path}: {exc}", path=config_path) from None
    if not isinstance(raw, dict):
        raise InvalidArgument(f"{config_path}: expected a JSON object", path=config_path)
    num_layers = _config_int(raw, "num_hidden_layers", config_path)
    num_heads = _config_int(raw, "num_attention_heads", config_path)
    kv_heads = raw.get("num_key_value_heads") or num_heads
    if not isinstance(kv_heads, int) or kv_heads <= 0:
        raise InvalidArgument(
            f"{config_path}: bad 'num_key_value_heads' {kv_heads!r}", key="num_key_value_heads"
        )
    head_dim = raw.get("head_dim") or _config_int(raw, "hidden_size", config_path) // num_heads
    if not isinstance(head_dim, int) or head_dim <= 0:
        raise InvalidArgument(f"{config_path}: bad 'head_dim' {head_dim!r}", key="head_dim")
    return num_layers, kv_heads, head_dim


def layout_from_model_dir(
    model_dir: Path,
    *,
    engine: str,
    engine_version: str,
    dtype: str,
    page_size: int,
    memory_layout: str = DEFAULT_MEMORY_LAYOUT,
    model_name: str = "",
    cache: FileHashCache | None = None,
) -> KvLayout:
    """Builds the layout of an engine serving the Hugging Face checkpoint in ``model_dir``.

    Geometry comes from ``config.json``; weights (every ``*.safetensors``, content streamed), tokenizer
    files and ``config.json`` are fingerprinted through ``cache`` (the default on-disk cache when None).
    Raises ``InvalidArgument`` naming the file or key at fault.
    """
    if page_size <= 0:
        raise InvalidArgument(f"page_size must be positive, got {page_size}", key="page_size")
    for key, value in (("engine", engine), ("dtype", dtype), ("memory_layout", memory_layout)):
        if not value:
            raise InvalidArgument(f"{key} must not be empty", key=key)
    cache = cache if cache is not None else FileHashCache.default()
    config_path = model_dir / "config.json"
    num_layers, kv_heads, head_dim = _geometry(config_path)
    weights = sorted(model_dir.glob("*.safetensors"))
    if not weights:
        raise InvalidArgument(f"{model_dir}: no *.safetensors weight files", path=model_dir)
    tokenizer = [model_dir / name for name in TOKENIZER_FILES if (model_dir / name).is_file()]
    if not tokenizer:
        names = ", ".join(TOKENIZER_FILES)
        raise InvalidArgument(f"{model_dir}: no tokenizer files ({names})", path=model_dir)
    return KvLayout(
        engine=engine,
        engine_version=engine_version,
        dtype=dtype,
        num_layers=num_layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        memory_layout=memory_layout,
        weights_fingerprint=fingerprint_files(model_dir, weights, cache),
        tokenizer_fingerprint=fingerprint_files(model_dir, tokenizer, cache),
        config_fingerprint=cache.digest(config_path),
        model_name=model_name or model_dir.name,
    )
