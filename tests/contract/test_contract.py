"""The KV compatibility contract: layout fingerprints, the file-hash cache, mismatch errors, prefix keys."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from xavier_core.contract import (
    FINGERPRINT_FIELDS,
    FileHashCache,
    KvLayout,
    differing_fields,
    hashing,
    layout_from_model_dir,
    require_compatible,
)
from xavier_core.prefix_keys import chain_seed, page_keys
from xavier_core.runtime.errors import InvalidArgument, LayoutMismatch, to_rpc_status

SETTINGS = dict(engine="reference", engine_version="0.1", dtype="float16", page_size=16)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "tiny-qwen2"
    d.mkdir()
    config = {"num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 256}
    (d / "config.json").write_text(json.dumps(config))
    (d / "tokenizer.json").write_text('{"model": {"vocab": {}}}')
    (d / "tokenizer_config.json").write_text("{}")
    (d / "model-00001-of-00002.safetensors").write_bytes(os.urandom(3 << 20))
    (d / "model-00002-of-00002.safetensors").write_bytes(os.urandom(1 << 20))
    return d


def test_layout_from_model_dir(model_dir: Path, tmp_path: Path) -> None:
    lay = layout_from_model_dir(model_dir, cache=FileHashCache(tmp_path / "cache"), **SETTINGS)  # type: ignore[arg-type]
    assert (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.page_size) == (3, 2, 32, 16)
    assert lay.model_name == "tiny-qwen2" and len(lay.fingerprint) == 64
    assert lay.config_fingerprint == hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()
    assert KvLayout.from_proto(lay.to_proto()) == lay
    # The label is not part of the contract.
    assert replace(lay, model_name="renamed").fingerprint == lay.fingerprint


def test_fingerprint_stable_across_processes(model_dir: Path, tmp_path: Path) -> None:
    lay = layout_from_model_dir(model_dir, cache=FileHashCache(tmp_path / "a"), **SETTINGS)  # type: ignore[arg-type]
    code = (
        "import sys; from pathlib import Path;"
        "from xavier_core.contract import FileHashCache, layout_from_model_dir;"
        "print(layout_from_model_dir(Path(sys.argv[1]), cache=FileHashCache(Path(sys.argv[2])),"
        " engine='reference', engine_version='0.1', dtype='float16', page_size=16).fingerprint)"
    )
    for cache, hash_seed in (("a", "1"), ("b", "2")):  # a warm and a cold cache give the same answer
        out = subprocess.run(
            [sys.executable, "-c", code, str(model_dir), str(tmp_path / cache)],
            capture_output=True, text=True, check=True, env={**os.environ, "PYTHONHASHSEED": hash_seed},
        )  # fmt: skip
        assert out.stdout.strip() == lay.fingerprint


def test_cache_hit_avoids_rehashing(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[str] = []
    real = hashing.sha256_file

    def counting(path: Path) -> str:
        reads.append(path.name)
        return real(path)

    monkeypatch.setattr(hashing, "sha256_file", counting)
    first = layout_from_model_dir(model_dir, cache=FileHashCache(tmp_path / "c"), **SETTINGS)  # type: ignore[arg-type]
    assert len(reads) == 5  # two shards, two tokenizer files, config.json
    reads.clear()
    cache = FileHashCache(tmp_path / "c")  # a fresh process-like instance over the same directory
    assert layout_from_model_dir(model_dir, cache=cache, **SETTINGS) == first  # type: ignore[arg-type]
    assert reads == [] and cache.hits == 5 and cache.misses == 0
    # A changed shard (new content, new mtime) is hashed again, and only that one.
    shard = model_dir / "model-00002-of-00002.safetensors"
    shard.write_bytes(os.urandom(1 << 20))
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 1_000_000))
    changed = layout_from_model_dir(model_dir, cache=cache, **SETTINGS)  # type: ignore[arg-type]
    assert reads == [shard.name]
    assert changed.weights_fingerprint != first.weights_fingerprint


def test_corrupt_cache_entry_is_rehashed(model_dir: Path, tmp_path: Path) -> None:
    cache = FileHashCache(tmp_path / "c")
    path = model_dir / "config.json"
    good = cache.digest(path)
    assert cache.directory is not None
    for entry in cache.directory.iterdir():
        entry.write_text("not json")
    again = FileHashCache(tmp_path / "c")
    assert again.digest(path) == good and again.misses == 1


def test_every_differing_field_is_named(model_dir: Path, tmp_path: Path) -> None:
    a = layout_from_model_dir(model_dir, cache=FileHashCache(tmp_path / "c"), **SETTINGS)  # type: ignore[arg-type]
    require_compatible(a, replace(a, model_name="other"))
    for name in FINGERPRINT_FIELDS:
        value = getattr(a, name)
        b = replace(a, **{name: value + 1 if isinstance(value, int) else value + "x"})
        assert differing_fields(a, b) == [name]
    b = replace(a, dtype="float32", page_size=32, weights_fingerprint="0" * 64, engine_version="0.2")
    with pytest.raises(LayoutMismatch) as err:
        require_compatible(a.to_proto(), b, a_name="prefill", b_name="decode")
    fields = ["engine_version", "dtype", "page_size", "weights_fingerprint"]
    assert err.value.metadata["fields"] == ",".join(fields)
    for name in fields:
        assert name in err.value.message and name in err.value.metadata
    assert err.value.metadata["page_size"] == "prefill=16 decode=32"
    assert to_rpc_status(err.value).code.name == "FAILED_PRECONDITION"


def test_bad_model_dirs_name_the_problem(model_dir: Path, tmp_path: Path) -> None:
    cache = FileHashCache(None)
    (model_dir / "config.json").write_text(json.dumps({"num_hidden_layers": 0}))
    with pytest.raises(InvalidArgument, match="num_hidden_layers"):
        layout_from_model_dir(model_dir, cache=cache, **SETTINGS)  # type: ignore[arg-type]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(
        json.dumps({"num_hidden_layers": 1, "num_attention_heads": 1, "head_dim": 8})
    )
    with pytest.raises(InvalidArgument, match="safetensors"):
        layout_from_model_dir(empty, cache=cache, **SETTINGS)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="page_size"):
        layout_from_model_dir(model_dir, cache=cache, **{**SETTINGS, "page_size": 0})  # type: ignore[arg-type]


# --- prefix page keys ---------------------------------------------------------------------------------------
# Golden vectors: a change here breaks every stored page key (pagestore contents, cross-replica sharing).

GOLDEN = [
    (
        "0" * 64, "", list(range(10)), 4,
        "883bf4819e1aaf10612bd06b3855cb76e8cf2aa6702a395b0348d8678c37fe21",
        ["9a963bdad4206a06f320f96978012f5e31188f4a8de9d06ea7b05f9be8c8ae8e",
         "55953dd6fbda9c2540e811a4a7c0fedcf254da251b4c25c0dfac3b0f3c629a00"],
    ),
    (
        "ab" * 32, "tenant-a", [1, 2**32 - 1, 7, 151643, 0, 42], 2,
        "f5d46a2a2106915e50b465c15e7b3895086bb0d69829a36a3d9f72f05f63bf79",
        ["f18f9673bccd4591611757ef7909eb0a5afc6b75b97aa36193707a74de9728a3",
         "b83a94401be16abb2a523b77e1d26611e637014a380e97614492f8d7236b5c51",
         "c4b8103cd5c9a28cb5acb93835ea983c74fa24f094d04df1765bf0c44e1286dd"],
    ),
]  # fmt: skip


@pytest.mark.parametrize(("fingerprint", "salt", "tokens", "page", "seed_hex", "keys_hex"), GOLDEN)
def test_prefix_key_golden_vectors(
    fingerprint: str, salt: str, tokens: list[int], page: int, seed_hex: str, keys_hex: list[str]
) -> None:
    seed = chain_seed(fingerprint, salt)
    assert seed.hex() == seed_hex
    assert [k.hex() for k in page_keys(seed, tokens, page)] == keys_hex
    # The documented recipe, written out independently of the implementation.
    prev = hashlib.sha256(b"xavier.v1/prefix" + fingerprint.encode() + b"\0" + salt.encode()).digest()
    assert prev == seed
    for i, want in enumerate(keys_hex):
        chunk = tokens[i * page : (i + 1) * page]
        prev = hashlib.sha256(prev + struct.pack(f"<{page}I", *chunk)).digest()
        assert prev.hex() == want


def test_prefix_keys_cover_full_pages_and_separate_tenants() -> None:
    seed = chain_seed("f" * 64)
    tokens = list(range(11))
    assert len(page_keys(seed, tokens, 4)) == 2  # the partial third page gets no key
    assert page_keys(seed, tokens[:8], 4) == page_keys(seed, tokens, 4)
    assert page_keys(chain_seed("f" * 64, "other"), tokens, 4)[0] != page_keys(seed, tokens, 4)[0]
    assert page_keys(chain_seed("e" * 64), tokens, 4)[0] != page_keys(seed, tokens, 4)[0]
    changed = [*tokens[:4], 99, *tokens[5:]]
    a, b = page_keys(seed, tokens, 4), page_keys(seed, changed, 4)
    assert a[0] == b[0] and a[1] != b[1]
