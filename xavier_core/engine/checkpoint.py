"""Loading a local Hugging Face checkpoint: config, safetensors weights, dtype policy.

Only unquantized, full-attention Qwen2, Qwen3 and Llama text models are served; everything else is
rejected here with a `CheckpointError` naming the file and the key at fault.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from xavier_core.engine.errors import CheckpointError

log = logging.getLogger(__name__)

SUPPORTED_ARCHS = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
}
_DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (`kind` is default, linear or llama3)."""

    theta: float
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """The model facts the forward pass and the KV layout need."""

    arch: str  # "qwen2" | "qwen3" | "llama"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"missing file {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot parse {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object at top level")
    return data


def _int_list(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return tuple(value)
    return ()


def _req(raw: dict[str, Any], key: str, kind: type, where: Path) -> Any:
    value = raw.get(key)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise CheckpointError(f"{where}: key {key!r} must be a {kind.__name__}, got {value!r}")
    return value


def _parse_rope(raw: dict[str, Any], where: Path) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta inside); older checkpoints write `rope_theta`
    # plus an optional `rope_scaling`.
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"{where}: 'rope_parameters'/'rope_scaling' must be an object")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise CheckpointError(
            f"{where}: unsupported rope type {kind!r} (supported: {', '.join(_ROPE_TYPES)})"
        )
    if kind == "default":
        return RopeConfig(theta=float(theta))
    try:
        return RopeConfig(
            theta=float(theta),
            kind=kind,
            factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position=int(params.get("original_max_position_embeddings", 8192)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: bad rope scaling parameters {params!r}: {exc}") from exc


def _reject_unsupported(raw: dict[str, Any], where: Path) -> str:
    archs = raw.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in SUPPORTED_ARCHS:
        raise CheckpointError(
            f"{where}: unsupported architectures {archs!r}; supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    for key in ("quantization_config", "compression_config"):
        if raw.get(key):
            raise CheckpointError(f"{where}: quantized checkpoints are not supported (found {key!r})")
    for key in ("vision_config", "audio_config", "text_config"):
        if key in raw:
            raise CheckpointError(f"{where}: multimodal checkpoints are not supported (found {key!r})")
    if raw.get("use_sliding_window"):
        raise CheckpointError(f"{where}: sliding-window attention is not supported (use_sliding_window=true)")
    layer_types = raw.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise CheckpointError(
            f"{where}: only full attention is supported, 'layer_types' has {set(layer_types)}"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: unsupported hidden_act {raw.get('hidden_act')!r} (only silu)")
    if raw.get("mlp_bias"):
        raise CheckpointError(f"{where}: mlp_bias=true is not supported")
    return SUPPORTED_ARCHS[archs[0]]


def parse_config(raw: dict[str, Any], where: Path) -> ModelConfig:
    """Validates a config.json object and returns the model facts, or raises `CheckpointError`."""
    arch = _reject_unsupported(raw, where)
    hidden = _req(raw, "hidden_size", int, where)
    heads = _req(raw, "num_attention_heads", int, where)
    kv_heads = raw.get("num_key_value_heads") or heads
    head_dim = raw.get("head_dim") or hidden // max(heads, 1)
    if heads <= 0 or not isinstance(kv_heads, int) or kv_heads <= 0 or heads % kv_heads != 0:
        raise CheckpointError(
            f"{where}: num_attention_heads {heads} must be a multiple of num_key_value_heads"
        )
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise CheckpointError(f"{where}: head_dim must be a positive even integer, got {head_dim!r}")
    default_bias = arch == "qwen2"
    return ModelConfig(
        arch=arch,
        vocab_size=_req(raw, "vocab_size", int, where),
        hidden_size=hidden,
        num_layers=_req(raw, "num_hidden_layers", int, where),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=_req(raw, "intermediate_size", int, where),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_parse_rope(raw, where),
        max_position=_req(raw, "max_position_embeddings", int, where),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", default_bias)) or default_bias,
        qk_norm=arch == "qwen3",
        eos_token_ids=_int_list(raw.get("eos_token_id")),
        bos_token_id=raw.get("bos_token_id") if isinstance(raw.get("bos_token_id"), int) else None,
    )


def load_config(model_dir: Path) -> ModelConfig:
    """Reads and validates `config.json`, adding eos ids from `generation_config.json` if present."""
    cfg = parse_config(_read_json(model_dir / "config.json"), model_dir / "config.json")
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        extra = _int_list(_read_json(gen_path).get("eos_token_id"))
        eos = tuple(dict.fromkeys(cfg.eos_token_ids + extra))
        cfg = ModelConfig(**{**cfg.__dict__, "eos_token_ids": eos})
    return cfg


def resolve_dtype(device: str, dtype: str | None) -> torch.dtype:
    """Float16 by default on CUDA, float32 by default on CPU; bfloat16 is served as float16."""
    name = dtype or ("float16" if device.startswith("cuda") else "float32")
    if name not in _DTYPES:
        raise CheckpointError(f"unsupported dtype {name!r} (float16 or float32)")
    if name == "bfloat16":
        log.warning("bfloat16 requested: serving in float16 (the KV layout dtype)")
        return torch.float16
    return _DTYPES[name]


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name the checkpoint must hold, with its shape."""
    h, d, q, kv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q * d, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv * d, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv * d, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q * d)
        if cfg.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q * d,)
            shapes[p + "self_attn.k_proj.bias"] = (kv * d,)
            shapes[p + "self_attn.v_proj.bias"] = (kv * d,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
    return shapes


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Maps tensor name to the safetensors file holding it (single file or sharded with an index)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: missing 'weight_map'")
        return {str(k): model_dir / str(v) for k, v in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{model_dir}: no model.safetensors nor model.safetensors.index.json")
    try:
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{single}: corrupt safetensors file: {exc}") from exc


def load_weights(
    model_dir: Path, cfg: ModelConfig, device: str, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Loads and shape-checks every expected tensor, cast to `dtype` on `device`."""
    files = _weight_files(model_dir)
    shapes = expected_shapes(cfg)
    by_file: dict[Path, list[str]] = {}
    for name in shapes:
        if name not in files:
            raise CheckpointError(f"{model_dir}: tensor {name!r} is missing from the checkpoint")
        by_file.setdefault(files[name], []).append(name)
    weights: dict[str, torch.Tensor] = {}
    warned = False
    for path, names in by_file.items():
        if not path.is_file():
            raise CheckpointError(f"missing weight shard {path}")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in names:
                    tensor = f.get_tensor(name)
                    if tensor.dtype not in (torch.float16, torch.bfloat16, torch.float32):
                        raise CheckpointError(
                            f"{path}: tensor {name!r} has dtype {tensor.dtype} (quantized?)"
                        )
                    if tuple(tensor.shape) != shapes[name]:
                        got = tuple(tensor.shape)
                        raise CheckpointError(
                            f"{path}: tensor {name!r} has shape {got}, expected {shapes[name]}"
                        )
                    if tensor.dtype == torch.bfloat16 and dtype != torch.float32 and not warned:
                        log.warning("%s: bfloat16 weights cast to %s", path, dtype)
                        warned = True
                    weights[name] = tensor.to(device=device, dtype=dtype)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{path}: corrupt safetensors file: {exc}") from exc
    for name, tensor in weights.items():
        if name.endswith("norm.weight") and not math.isfinite(float(tensor.float().abs().sum())):
            raise CheckpointError(f"{files[name]}: tensor {name!r} holds non-finite values")
    return weights
