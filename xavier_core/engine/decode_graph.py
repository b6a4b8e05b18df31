"""Decode steps and short prefill chunks with static shapes, replayed from CUDA graphs.

A decode step is one query per request against that request's pages. Its tensors are made static by
padding the batch to a power-of-two row bucket and each request's page list to a power-of-two page bucket;
one `CausalLM.decode_static` run per (rows, pages) bucket is captured in a CUDA graph the first time the
bucket is seen, and later steps copy their inputs into the graph's buffers and replay it. A replay costs
one launch instead of hundreds of kernel launches from Python, which is what bounds small-batch decode,
and a short prefill chunk after cached keys just as much (a prefix hit's suffix).

Such a chunk of n tokens runs as n rows of the same batch: row i is position start + i with the request's
page table, writes slot start + i and sees start + i + 1 keys. `CausalLM._layers` writes every row's K/V
of a layer before any row of that layer attends, so row i sees the chunk's earlier keys as the causal
prefill would: the same attention over the same pages (`DecodeRunner.accepts` says which steps qualify).
A step that is one request's chunk alone (a prefix hit's suffix on an idle engine) has its own buckets
whose rows share one page table: the request's K/V are gathered once per layer, not once per row, so a
long prefix is no reason to leave the graph.

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
CHUNK_GATHER_BYTES = 64 << 20
"""Default bound on the K/V bytes per layer that a prefill chunk's rows gather (rows x their page bucket's
keys x a key's K and V bytes). In a step with other requests' rows every row of a chunk gathers the
request's keys again, so a long prefix multiplies the gather by the chunk's rows: a 16-token suffix after
8,000 keys of a 7B-width model gathers 268 MB per layer as rows, 16.8 MB at the 0.5B shape after 2,000.
Past the bound the general forward, which gathers the keys once per chunk and attends with the flash
kernel, is cheaper than the launches a graph saves. A chunk alone in its step gathers once (16.8 MB for
that 7B suffix)."""


def bucket(n: int, floor: int = 1) -> int:
    """The smallest power of two that is at least `n` and at least `floor`."""
    size = floor
    while size < n:
        size *= 2
    return size


Key = tuple[int, int, bool]
"""A bucket: (rows, pages, whether every row shares one page table: one request's chunk alone)."""


@dataclass
class _Slot:
    """The static buffers of one bucket and, once captured, its graph."""

    host: torch.Tensor  # [rows * 5 + tables * pages] int64 on the CPU, filled each step
    device: torch.Tensor  # the same layout on the model's device; the graph reads it
    inputs: DecodeInputs  # views into `device`
    sample: torch.Tensor  # [rows] view into `device` after the inputs: the rows that sample, then zeros
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # the graph's output buffer


def _slot(key: Key, device: torch.device) -> _Slot:
    rows, pages, shared = key
    tables = 1 if shared else rows
    host = torch.zeros(rows * 5 + tables * pages, dtype=torch.long)
    dev = host.to(device)
    table = 4 * rows + tables * pages
    inputs = DecodeInputs(
        input_ids=dev[:rows],
        positions=dev[rows : 2 * rows],
        out_slots=dev[2 * rows : 3 * rows],
        seq_lens=dev[3 * rows : 4 * rows],
        page_table=dev[4 * rows : table].view(tables, pages),
        # One request's chunk samples at most once, at its last row: only that row's logits are made
        # (and kept by the graph), not a [rows, vocab] buffer per captured bucket.
        out_rows=dev[table : table + 1] if shared else None,
    )
    return _Slot(host, dev, inputs, dev[table:])


class DecodeRunner:
    """Runs steps through `decode_static`, with CUDA graphs when `use_graphs` (CUDA only).

    `max_rows` (the engine's running limit) sets the largest row bucket, the one `capture_all` captures up
    to; with `chunks` off only decode-only steps are taken, and a step with a chunk only while its rows
    gather at most `chunk_gather_bytes` of K/V per layer (`CHUNK_GATHER_BYTES`). A chunk alone in its
    step takes the shared-table buckets, which gather its keys once. `compiled` (a torch.compile backend,
    "inductor" on CUDA) runs each layer as `CausalLM.compiled_layer`'s: the same math in fewer, fused
    kernels.
    """

    def __init__(
        self,
        model: CausalLM,
        pool: KvPool,
        use_graphs: bool,
        max_rows: int,
        chunks: bool = True,
        chunk_gather_bytes: int = CHUNK_GATHER_BYTES,
        compiled: str = "",
    ) -> None:
        if use_graphs and pool.device.type != "cuda":
            raise InvalidRequestError(f"CUDA graphs need a CUDA device, not {pool.device}")
        if max_rows < 1:
            raise InvalidRequestError(f"max_rows must be >= 1, got {max_rows}")
        self.model = model
        self.pool = pool
        self.use_graphs = use_graphs
        # torch.compile's layer: compiled at the first step of each kind of bucket (the warm-up runs before
        # a capture), then captured like the eager one.
        self._layer = model.compiled_layer(compiled) if compiled else None
        self.chunks = chunks
        self.chunk_gather_bytes = chunk_gather_bytes
        k = pool.k[0]
        self._key_bytes = 2 * k[0].numel() * k.element_size()  # one key's K and V in one layer
        self.graphs_captured = 0
        self.steps = 0
        self.prefill_chunks = 0  # prefill chunks run as rows of a step (see `accepts`)
        self.shared_steps = 0  # of them, chunks alone in their step: K/V gathered once (shared table)
        self.max_rows = bucket(max_rows)
        self.max_pages = pool.num_pages
        self._slots: dict[Key, _Slot] = {}
        self._mempool = torch.cuda.graph_pool_handle() if use_graphs else None
        # Held while a graph is captured. Other threads that issue CUDA work on this device (KV transfers,
        # page reads) take it too: work on the legacy default stream during a capture invalidates it.
        self.capture_lock = threading.Lock()

    def accepts(self, items: Sequence[tuple[Request, int]]) -> bool:
        """Whether a step runs here, one row per token it computes, instead of the general forward.

        Each item is a decode row (one token, the request's last before it samples) or, with `chunks`
        on, a prefill chunk whose keys start before its queries (`num_computed > 0`: a prefix hit's
        suffix, a chunk after the first); a first chunk is a cold prompt, which the general forward
        runs. No item may want more logits than its last row's: a request that asks for its prompt's
        logprobs in this chunk keeps the general forward. The step's rows (its tokens) fit the largest
        row bucket, `max_rows`; every row's pages fit the largest page bucket (the pool). With graphs, a
        step that holds a chunk takes only a bucket already captured (`capture_all`, or an earlier
        decode step): a chunk never starts a capture, which must not overlap transfers. A step of one
        chunk alone gathers its keys once (a shared-table bucket), others once per row: either must
        gather at most `chunk_gather_bytes` per layer.
        """
        if not items or sum(n for _, n in items) > self.max_rows:
            return False
        ps = self.pool.page_size
        has_chunk = False
        for req, n in items:
            if (
                req.prompt_positions(req.num_computed, n)
                or pages_for(req.num_computed + n, ps) > self.max_pages
            ):
                return False
            if _decode_row(req, n):
                continue
            if not self.chunks or req.num_computed == 0:
                return False
            has_chunk = True
        if not has_chunk:
            return True
        key = self._bucket(items)
        if self.gather_bytes(key) > self.chunk_gather_bytes:
            return False
        if not self.use_graphs:
            return True
        slot = self._slots.get(key)
        return slot is not None and slot.graph is not None

    def gather_bytes(self, key: Key) -> int:
        """K/V bytes per layer that the rows of a bucket gather: each row its page bucket, or once for all
        with a shared table."""
        rows, pages, shared = key
        return (1 if shared else rows) * pages * self.pool.page_size * self._key_bytes

    def run(self, items: Sequence[tuple[Request, int]]) -> torch.Tensor:
        """Float32 logits of one step that `accepts` took (writes every row's K/V): one row per item that
        samples (its chunk's last row; every decode row), in the items' order."""
        rows = _rows(items)
        key = self._bucket(items)
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = _slot(key, self.pool.device)
        sampling: list[int] = []
        offset = 0
        for req, n in items:
            offset += n
            if req.num_computed + n == len(req.tokens):
                sampling.append(offset - 1)
        # The sampling rows travel with the inputs: an index copied after the replay would wait for it.
        self._fill(slot.host, rows, sampling, key)
        slot.device.copy_(slot.host)
        self.steps += 1
        self.prefill_chunks += sum(not _decode_row(req, n) for req, n in items)
        self.shared_steps += key[2]
        if not self.use_graphs:
            logits = self._static(slot.inputs)
        else:
            if slot.graph is None or slot.logits is None:
                slot.graph, slot.logits = self._capture(slot.inputs)
            slot.graph.replay()
            logits = slot.logits
        if key[2] or sampling == list(range(len(sampling))):  # the sampling rows' already, in order
            return logits[: len(sampling)]
        return logits.index_select(0, slot.sample[: len(sampling)])

    def _bucket(self, items: Sequence[tuple[Request, int]]) -> Key:
        """The bucket of a step: its rows and pages padded, and whether it is one chunk alone of more than
        one row (a single row has a single table either way)."""
        ps = self.pool.page_size
        rows = bucket(sum(n for _, n in items))
        pages = bucket(max(pages_for(req.num_computed + n, ps) for req, n in items), _MIN_PAGES)
        shared = len(items) == 1 and rows > 1 and not _decode_row(*items[0])
        return rows, min(pages, self.max_pages), shared

    def capture_all(self, max_pages: int) -> int:
        """Captures every (rows, pages) bucket up to `max_rows` and `max_pages` now; returns how many were
        captured.

        Services call it at start, before a KV transfer agent exists: a capture must not overlap device
        work of other threads or libraries (UCX's CUDA IPC copies invalidate it), and capturing up front
        also keeps the first requests of each size from paying for it.
        """
        if not self.use_graphs:
            return 0
        with torch.cuda.device(self.pool.device):
            return self._capture_all(max_pages)

    def _capture_all(self, max_pages: int) -> int:
        before = self.graphs_captured
        row_buckets = [1 << i for i in range(self.max_rows.bit_length())]
        top_pages = min(bucket(max_pages, _MIN_PAGES), self.max_pages)
        page_buckets = [p for p in (_MIN_PAGES << i for i in range(32)) if p < top_pages] + [top_pages]
        keys = [(rows, pages, False) for rows in row_buckets for pages in page_buckets]
        if self.chunks:
            keys += [(rows, pages, True) for rows in row_buckets[1:] for pages in page_buckets]
        for key in keys:
            rows = key[0]
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = _slot(key, self.pool.device)
            if slot.graph is None:
                # One key per row at slot 0 of page 0 (no request owns pages yet); replays overwrite it.
                slot.host.zero_()
                slot.host[3 * rows : 4 * rows] = 1
                slot.device.copy_(slot.host)
                slot.graph, slot.logits = self._capture(slot.inputs)
        torch.cuda.synchronize(self.pool.device)
        return self.graphs_captured - before

    def _fill(
        self, host: torch.Tensor, rows: Sequence[tuple[Request, int]], sampling: list[int], key: Key
    ) -> None:
        size, pages, shared = key
        ps = self.pool.page_size
        ids, positions, slots, lens, table = [], [], [], [], []
        for req, pos in rows[-1:] if shared else rows:  # a shared table: the last row's covers them all
            used = req.pages[: pages_for(pos + 1, ps)]
            table += used
            table += [used[-1]] * (pages - len(used))  # masked: any valid page will do
        for req, pos in rows:
            ids.append(req.tokens[pos])
            positions.append(pos)
            slots.append(req.pages[pos // ps] * ps + pos % ps)
            lens.append(pos + 1)
        pad = size - len(rows)
        ids += ids[:1] * pad
        positions += positions[:1] * pad
        slots += slots[:1] * pad
        lens += lens[:1] * pad
        if not shared:
            table += table[:pages] * pad
        sample = sampling + [0] * (size - len(sampling))
        host.copy_(torch.tensor(ids + positions + slots + lens + table + sample, dtype=torch.long))

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
                self._static(inputs)
        torch.cuda.current_stream(self.pool.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads' CUDA calls are allowed; capture_lock keeps their device work out.
        with (
            self.capture_lock,
            torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"),
        ):
            logits = self._static(inputs)
        self.graphs_captured += 1
        return graph, logits

    def _static(self, inputs: DecodeInputs) -> torch.Tensor:
        if self._layer is None:
            return self.model.decode_static(inputs, self.pool)
        with torch.no_grad():
            return self.model.static_step(inputs, self.pool, self._layer)


def _decode_row(req: Request, n: int) -> bool:
    """Whether a step's item is a decode row: one token, the request's last before it samples."""
    return n == 1 and req.remaining == 1


def _rows(items: Sequence[tuple[Request, int]]) -> list[tuple[Request, int]]:
    """One (request, position) per token a step computes, in batch order: a chunk of n tokens from
    `num_computed` is n rows whose positions, and so whose visible keys, grow by one."""
    return [(req, pos) for req, n in items for pos in range(req.num_computed, req.num_computed + n)]
