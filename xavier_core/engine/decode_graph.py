"""Decode-only steps with static shapes, replayed from CUDA graphs.

A decode step is one query per request against that request's pages. Its tensors are made static by
padding the batch to a power-of-two row bucket and each request's page list to a power-of-two page bucket;
one `CausalLM.decode_static` run per (rows, pages) bucket is captured in a CUDA graph the first time the
bucket is seen, and later steps copy their inputs into the graph's buffers and replay it. A replay costs
one launch instead of hundreds of kernel launches from Python, which is what bounds small-batch decode.

Padding rows repeat the first row (same token, position, slot and pages), so the K/V they write are the
first row's own, written to the same slot: padding never touches another request's pages.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from xavier_core.engine.api import InvalidRequestError
from xavier_core.engine.kv_pool import KvPool
from xavier_core.engine.model import CausalLM, DecodeInputs
from xavier_core.engine.request import Request, pages_for

_MIN_PAGES = 4


def bucket(n: int, floor: int = 1) -> int:
    """The smallest power of two that is at least `n` and at least `floor`."""
    size = floor
    while size < n:
        size *= 2
    return size


@dataclass
class _Slot:
    """The static buffers of one (rows, pages) bucket and, once captured, its graph."""

    host: torch.Tensor  # [rows * (4 + pages)] int64 on the CPU, filled each step
    device: torch.Tensor  # the same layout on the model's device; the graph reads it
    inputs: DecodeInputs  # views into `device`
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # the graph's output buffer


def _slot(rows: int, pages: int, device: torch.device) -> _Slot:
    host = torch.zeros(rows * (4 + pages), dtype=torch.long)
    dev = host.to(device)
    inputs = DecodeInputs(
        input_ids=dev[:rows],
        positions=dev[rows : 2 * rows],
        out_slots=dev[2 * rows : 3 * rows],
        seq_lens=dev[3 * rows : 4 * rows],
        page_table=dev[4 * rows :].view(rows, pages),
    )
    return _Slot(host, dev, inputs)


class DecodeRunner:
    """Runs decode-only steps through `decode_static`, with CUDA graphs when `use_graphs` (CUDA only)."""

    def __init__(self, model: CausalLM, pool: KvPool, use_graphs: bool) -> None:
        if use_graphs and pool.device.type != "cuda":
            raise InvalidRequestError(f"CUDA graphs need a CUDA device, not {pool.device}")
        self.model = model
        self.pool = pool
        self.use_graphs = use_graphs
        self.graphs_captured = 0
        self.steps = 0
        self.max_pages = pool.num_pages
        self._slots: dict[tuple[int, int], _Slot] = {}
        self._mempool = torch.cuda.graph_pool_handle() if use_graphs else None
        # Held while a graph is captured. Other threads that issue CUDA work on this device (KV transfers,
        # page reads) take it too: work on the legacy default stream during a capture invalidates it.
        self.capture_lock = threading.Lock()

    @staticmethod
    def accepts(items: Sequence[tuple[Request, int]]) -> bool:
        """Whether a step is decode-only: every request computes its one last token and samples."""
        return bool(items) and all(n == 1 and req.remaining == 1 for req, n in items)

    def run(self, reqs: Sequence[Request]) -> torch.Tensor:
        """Float32 logits `[len(reqs), vocab]` of one decode step (writes each request's new K/V)."""
        ps = self.pool.page_size
        rows = bucket(len(reqs))
        pages = min(bucket(max(pages_for(r.num_computed + 1, ps) for r in reqs), _MIN_PAGES), self.max_pages)
        slot = self._slots.get((rows, pages))
        if slot is None:
            slot = self._slots[(rows, pages)] = _slot(rows, pages, self.pool.device)
        self._fill(slot.host, reqs, rows, pages)
        slot.device.copy_(slot.host)
        self.steps += 1
        if not self.use_graphs:
            return self.model.decode_static(slot.inputs, self.pool)[: len(reqs)]
        if slot.graph is None or slot.logits is None:
            slot.graph, slot.logits = self._capture(slot.inputs)
        slot.graph.replay()
        return slot.logits[: len(reqs)]

    def capture_all(self, max_rows: int, max_pages: int) -> int:
        """Captures every (rows, pages) bucket up to the limits now; returns how many were captured.

        Services call it at start, before a KV transfer agent exists: a capture must not overlap device
        work of other threads or libraries (UCX's CUDA IPC copies invalidate it), and capturing up front
        also keeps the first requests of each size from paying for it.
        """
        if not self.use_graphs:
            return 0
        with torch.cuda.device(self.pool.device):
            return self._capture_all(max_rows, max_pages)

    def _capture_all(self, max_rows: int, max_pages: int) -> int:
        before = self.graphs_captured
        row_buckets = [1 << i for i in range(bucket(max_rows).bit_length())]
        top_pages = min(bucket(max_pages, _MIN_PAGES), self.max_pages)
        page_buckets = [p for p in (_MIN_PAGES << i for i in range(32)) if p < top_pages] + [top_pages]
        for rows in row_buckets:
            for pages in page_buckets:
                slot = self._slots.get((rows, pages))
                if slot is None:
                    slot = self._slots[(rows, pages)] = _slot(rows, pages, self.pool.device)
                if slot.graph is None:
                    # One key per row at slot 0 of page 0 (no request owns pages yet); replays overwrite it.
                    slot.host.zero_()
                    slot.host[3 * rows : 4 * rows] = 1
                    slot.device.copy_(slot.host)
                    slot.graph, slot.logits = self._capture(slot.inputs)
        torch.cuda.synchronize(self.pool.device)
        return self.graphs_captured - before

    def _fill(self, host: torch.Tensor, reqs: Sequence[Request], rows: int, pages: int) -> None:
        ps = self.pool.page_size
        ids, positions, slots, lens, table = [], [], [], [], []
        for req in reqs:
            pos = req.num_computed
            ids.append(req.tokens[pos])
            positions.append(pos)
            slots.append(req.pages[pos // ps] * ps + pos % ps)
            lens.append(pos + 1)
            used = req.pages[: pages_for(pos + 1, ps)]
            table += used
            table += [used[-1]] * (pages - len(used))  # masked: any valid page will do
        pad = rows - len(reqs)
        ids += ids[:1] * pad
        positions += positions[:1] * pad
        slots += slots[:1] * pad
        lens += lens[:1] * pad
        table += table[:pages] * pad
        host.copy_(torch.tensor(ids + positions + slots + lens + table, dtype=torch.long))

    def _capture(self, inputs: DecodeInputs) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # The graph is captured on the current device's stream: make it the pool's (cuda:1 is not the
        # default device of a new thread).
        with torch.cuda.device(self.pool.device):
            return self._capture_on_device(inputs)

    def _capture_on_device(self, inputs: DecodeInputs) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # The warm-up runs compute this very step, so the K/V they write are the ones the replay writes.
        stream = torch.cuda.Stream(self.pool.device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(self.pool.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.model.decode_static(inputs, self.pool)
        torch.cuda.current_stream(self.pool.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads' CUDA calls are allowed; capture_lock keeps their device work out.
        with (
            self.capture_lock,
            torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"),
        ):
            logits = self.model.decode_static(inputs, self.pool)
        self.graphs_captured += 1
        return graph, logits
