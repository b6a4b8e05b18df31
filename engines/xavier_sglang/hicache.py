"""SGLang HiCache storage backed by the Xavier page store (zero-copy, over NIXL).

Load it with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "xavier",
        "module_path": "xavier_sglang.hicache", "class_name": "XavierHiCacheStorage",
        "interface_v1": 1, "pagestore": "HOST:PORT", "model_path": "/models/m", "cache_salt": ""}'

SGLang calls only the zero-copy methods when `"interface_v1": 1` is set (required here):
`batch_exists` (how many leading keys are stored), `batch_get_v1` / `batch_set_v1` between its host pool
and the store. The host pool (`register_mem_pool_host`) is described to the page store client as
`KvBuffer`s derived from SGLang's own `get_page_buffer_meta` (one buffer per pointer of a page: K and V in
the page-first layout, K and V of every layer in layer-first), and registered with NIXL once, so pages
move between the pool and the store's arena without a copy.

Keys: SGLang's per-page SHA-256 chain names a page and its prefix but neither the model nor the rank, and
0.5.17 does not seed it with the salt. Each key is therefore re-hashed with a seed of the contract
fingerprint (model, dtype, page size, host layout) and the configured salt, and the store namespace also
carries fingerprint, salt and tensor-parallel rank.

Failure policy: the store can only make SGLang faster. Every error (store down, slow, restarted, a failed
READ or WRITE, a checksum mismatch) is a miss and is counted (`get_stats()`, and the page store client's
metric `xavier_pagestore_client_errors{op,reason}` in the process's default Prometheus registry), with a
rate-limited log line (`log_interval_s`, default 30); nothing raises into SGLang's cache threads.

Thread hand-offs: a get crosses threads several times (SGLang's prefetch thread, this backend's event
loop, the READ's worker), and each crossing waits for the GIL. SGLang's scheduler thread runs Python
without pause, so at CPython's default switch interval (5 ms) every crossing can cost up to 5 ms (on a
CPU box, a fetch beside a spinning thread took 2-3x as long at 5 ms as at 0.2 ms). The backend lowers
the process's switch interval to `switch_interval_s` (extra config, default 0.2 ms; 0 leaves it as it
is) when that is below the current one: a thread that waits for the GIL then gets it within that
bound, and a thread that holds it alone pays nothing. Fewer crossings help more: `batch_exists` leases
the hits it finds (`exists(lease=True)`), and the `batch_get_v1` of that batch that follows is then made
whole on SGLang's own thread where it can be (`PageStoreClient.fetch_here`: the lookup's answer, the
store's memory read and checked by the page loop), handing only the lease's release and the counters to
the loop afterwards.

Host pages of a get stay under a hold (`quarantine`) until the READ into them has ended, even when the
wait for it gave up first; a READ NIXL refused to cancel (`Fetched.stuck`) keeps its pages out of the pool
until it has ended (`Fetched.released`), for good if nothing can tell that.
"""
# mypy: disable-error-code="misc"

from __future__ import annotations

import hashlib
import logging
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import sglang
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from xavier_core.contract import layout_from_model_dir
from xavier_core.pagestore import ClientSettings, PageNamespace, PageStoreClient, native
from xavier_core.pagestore.client import Fetched, InOrder
from xavier_core.pagestore.metrics import fetch_step_seconds
from xavier_core.prefix_keys import chain_seed
from xavier_core.transfer.common.buffers import KvBuffer
from xavier_core.transfer.common.stuck import on_success

from .config import UnsupportedSetupError
from .loop import LoopThread
from .quarantine import Hold, HostQuarantine
from .trace import storage_call, tracing

__all__ = ["XavierHiCacheStorage", "host_pool_buffers", "lower_switch_interval"]

log = logging.getLogger(__name__)

_OPTION = "--hicache-storage-backend-extra-config"
_WAIT_MARGIN_S = 10.0
_SWITCH_INTERVAL_S = 0.0002
_KEY_MEMO = 1 << 16
"""Store keys kept per backend (SGLang key -> store key; ~10 MB at most)."""


def host_pool_buffers(pool: Any) -> list[KvBuffer]:
    """The host pool as `KvBuffer`s, from its zero-copy metadata of pages 0 and 1 (which must be evenly
    strided per pointer, as SGLang's MHA host pools are in both layouts)."""
    import torch

    page = int(pool.page_size)
    pages = int(pool.size) // page
    if pages < 2:
        raise UnsupportedSetupError(_OPTION, "the host pool holds fewer than two pages")
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(0, 2 * page, dtype=torch.int64))
    per = len(ptrs) // 2
    if per < 1 or len(ptrs) != 2 * per:
        raise UnsupportedSetupError(_OPTION, f"unexpected host pool metadata ({len(ptrs)} pointers)")
    out = []
    for i in range(per):
        stride = int(ptrs[per + i]) - int(ptrs[i])
        if stride != int(sizes[i]):
            raise UnsupportedSetupError(
                "--hicache-mem-layout", f"host pool pointer {i} is not page-contiguous (stride {stride})"
            )
        out.append(KvBuffer(int(ptrs[i]), stride * pages, stride, "cpu"))
    return out


def lower_switch_interval(seconds: float) -> None:
    """Sets the process's GIL switch interval to `seconds` if that is positive and below the current one
    (see the module docstring); never raises it."""
    if seconds < 0:
        raise UnsupportedSetupError(_OPTION, f'"switch_interval_s" must be 0 or more, got {seconds}')
    if 0 < seconds < sys.getswitchinterval():
        log.info("GIL switch interval %.2f ms -> %.2f ms", sys.getswitchinterval() * 1e3, seconds * 1e3)
        sys.setswitchinterval(seconds)


class XavierHiCacheStorage(HiCacheStorage):
    """HiCache's storage tier on the Xavier page store (see the module docstring)."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        if int(extra.get("interface_v1", 0) or 0) != 1:
            raise UnsupportedSetupError(_OPTION, 'the xavier store needs "interface_v1": 1 (zero-copy)')
        self.address = str(extra.get("pagestore") or "")
        if not self.address:
            raise UnsupportedSetupError(_OPTION, 'missing "pagestore": the page store address (host:port)')
        self.model_path = str(extra.get("model_path") or "")
        if not self.model_path:
            raise UnsupportedSetupError(_OPTION, 'missing "model_path": the local model directory')
        if getattr(storage_config, "is_mla_model", False):
            raise UnsupportedSetupError("--model-path", "MLA KV is not described by the Xavier contract")
        self.salt = str(extra.get("cache_salt") or "")
        self.rank = int(getattr(storage_config, "tp_rank", 0) or 0)
        self.settings = ClientSettings(
            rpc_timeout_s=float(extra.get("rpc_timeout_s", 1.0)),
            transfer_timeout_s=float(extra.get("transfer_timeout_s", 5.0)),
            log_interval_s=float(extra.get("log_interval_s", 30.0)),
        )
        lower_switch_interval(float(extra.get("switch_interval_s", _SWITCH_INTERVAL_S)))
        self._wait_s = self.settings.rpc_timeout_s * 4 + self.settings.transfer_timeout_s + _WAIT_MARGIN_S
        self._lock = threading.Lock()
        self.errors = 0
        self.client: PageStoreClient | None = None
        self.namespace: PageNamespace | None = None
        self.quarantine: HostQuarantine | None = None
        self._seed = b""
        self._key_memo: dict[str, bytes] = {}
        self._page_size = 1
        self._loop = LoopThread("xavier-hicache")

    # --- set-up ---------------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        buffers = host_pool_buffers(mem_pool_host)
        dtype = str(mem_pool_host.dtype).removeprefix("torch.")
        layout = layout_from_model_dir(
            Path(self.model_path),
            engine="sglang",
            engine_version=sglang.__version__,
            dtype=dtype,
            page_size=int(mem_pool_host.page_size),
            memory_layout=f"sglang_host_{mem_pool_host.layout}",
        )
        self._page_size = int(mem_pool_host.page_size)
        self.quarantine = HostQuarantine(mem_pool_host)
        self.namespace = PageNamespace(layout.fingerprint, self.salt, self.rank)
        self._seed = chain_seed(layout.fingerprint, self.salt)
        self._key_memo.clear()

        async def make() -> PageStoreClient:
            return PageStoreClient(self.address, buffers, self.settings)

        self.client = self._loop.run(make(), self._wait_s)

    def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            try:
                self._loop.run(client.close(), self._wait_s)
            except Exception as exc:
                log.warning("closing the page store client failed: %s", exc)
        self._loop.stop()

    # --- zero-copy interface (interface_v1) -------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        client, ns = self.client, self.namespace
        if client is None or ns is None or not keys:
            return 0
        start = time.time()
        try:
            # Leased: SGLang gets these batches next, and the get then READs under this lookup's lease.
            found = int(self._loop.run(client.exists(ns, self._store_keys(keys), lease=True), self._wait_s))
        except Exception as exc:
            self._error("exists", exc)
            found = 0
        storage_call("exists", len(keys), start, found)
        return found

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        client, ns, guard = self.client, self.namespace, self.quarantine
        if client is None or ns is None or guard is None:
            return [False] * len(keys)
        try:
            pages = self._pages(host_indices, len(keys))
        except ValueError as exc:
            self._error("get", exc)
            return [False] * len(keys)
        start = time.time()
        before = fetch_step_seconds() if tracing() else None
        direct_before = client.counters.direct_reads
        allocate = InOrder(pages)
        store_keys = self._store_keys(keys)
        try:
            # On this thread where the batch's lookup leased it: its read ends before this returns, so
            # no page needs a hold.
            here = client.fetch_here(ns, store_keys, allocate)
        except Exception as exc:
            self._error("get", exc)
            here = Fetched(0, False)
        if here is not None:
            hit = here.hit
        else:
            # On the client's loop. SGLang frees the pages it is told are missing and lends them again:
            # they stay held until the fetch has ended (not when the wait below gives up), and while a
            # stuck READ may still write.
            tokens = self._tokens(host_indices, len(keys))
            hold = guard.hold(tokens)
            future = self._loop.submit(client.fetch(ns, store_keys, allocate))
            future.add_done_callback(lambda f: self._settle(f, hold, tokens, allocate))
            try:
                hit = future.result(self._wait_s).hit
            except Exception as exc:
                self._error("get", exc)
                hit = 0
        steps = None
        if (
            before is not None
        ):  # SGLang's prefetch thread gets one call at a time: the difference is this one's
            steps = {
                k: v - before.get(k, 0.0) for k, v in fetch_step_seconds().items() if v > before.get(k, 0.0)
            }
        storage_call(
            "get",
            len(keys),
            start,
            hit,
            steps,
            # fetch_here's read is counted on the client's loop, after this call
            direct_reads=int(hit > 0) if here is not None else client.counters.direct_reads - direct_before,
            native_checks=native.available(),
        )
        return [True] * hit + [False] * (len(keys) - hit)

    def _settle(self, future: Future[Fetched], hold: Hold, tokens: list[int], allocate: InOrder) -> None:
        """Lifts a get's hold once its fetch ended; a stuck READ's pages past the hit are kept."""
        guard = self.quarantine
        if guard is None:
            return
        got = None if future.cancelled() or future.exception() is not None else future.result()
        if got is None or not got.stuck:
            guard.lift(hold)
            return
        keep = tokens[got.hit * self._page_size : allocate.handed * self._page_size]
        guard.lift(hold, keep)
        if got.released is None:
            log.error("page store: %d host pages lost to a stuck READ", len(keep) // self._page_size)
            return
        log.error(
            "page store: %d host pages out of use until a stuck READ ends", len(keep) // self._page_size
        )

        # This runs on whichever thread saw the fetch end: the future's callbacks are its loop's to add.
        released = got.released
        released.get_loop().call_soon_threadsafe(on_success, released, lambda: guard.restore(keep))

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        client, ns = self.client, self.namespace
        if client is None or ns is None:
            return [False] * len(keys)
        try:
            pages = self._pages(host_indices, len(keys))
            failed_before = client.counters.writes_failed
            self._loop.run(client.write(ns, self._store_keys(keys), pages), self._wait_s)
            ok = client.counters.writes_failed == failed_before
        except Exception as exc:
            self._error("set", exc)
            ok = False
        return [ok] * len(keys)

    # --- the key-value interface: unused with interface_v1, answered as misses --------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return None

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        return [None] * len(keys)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return False

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        return False

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def clear(self) -> None:
        """The store is shared by every replica of the fleet: nothing is dropped from here."""

    def get_stats(self) -> Any:
        client = self.client
        counters = client.counters if client is not None else None
        return {
            "errors": self.errors,
            "lost_host_pages": (self.quarantine.lost_tokens // self._page_size) if self.quarantine else 0,
            "hit_pages": getattr(counters, "hit_pages", 0),
            "miss_pages": getattr(counters, "miss_pages", 0),
            "pages_written": getattr(counters, "pages_written", 0),
            "writes_failed": getattr(counters, "writes_failed", 0),
        }

    # --- helpers -----------------------------------------------------------------------------------------

    def _store_keys(self, keys: list[str]) -> list[bytes]:
        """SGLang's hex keys re-hashed with the namespace seed (fingerprint + salt). SGLang asks a batch's
        keys twice (a lookup, then a get): the last `_KEY_MEMO` are kept."""
        memo, seed = self._key_memo, self._seed
        out = []
        for k in keys:
            got = memo.get(k)
            if got is None:
                if len(memo) >= _KEY_MEMO:
                    memo.clear()
                got = memo[k] = hashlib.sha256(seed + bytes.fromhex(k)).digest()
            out.append(got)
        return out

    def _tokens(self, host_indices: Any, count: int) -> list[int]:
        """The host token indices of `count` pages (one page per key)."""
        self._check_count(host_indices, count)
        return host_indices.tolist() if hasattr(host_indices, "tolist") else [int(i) for i in host_indices]

    def _pages(self, host_indices: Any, count: int) -> list[int]:
        """Host page ids of a page-aligned token index list (one page per key): each page's first index
        over the page size."""
        page = self._page_size
        self._check_count(host_indices, count)
        firsts = host_indices[::page]
        return [int(i) // page for i in (firsts.tolist() if hasattr(firsts, "tolist") else firsts)]

    def _check_count(self, host_indices: Any, count: int) -> None:
        n, page = len(host_indices), self._page_size
        if n != count * page:
            raise ValueError(f"{n} host indices for {count} pages of {page} tokens")

    def _error(self, op: str, exc: BaseException) -> None:
        """A call given up on (its wait timed out, or bad host indices): a miss, counted and logged as
        the client counts and logs its own (`PageStoreClient.failed`)."""
        with self._lock:
            self.errors += 1
        client = self.client
        if client is not None:
            client.failed(op, exc)
        else:
            log.warning("xavier page store %s failed (a miss): %s: %s", op, type(exc).__name__, exc)
