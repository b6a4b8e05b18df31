"""GPU-to-GPU KV page copy: one fused Triton kernel moves scattered pages of every buffer at once.

Per-descriptor transports (NIXL, cudaMemcpy per page) pay a fixed cost per page per buffer, so scattered
pages fall to a few GB/s. Here one launch copies every (page pair, buffer) as its own program straight
from the source pool to the destination pool: no staging buffer, vector loads and stores (16 bytes
where Triton can prove the alignment), and the source may be this device, a peer device (peer access)
or another process's pool (CUDA IPC, see `cuda.ipc`). Without Triton a torch path gathers, copies and
scatters per buffer (slower, same bytes).

The copy runs on a side stream and returns a `CopyHandle` at once. Invariant I1 on the GPU: neither the
source nor the destination pages may be reused until `is_done()` is true; `wait_on(stream)` orders later
GPU work after the copy without blocking the host. torch and Triton are imported on first use.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from xavier_core.transfer.common.errors import LayoutError
from xavier_core.transfer.cuda._driver import enable_peer_access
from xavier_core.transfer.cuda.copy_plan import CopyPlan, PoolView, check_layout, check_pages, plan_copy

if TYPE_CHECKING:
    import torch

_streams: dict[int, torch.cuda.Stream] = {}
_anchors: dict[int, torch.Tensor] = {}
_peers_enabled: set[tuple[int, int]] = set()
_lock = threading.Lock()


class CopyHandle:
    """One issued copy: a CUDA event recorded after its last launch on the copy stream."""

    def __init__(self, event: torch.cuda.Event, nbytes: int, pages: int, launches: int, engine: str) -> None:
        self.event = event
        self.nbytes = nbytes
        self.pages = pages
        self.launches = launches
        self.engine = engine  # "triton" or "torch"

    def is_done(self) -> bool:
        """True once the GPU has finished: the source and destination pages may be reused (I1)."""
        return bool(self.event.query())  # type: ignore[no-untyped-call]

    def wait(self, timeout_s: float | None = None) -> None:
        """Blocks this thread until the copy has finished (tests, shutdown; not an engine loop)."""
        if timeout_s is None:
            self.event.synchronize()
            return
        deadline = time.monotonic() + timeout_s
        while not self.event.query():  # type: ignore[no-untyped-call]
            if time.monotonic() > deadline:
                raise TimeoutError(f"page copy not finished after {timeout_s} s")
            time.sleep(50e-6)

    def wait_on(self, stream: torch.cuda.Stream) -> None:
        """Makes later work on `stream` wait for the copy, on the GPU (the host does not block)."""
        stream.wait_event(self.event)


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def copy_stream(device: int) -> torch.cuda.Stream:
    """The side stream page copies on `device` run on (one per device, made on first use)."""
    import torch

    with _lock:
        if device not in _streams:
            _streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return _streams[device]


def _anchor(device: int) -> torch.Tensor:
    import torch

    with _lock:
        if device not in _anchors:
            _anchors[device] = torch.zeros(2, dtype=torch.int64, device=f"cuda:{device}")
        return _anchors[device]


def copy_pages(
    src: PoolView,
    dst: PoolView,
    src_pages: Sequence[int] | np.ndarray[Any, Any],
    dst_pages: Sequence[int] | np.ndarray[Any, Any],
    *,
    device: int | None = None,
    after: Sequence[torch.cuda.Stream] = (),
    engine: Literal["auto", "triton", "torch"] = "auto",
    max_pages_per_launch: int | None = None,
    num_warps: int | None = None,
) -> CopyHandle:
    """Copies page `src_pages[i]` of `src` to page `dst_pages[i]` of `dst`, in every buffer.

    Runs on `device` (default: the destination's, a pull) on its copy stream, after the work already
    queued on that device's current stream and on each stream in `after` (so pages written or still
    read there are ordered before the copy). `engine`: "triton", "torch" or "auto" (Triton if
    importable). `max_pages_per_launch` splits a very large copy into several launches.
    """
    if engine == "auto":
        engine = "triton" if triton_available() else "torch"
    # The torch path ends on the destination device, so its event must be recorded there.
    run_on = dst.device if device is None or engine == "torch" else device
    for pool in (src, dst):
        if pool.imported and engine == "torch":
            raise LayoutError("an IPC-imported pool needs the Triton copy: torch cannot address it")
        if pool.imported and pool.device != run_on:
            raise LayoutError(f"an IPC-imported pool is mapped on cuda:{pool.device}, not cuda:{run_on}")
    import torch

    for owner in (src.device, dst.device):
        if (run_on, owner) not in _peers_enabled:
            enable_peer_access(run_on, owner)
            _peers_enabled.add((run_on, owner))
    stream = copy_stream(run_on)
    stream.wait_stream(torch.cuda.current_stream(run_on))
    for s in after:
        stream.wait_stream(s)
    with torch.cuda.device(run_on), torch.cuda.stream(stream):
        if engine == "triton":
            plans = plan_copy(src, dst, src_pages, dst_pages, _anchor(run_on).data_ptr())
            if max_pages_per_launch is not None:
                plans = [part for p in plans for part in p.split(max_pages_per_launch)]
            for plan in plans:
                _launch(plan, run_on, num_warps)
            nbytes, launches = sum(p.nbytes for p in plans), len(plans)
        elif engine == "torch":
            nbytes, launches = _torch_copy(src, dst, src_pages, dst_pages)
        else:
            raise ValueError(f"unknown copy engine {engine!r}")
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
    return CopyHandle(event, nbytes, len(src_pages), launches, engine)


def _launch(plan: CopyPlan, device: int, num_warps: int | None) -> None:
    import torch

    # One host-to-device copy for all index arrays; allocated on the copy stream, so the caching
    # allocator reuses the memory only after work queued on that stream (this kernel) has run. From
    # pinned memory (torch's caching host allocator, which keeps the block until the copy is done): a copy
    # from pageable memory first waits, on the host, for everything queued on the stream before it.
    packed = np.concatenate((plan.src_off, plan.dst_off, plan.src_pages, plan.dst_pages))
    args = torch.from_numpy(packed).pin_memory().to(f"cuda:{device}", non_blocking=True)
    nb, n = plan.src_off.size, plan.src_pages.size
    block_bytes = plan.block * plan.elem_bytes
    warps = num_warps or (2 if block_bytes <= 2048 else 4 if block_bytes <= 8192 else 8)
    kernel = _kernel()
    anchor = _anchor(device).view(_elem_dtype(plan.elem_bytes))
    kernel[(plan.grid,)](
        anchor,
        args[:nb],
        args[nb : 2 * nb],
        args[2 * nb : 2 * nb + n],
        args[2 * nb + n :],
        n,
        plan.page_elems,
        CHUNKS=plan.chunks,
        BLOCK=plan.block,
        ALIGN=plan.align,
        EVEN=plan.even,
        num_warps=warps,
    )


def _elem_dtype(elem_bytes: int) -> torch.dtype:
    import torch

    return {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[elem_bytes]


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator,misc,unused-ignore]
    def _copy_pages_kernel(  # type: ignore[no-untyped-def]
        anchor,
        src_off,
        dst_off,
        src_pages,
        dst_pages,
        n_pairs,
        page_elems,
        CHUNKS: tl.constexpr,
        BLOCK: tl.constexpr,
        ALIGN: tl.constexpr,
        EVEN: tl.constexpr,
    ):
        # Program id -> (buffer, page pair, chunk of the page): consecutive programs read consecutive
        # chunks and page pairs of one buffer, so contiguous runs stream like one bulk copy.
        pid = tl.program_id(0).to(tl.int64)
        chunk = pid % CHUNKS
        pair = (pid // CHUNKS) % n_pairs
        buf = pid // CHUNKS // n_pairs
        start = chunk * BLOCK
        s = tl.load(src_off + buf) + tl.load(src_pages + pair) * page_elems + start
        d = tl.load(dst_off + buf) + tl.load(dst_pages + pair) * page_elems + start
        s = tl.multiple_of(s, ALIGN)
        d = tl.multiple_of(d, ALIGN)
        offs = tl.arange(0, BLOCK)
        if EVEN:
            v = tl.load(anchor + s + offs, cache_modifier=".cg")
            tl.store(anchor + d + offs, v, cache_modifier=".cs")
        else:
            mask = start + offs < page_elems
            v = tl.load(anchor + s + offs, mask=mask, cache_modifier=".cg")
            tl.store(anchor + d + offs, v, mask=mask, cache_modifier=".cs")

    return _copy_pages_kernel


class CudaBytes:
    """A raw device range as a torch tensor, through the CUDA array interface."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


def _torch_copy(src: PoolView, dst: PoolView, src_pages: object, dst_pages: object) -> tuple[int, int]:
    """Fallback: per buffer, gather on the source device, one copy, scatter on the destination."""
    import torch

    check_layout(src, dst)
    s, d = check_pages(src, dst, src_pages, dst_pages)
    if s.size == 0:
        return 0, 0
    s_idx = torch.from_numpy(s).to(f"cuda:{src.device}")
    d_idx = torch.from_numpy(d).to(f"cuda:{dst.device}")
    for sb, db, bpp in zip(src.bases, dst.bases, src.bytes_per_page, strict=True):
        src_t = torch.as_tensor(CudaBytes(sb, src.num_pages * bpp)).view(-1, bpp)
        dst_t = torch.as_tensor(CudaBytes(db, dst.num_pages * bpp)).view(-1, bpp)
        staged = src_t.index_select(0, s_idx).to(dst_t.device, non_blocking=True)
        dst_t.index_copy_(0, d_idx, staged)
    return int(s.size) * sum(src.bytes_per_page), 2 * len(src.bases) + 1
