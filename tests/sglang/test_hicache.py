"""The HiCache storage backend, created by SGLang's own `StorageBackendFactory` ("dynamic", interface_v1),
round-trips pages between host pools and a real page store process over NIXL.

The host pools are SGLang's own `MHATokenToKVPoolHost` in the page-first layout, built on CPU as SGLang's
cache controller builds them: over an `MHATokenToKVPool` with `device="cpu"` (0.5.17 passes the device
pool itself, 0.5.23 its `get_device_pool_infos()` buffer info) and `pin_memory=False` (pinning needs a
CUDA driver). The backend learns the pool only through `get_page_buffer_meta`, as inside SGLang. Keys are
SGLang's own page hash chain (`get_hash_str`).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="the real sglang package is not installed")

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str
from xavier_sglang.config import UnsupportedSetupError
from xavier_sglang.hicache import XavierHiCacheStorage, host_pool_buffers, lower_switch_interval
from xavier_sglang.trace import ENV_TRACE

from tests.pagestore.support import start_store
from tests.support.procs import ServiceProc

pytestmark = [pytest.mark.sglang, pytest.mark.integration]

LAYERS, HEADS, DIM, PAGE = 2, 2, 16, 4
DEVICE_TOKENS, HOST_RATIO = 128, 2.0  # a host pool of at least 64 pages


def host_pool(
    seed: int | None,
    layers: int = LAYERS,
    heads: int = HEADS,
    dim: int = DIM,
    page: int = PAGE,
    device_tokens: int = DEVICE_TOKENS,
    dtype: torch.dtype = torch.float32,
    layout: str = "page_first",
) -> Any:
    """SGLang's host KV pool (`layout`: page-first unless asked) over a CPU device pool of `device_tokens`
    tokens; random contents from `seed`, zeros without one."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    device = MHATokenToKVPool(
        size=device_tokens, page_size=page, dtype=dtype, head_num=heads, head_dim=dim,
        layer_num=layers, device="cpu", enable_memory_saver=False,
    )  # fmt: skip
    if "buffer_info" in inspect.signature(MHATokenToKVPoolHost.__init__).parameters:  # 0.5.23
        info = device.get_device_pool_infos()[0].buffer_info
        pool = MHATokenToKVPoolHost(
            info, HOST_RATIO, 0, page, layout, pin_memory=False, device="cpu",
            device_capacity_tokens=device_tokens, start_layer=0, end_layer=layers,
        )  # fmt: skip
    else:  # 0.5.17
        pool = MHATokenToKVPoolHost(device, HOST_RATIO, 0, page, layout, pin_memory=False, device="cpu")
    assert pool.layout == layout
    if layout == "page_first":  # [2, tokens, layers, heads, head_dim]: what `page` reads
        assert tuple(pool.kv_buffer.shape[2:]) == (layers, heads, dim)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        pool.kv_buffer.copy_(torch.rand(pool.kv_buffer.shape, generator=gen))
    else:
        pool.kv_buffer.zero_()
    return pool


def page(pool: Any, p: int) -> torch.Tensor:
    """K and V of host page `p` (page-first: `kv_buffer` is [2, tokens, layers, heads, head_dim])."""
    return pool.kv_buffer[:, p * PAGE : (p + 1) * PAGE].clone()


def host_indices(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)], dtype=torch.int64)


def storage_config(extra: dict[str, Any], rank: int = 0) -> Any:
    values = dict(
        tp_rank=rank, tp_size=2 if rank else 1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True, model_name="tiny",
        extra_config=extra,
    )  # fmt: skip
    names = {f.name for f in dataclasses.fields(HiCacheStorageConfig)}
    return HiCacheStorageConfig(**{k: v for k, v in values.items() if k in names})


def extra_config(store: str, model: Path, **more: Any) -> dict[str, Any]:
    return {
        "backend_name": "xavier",
        "module_path": "xavier_sglang.hicache",
        "class_name": "XavierHiCacheStorage",
        "interface_v1": 1,
        "pagestore": store,
        "model_path": str(model),
        **more,
    }


def backend(store: str, model: Path, pool: Any, rank: int = 0, **more: Any) -> Any:
    """Created and attached as SGLang's cache controller does it."""
    made = StorageBackendFactory.create_backend(
        "dynamic", storage_config(extra_config(store, model, **more), rank), pool
    )
    made.register_mem_pool_host(pool)
    return made


def sglang_keys(pages: int, first_token: int = 0) -> list[str]:
    tokens = list(range(first_token, first_token + pages * PAGE))
    keys = get_hash_str(tokens, None, page_size=PAGE)
    assert isinstance(keys, list) and len(keys) == pages
    return keys


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProc]:
    proc = start_store(tmp_path_factory.mktemp("store"), arena=4 << 20, chunk=64 << 10)
    yield proc
    proc.stop()


def test_pool_buffers_follow_sglangs_page_meta() -> None:
    pool = host_pool(None)
    bufs = host_pool_buffers(pool)
    page_bytes = PAGE * LAYERS * HEADS * DIM * 4
    assert [b.bytes_per_page for b in bufs] == [page_bytes, page_bytes]
    assert bufs[0].addr == pool.kv_buffer.data_ptr() and bufs[0].num_pages == pool.size // PAGE >= 64
    assert bufs[1].addr - bufs[0].addr == pool.kv_buffer[0].nbytes  # V one K half further


def test_pages_round_trip_through_the_store(
    store: ServiceProc, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_TRACE, str(tmp_path / "trace"))
    writer_pool, reader_pool = host_pool(seed=1), host_pool(seed=None)
    writer = backend(store.address, tiny_model, writer_pool)
    reader = backend(store.address, tiny_model, reader_pool)
    try:
        assert isinstance(writer, XavierHiCacheStorage) and isinstance(writer, HiCacheStorage)
        keys = sglang_keys(6)
        src, dst = [3, 4, 9, 10, 11, 30], [0, 7, 1, 2, 20, 21]
        assert reader.batch_exists(keys) == 0
        assert writer.batch_set_v1(keys, host_indices(src)) == [True] * 6
        assert reader.batch_exists(keys) == 6
        # Leading hits only: the count stops at the first miss.
        other = sglang_keys(2, first_token=10_000)
        assert reader.batch_exists([*keys[:3], other[0], *keys[3:]]) == 3
        assert reader.batch_exists([other[0], *keys]) == 0
        assert reader.batch_get_v1(keys[:4] + other[:1], host_indices(dst[:5])) == [True] * 4 + [False]
        for s, d in zip(src[:4], dst[:4], strict=True):
            assert torch.equal(page(reader_pool, d), page(writer_pool, s)), f"page {s} -> {d} differs"
        assert reader.get_stats()["hit_pages"] == 4 and reader.errors == 0
        # Each lookup and get left its trace line: what it asked, what it found, when.
        (trace,) = (tmp_path / "trace").glob("hicache-*.jsonl")
        calls = [json.loads(line) for line in trace.read_text().splitlines()]
        assert [(c["op"], c["pages"], c["hit"]) for c in calls] == [
            ("exists", 6, 0), ("exists", 6, 6), ("exists", 7, 3), ("exists", 7, 0), ("get", 5, 4)
        ]  # fmt: skip
        assert all(c["t0"] <= c["t1"] for c in calls)
        # The get's own steps: a same-host read checks each page as it lands (where the page loop is
        # built), else the READ and the checks are steps of their own.
        fused = reader.client is not None and reader.client._checks_while_reading()
        steps = {"read_checked"} if fused else {"read", "verify"}
        assert {"get_pages", "fetch", *steps} <= set(calls[-1]["steps_ms"])
    finally:
        writer.close()
        reader.close()


def test_a_get_after_its_lookup_reads_under_the_lookups_lease(store: ServiceProc, tiny_model: Path) -> None:
    """SGLang looks a batch up (`batch_exists`) and then gets it: the lookup leased the hits, so the get
    makes no GetPages call of its own (and is made on the calling thread where it can be: `fetch_here`),
    and its pages are exact."""
    writer_pool, reader_pool = host_pool(seed=5), host_pool(seed=None)
    writer = backend(store.address, tiny_model, writer_pool)
    reader = backend(store.address, tiny_model, reader_pool)
    try:
        keys = sglang_keys(5, first_token=7000)
        src, dst = [12, 13, 14, 15, 16], [40, 41, 42, 50, 51]
        assert writer.batch_set_v1(keys, host_indices(src)) == [True] * 5
        assert reader.batch_exists(keys) == 5
        assert reader.batch_get_v1(keys, host_indices(dst)) == [True] * 5
        client = reader.client
        assert client is not None
        # Made on this thread where the page loop is built (its counters handed to the client's loop
        # after the get returned), else on the loop: either way under the lookup's lease.
        deadline = time.monotonic() + 30
        while client.counters.leased_lookups_used != 1:
            assert time.monotonic() < deadline, "the get did not read under the lookup's lease"
            time.sleep(0.01)
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(page(reader_pool, d), page(writer_pool, s)), f"page {s} -> {d} differs"
    finally:
        writer.close()
        reader.close()


def test_keys_are_namespaced_by_salt_and_rank(store: ServiceProc, tiny_model: Path) -> None:
    pools = [host_pool(seed=2) for _ in range(3)]
    plain = backend(store.address, tiny_model, pools[0])
    salted = backend(store.address, tiny_model, pools[1], cache_salt="tenant-b")
    rank1 = backend(store.address, tiny_model, pools[2], rank=1)
    try:
        keys = sglang_keys(3, first_token=500)
        assert plain.batch_set_v1(keys, host_indices([0, 1, 2])) == [True] * 3
        assert plain.batch_exists(keys) == 3
        assert salted.batch_exists(keys) == 0  # 0.5.17 does not salt SGLang's chain: the backend does
        assert rank1.batch_exists(keys) == 0
    finally:
        for b in (plain, salted, rank1):
            b.close()


def test_store_down_is_a_miss_and_a_metric(tmp_path: Path, tiny_model: Path) -> None:
    proc = start_store(tmp_path / "store", arena=4 << 20, chunk=64 << 10)
    pool = host_pool(seed=3)
    b = backend(proc.address, tiny_model, pool, rpc_timeout_s=0.5, transfer_timeout_s=1.0)
    try:
        keys = sglang_keys(2, first_token=900)
        assert b.batch_set_v1(keys, host_indices([5, 6])) == [True, True]
        proc.kill()
        assert b.batch_exists(keys) == 0
        assert b.batch_get_v1(keys, host_indices([7, 8])) == [False, False]
        assert b.batch_set_v1(keys, host_indices([5, 6])) == [False, False]
        stats = b.get_stats()
        assert stats["miss_pages"] >= 2 and stats["writes_failed"] >= 1
    finally:
        b.close()


@pytest.mark.parametrize(
    ("change", "option"),
    [
        ({"interface_v1": 0}, "interface_v1"),
        ({"pagestore": ""}, "pagestore"),
        ({"model_path": ""}, "model_path"),
    ],
)
def test_bad_extra_config_is_refused(tiny_model: Path, change: dict[str, Any], option: str) -> None:
    extra = {**extra_config("127.0.0.1:1", tiny_model), **change}
    with pytest.raises(UnsupportedSetupError, match=option) as err:
        XavierHiCacheStorage(storage_config(extra), {})
    assert err.value.option == "--hicache-storage-backend-extra-config"


def test_the_backend_lowers_the_switch_interval_and_never_raises_it(tiny_model: Path) -> None:
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        lower_switch_interval(0.0002)
        assert sys.getswitchinterval() == pytest.approx(0.0002)
        lower_switch_interval(0.001)  # above the current one: left as it is
        assert sys.getswitchinterval() == pytest.approx(0.0002)
        lower_switch_interval(0.0)  # 0: left as it is
        assert sys.getswitchinterval() == pytest.approx(0.0002)
        sys.setswitchinterval(0.005)
        extra = {**extra_config("127.0.0.1:1", tiny_model), "switch_interval_s": -1}
        with pytest.raises(UnsupportedSetupError, match="switch_interval_s"):
            XavierHiCacheStorage(storage_config(extra), {})
        assert sys.getswitchinterval() == pytest.approx(0.005)
    finally:
        sys.setswitchinterval(before)
