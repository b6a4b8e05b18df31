"""Checkpoint loading: what is accepted, and clear errors for everything else."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from xavier_core.engine.checkpoint import load_config
from xavier_core.engine.errors import CheckpointError
from xavier_core.engine.reference import ReferenceEngine
from xavier_core.engine.tiny import SHAPES, make_tiny, make_tiny_main, shape_sizes


@pytest.fixture
def ckpt(tiny_dirs: dict[str, Path], tmp_path: Path) -> Path:
    """A private copy of the tiny Qwen2 checkpoint that a test may break."""
    return Path(shutil.copytree(tiny_dirs["qwen2"], tmp_path / "ckpt"))


def _edit_config(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    cfg = json.loads((path / "config.json").read_text())
    change(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.update(architectures=["MistralForCausalLM"]), "unsupported architectures"),
        (lambda c: c.update(architectures=["Qwen2VLForConditionalGeneration"]), "unsupported architectures"),
        (lambda c: c.update(vision_config={"depth": 2}), "multimodal"),
        (lambda c: c.update(quantization_config={"quant_method": "awq"}), "quantized"),
        (lambda c: c.update(use_sliding_window=True, sliding_window=64), "sliding-window"),
        (lambda c: c.update(layer_types=["sliding_attention", "full_attention"]), "full attention"),
        (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope type 'yarn'"),
        (lambda c: c.update(num_key_value_heads=3), "multiple of num_key_value_heads"),
        (lambda c: c.pop("hidden_size"), "'hidden_size'"),
        (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    ],
)
def test_unsupported_configs_are_rejected(
    ckpt: Path, change: Callable[[dict[str, Any]], None], message: str
) -> None:
    _edit_config(ckpt, change)
    with pytest.raises(CheckpointError, match=message) as err:
        ReferenceEngine.load(ckpt)
    assert "config.json" in str(err.value)


def test_missing_and_corrupt_files(ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        ReferenceEngine.load(tmp_path / "nowhere")
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"cannot parse .*config\.json"):
        load_config(ckpt)


def test_bad_weights(ckpt: Path) -> None:
    weights = load_file(str(ckpt / "model.safetensors"))
    weights.pop("model.layers.1.mlp.up_proj.weight")
    save_file(weights, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing"):
        ReferenceEngine.load(ckpt)
    weights["model.layers.1.mlp.up_proj.weight"] = weights["model.layers.1.mlp.gate_proj.weight"][:5].clone()
    save_file(weights, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"has shape \(5, 64\), expected \(128, 64\)"):
        ReferenceEngine.load(ckpt)
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="corrupt safetensors"):
        ReferenceEngine.load(ckpt)
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        ReferenceEngine.load(ckpt)


def test_missing_tokenizer(ckpt: Path) -> None:
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"missing file .*tokenizer\.json"):
        ReferenceEngine.load(ckpt)


def test_bad_dtype_and_device(ckpt: Path) -> None:
    with pytest.raises(CheckpointError, match="unsupported dtype"):
        ReferenceEngine.load(ckpt, dtype="int8")
    with pytest.raises(CheckpointError, match="CUDA"):
        ReferenceEngine.load(ckpt, device="cuda:7") if not _has_cuda() else pytest.skip("CUDA present")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


async def test_sharded_bf16_checkpoint_loads_as_fp16(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = make_tiny(tmp_path / "sharded", "llama", dtype="bfloat16", shards=3)
    assert (path / "model.safetensors.index.json").is_file() and not (path / "model.safetensors").exists()
    with caplog.at_level(logging.WARNING):
        engine = ReferenceEngine.load(path, dtype="float16")
    try:
        assert engine.dtype_name == "float16"
        assert any("bfloat16" in r.message for r in caplog.records)
        assert engine.kv_buffers()[0].bytes_per_page == 16 * engine.num_kv_heads * engine.head_dim * 2
    finally:
        await engine.close()
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing weight shard"):
        ReferenceEngine.load(path)


def test_make_tiny_is_deterministic_and_has_a_cli(tmp_path: Path) -> None:
    def digest(path: Path) -> dict[str, str]:
        return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}

    a = make_tiny(tmp_path / "a", "qwen3", seed=3)
    assert make_tiny_main([str(tmp_path / "b"), "--arch", "qwen3", "--seed", "3"]) == 0
    assert digest(a) == digest(tmp_path / "b")
    make_tiny_main([str(tmp_path / "c"), "--arch", "qwen3", "--seed", "4", "--layers", "3", "--vocab", "600"])
    assert digest(a)["model.safetensors"] != digest(tmp_path / "c")["model.safetensors"]
    cfg = load_config(tmp_path / "c")
    assert cfg.num_layers == 3 and cfg.vocab_size == 600 and cfg.qk_norm and cfg.max_position == 4096
    with pytest.raises(CheckpointError):
        make_tiny(tmp_path / "d", "gpt2")


def test_shape_sizes_name_a_shape_and_may_change_its_depth() -> None:
    assert shape_sizes("7b-width") == SHAPES["7b-width"] and shape_sizes("7b-width")["layers"] == 4
    deep = shape_sizes("7b-width", 28)
    assert deep == {**SHAPES["7b-width"], "layers": 28} and SHAPES["7b-width"]["layers"] == 4  # a copy
    assert shape_sizes("tiny") == {} and shape_sizes("tiny", 3) == {"layers": 3}
