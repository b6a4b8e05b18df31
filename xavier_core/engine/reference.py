"""The reference engine: Qwen2/Qwen3/Llama in plain PyTorch behind the engine-neutral `Engine` interface.

The model runs on one background thread (`EngineLoop`); these methods validate, queue and await. With
`compute="null"` the model is a `NullLM` (no weights, near-zero compute) and everything else stays the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from xavier_core.engine.api import (
    AbortEvent,
    EngineBusyError,
    EngineFeature,
    EngineStats,
    InvalidRequestError,
    PrefillResult,
    RequestNotFoundError,
    Sampling,
    StreamEvent,
    TokenEvent,
)
from xavier_core.engine.checkpoint import ModelConfig, load_config, load_weights, resolve_dtype
from xavier_core.engine.decode_graph import CHUNK_GATHER_BYTES, DecodeRunner
from xavier_core.engine.engine_loop import EngineLoop
from xavier_core.engine.errors import CheckpointError, EngineClosedError, RequestAbortedError
from xavier_core.engine.kv_pool import KvPool
from xavier_core.engine.model import CausalLM
from xavier_core.engine.null_model import NullLM
from xavier_core.engine.page_allocator import PageAllocator
from xavier_core.engine.prefix_cache import PrefixCache
from xavier_core.engine.request import Delivery, Request, Role, check_prompt, pages_for
from xavier_core.engine.scheduler import Scheduler
from xavier_core.engine.store_link import SharePull, StoreLink
from xavier_core.engine.stream import TokenStream
from xavier_core.engine.timing import record_first_token
from xavier_core.grammar.masks import LazyCompiler
from xavier_core.prefix_keys import chain_seed, page_keys
from xavier_core.sampling import check_cache_salt
from xavier_core.text.errors import ModelFilesError
from xavier_core.text.tokenizer import TextTokenizer
from xavier_core.transfer.common.buffers import KvBuffer
from xavier_core.transfer.common.stuck import on_success

if TYPE_CHECKING:
    from xavier_core.pagestore.client import PageStoreClient

log = logging.getLogger(__name__)
_CPU_KV_BYTES = 1 << 30
_CUDA_KV_FRACTION = 0.6
COMPUTE_MODES = ("model", "null")


def _default_num_pages(
    cfg: ModelConfig, page_size: int, max_running: int, device: str, dtype: torch.dtype
) -> int:
    per_page = 2 * cfg.num_layers * page_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        budget = int(free * _CUDA_KV_FRACTION)
    else:
        budget = _CPU_KV_BYTES
    per_context = pages_for(cfg.max_position, page_size)
    return max(per_context, min(budget // per_page, per_context * max_running))


class ReferenceEngine:
    """A paged-KV PyTorch engine for unified, prefill and decode roles (see `xavier_core.engine.api`)."""

    def __init__(
        self,
        model: CausalLM | NullLM,
        tokenizer: TextTokenizer,
        pool: KvPool,
        *,
        max_running: int,
        chunk_tokens: int,
        layout_fingerprint: str,
        cuda_graphs: bool = True,
        static_chunks: bool = True,
        max_queued: int = 1024,
        chunk_gather_bytes: int = CHUNK_GATHER_BYTES,
        compile_static: bool = False,
    ) -> None:
        if max_running < 1 or chunk_tokens < 1 or max_queued < 1:
            raise InvalidRequestError(
                f"max_running ({max_running}), chunk_tokens ({chunk_tokens}) and max_queued ({max_queued}) "
                "must be >= 1"
            )
        self.max_queued = max_queued
        self.model = model
        self.config = model.cfg
        self.tokenizer = tokenizer
        self.kv_pool = pool
        self.layout_fingerprint = layout_fingerprint
        self.model_dir: Path | None = None
        self.eos_token_ids = frozenset(self.config.eos_token_ids) | (
            {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        )
        self._allocator = PageAllocator(pool.num_pages)
        self._cache = PrefixCache(self._allocator, pool.page_size)
        self._sched = Scheduler(self._cache, max_running, chunk_tokens)
        # On CUDA, decode steps, and short prefill chunks after cached keys with them unless `static_chunks`
        # is off, take the static-shape path (graphed unless `cuda_graphs` is off); the CPU keeps the
        # general forward for every step. A NullLM has no static-shape path: forward only.
        decoder = None
        if pool.device.type == "cuda" and isinstance(model, CausalLM):
            decoder = DecodeRunner(
                model,
                pool,
                cuda_graphs,
                max_running,
                static_chunks,
                chunk_gather_bytes,
                compiled="inductor" if compile_static else "",
            )
        # The loop only calls `forward`, which both models offer.
        self._loop = EngineLoop(model, pool, self._sched, self._cache, decoder)
        self._lock = self._loop.lock
        self._store: StoreLink | None = None
        self._quarantined = 0  # pages out of use while a read may still write them (`quarantine_pages`)
        # Requests on their way to the loop (grammar, prefix, first token) that it does not hold yet.
        self._entering: set[str] = set()
        self._grammars = LazyCompiler(tokenizer, self.config.vocab_size, self.eos_token_ids)

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        device: str = "cpu",
        dtype: str | None = None,
        page_size: int = 16,
        num_pages: int | None = None,
        max_running: int = 64,
        chunk_tokens: int = 1024,
        layout_fingerprint: str | None = None,
        cuda_graphs: bool = True,
        compute: str = "model",
        max_queued: int = 1024,
        static_chunks: bool = True,
        chunk_gather_bytes: int = CHUNK_GATHER_BYTES,
        compile_static: bool = False,
    ) -> ReferenceEngine:
        """Loads a checkpoint directory and starts the engine loop.

        `dtype` defaults to float16 on CUDA and float32 on CPU. `num_pages` defaults to what fits in 60% of
        free GPU memory (1 GiB on CPU), capped at `max_running` full contexts. `layout_fingerprint` seeds the
        prefix key chain; by default a SHA-256 of config.json, the dtype and the page size. On CUDA,
        decode steps run from CUDA graphs unless `cuda_graphs` is False (then the same static-shape
        decode runs eagerly), and so do short prefill chunks after cached keys (a prefix hit's suffix: one
        decode row per token, `DecodeRunner.accepts`) unless `static_chunks` is False or the rows would
        gather more than `chunk_gather_bytes` of K/V per layer; on the CPU these have no effect. With
        `compile_static` (CUDA only) that static-shape step is torch.compile's: fused kernels, compiled
        when the graphs are captured (`capture_decode_graphs`, tens of seconds). Past
        `max_queued` requests waiting for their first step, `generate` and `prefill` raise
        `EngineBusyError`.

        `compute="null"` serves a `NullLM` built from config.json alone (no weights are read; the tokenizer
        still is): deterministic K/V and logits at near-zero cost, for measuring everything around the
        model. Its default layout fingerprint differs from the real model's, so their prefix keys never mix.
        """
        if compute not in COMPUTE_MODES:
            raise InvalidRequestError(f"compute must be one of {', '.join(COMPUTE_MODES)}; got {compute!r}")
        path = Path(model_dir)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint directory {path} does not exist")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise CheckpointError(f"device {device!r} requested but CUDA is not available")
        if compile_static and not device.startswith("cuda"):
            raise InvalidRequestError(f"compile_static needs a CUDA device, not {device!r}")
        if device == "cuda":
            # The engine thread pins its device by index: "cuda" means the current one.
            device = f"cuda:{torch.cuda.current_device()}"
        cfg = load_config(path)
        torch_dtype = resolve_dtype(device, dtype)
        try:
            tokenizer = TextTokenizer.load(path)
        except ModelFilesError as exc:
            raise CheckpointError(str(exc)) from exc
        model: CausalLM | NullLM
        if compute == "null":
            model = NullLM(cfg, device, torch_dtype)
        else:
            model = CausalLM(cfg, load_weights(path, cfg, device, torch_dtype), device, torch_dtype)
        pages = num_pages or _default_num_pages(cfg, page_size, max_running, device, torch_dtype)
        pool = KvPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, page_size, pages, torch_dtype, device)
        if layout_fingerprint is None:
            digest = hashlib.sha256((path / "config.json").read_bytes())
            digest.update(f"|{torch_dtype}|{page_size}".encode())
            if compute != "model":
                digest.update(f"|compute={compute}".encode())
            layout_fingerprint = digest.hexdigest()
        engine = cls(
            model,
            tokenizer,
            pool,
            max_running=max_running,
            chunk_tokens=chunk_tokens,
            layout_fingerprint=layout_fingerprint,
            cuda_graphs=cuda_graphs,
            static_chunks=static_chunks,
            max_queued=max_queued,
            chunk_gather_bytes=chunk_gather_bytes,
            compile_static=compile_static,
        )
        engine.model_dir = path
        return engine

    @property
    def compute(self) -> str:
        """What runs each step: "model" (the checkpoint's forward pass) or "null" (a `NullLM`)."""
        return "null" if isinstance(self.model, NullLM) else "model"

    # Layout facts (what a KvLayout needs).
    @property
    def page_size(self) -> int:
        """Tokens per KV page."""
        return self.kv_pool.page_size

    @property
    def max_context(self) -> int:
        """Longest prompt plus output a request may reach."""
        return min(self.config.max_position, self.kv_pool.num_pages * self.page_size)

    @property
    def num_layers(self) -> int:
        """Decoder layers (two KV buffers each)."""
        return self.config.num_layers

    @property
    def num_kv_heads(self) -> int:
        """KV heads per layer."""
        return self.config.num_kv_heads

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.config.head_dim

    @property
    def vocab_size(self) -> int:
        """Token ids the model accepts (the model's, possibly padded, vocabulary)."""
        return self.config.vocab_size

    @property
    def dtype_name(self) -> str:
        """KV dtype as a short name: "float16" or "float32"."""
        return str(self.kv_pool.dtype).removeprefix("torch.")

    @property
    def features(self) -> frozenset[EngineFeature]:
        """Every optional feature: alternatives per token, prompt logprobs, grammars, logit controls and
        resumed output."""
        return frozenset(EngineFeature)

    @property
    def device(self) -> str:
        """Device the model and the pool live on."""
        return str(self.kv_pool.device)

    def kv_buffers(self) -> list[KvBuffer]:
        """The pool's buffers, layer0 K, layer0 V, layer1 K, ... (stable for the engine's lifetime)."""
        return self.kv_pool.kv_buffers()

    def capture_decode_graphs(self) -> int:
        """Captures the decode CUDA graphs of every batch and context size now (no-op without graphs).

        Call before anything else issues work on the device (a KV transfer agent): captures must not
        overlap it. A short prefill chunk after cached keys runs as decode rows only through a graph
        captured already (`DecodeRunner.accepts`). Returns the number of graphs captured (0 with null
        compute, which has no graphs)."""
        decoder = self._loop.decoder
        if decoder is None or not decoder.use_graphs:
            return 0
        device = self.kv_pool.device
        started, reserved = time.monotonic(), torch.cuda.memory_reserved(device)
        n = decoder.capture_all(pages_for(self.max_context, self.page_size))
        log.info("%d decode graphs captured in %.2f s, %.0f MiB more reserved on %s", n,
                 time.monotonic() - started, (torch.cuda.memory_reserved(device) - reserved) / 2**20,
                 device)  # fmt: skip
        return n

    @property
    def device_lock(self) -> threading.Lock | None:
        """Lock that callers hold around their own device work (KV transfers) on this engine's GPU, so
        it never lands inside a CUDA graph capture; None when the engine captures no graphs."""
        decoder = self._loop.decoder
        return decoder.capture_lock if decoder is not None and decoder.use_graphs else None

    def read_pages(self, page_ids: Sequence[int]) -> bytes:
        """Raw KV bytes of the pages, buffer by buffer."""
        with self.device_lock or contextlib.nullcontext():
            return self.kv_pool.read_pages(page_ids)

    def write_pages(self, page_ids: Sequence[int], data: bytes) -> None:
        """Writes bytes laid out as `read_pages` returns them into (reserved) pages."""
        with self.device_lock or contextlib.nullcontext():
            self.kv_pool.write_pages(page_ids, data)

    # Requests.
    def generate(
        self, request_id: str, token_ids: Sequence[int], sampling: Sampling, *, cache_salt: str = ""
    ) -> TokenStream:
        """Runs a whole request and streams its tokens; leaving the stream early aborts the request."""
        req = self._new_request(request_id, token_ids, sampling, Role.GENERATE, cache_salt)
        return TokenStream(self._stream(req, first=None))

    async def prefill(
        self, request_id: str, token_ids: Sequence[int], sampling: Sampling, *, cache_salt: str = ""
    ) -> PrefillResult:
        """Computes the prompt's KV and samples the first token; pages stay pinned until `release_pages`."""
        req = self._new_request(request_id, token_ids, sampling, Role.PREFILL, cache_salt)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[PrefillResult] = loop.create_future()

        def deliver(item: Delivery) -> None:
            if future.done():
                return
            if isinstance(item, PrefillResult):
                future.set_result(item)
            elif isinstance(item, BaseException):
                future.set_exception(item)
            else:  # an AbortEvent: a prefill-role request gets no TokenEvent
                future.set_exception(RequestAbortedError(f"request {request_id} was aborted"))

        req.deliver = deliver
        self._entering.add(request_id)
        try:
            await self._compile_grammar(req)
            await self._take_prefix(req)
            try:
                self._submit(req, loop)
            except BaseException:
                self.release_prefix(req)
                raise
        finally:
            self._entering.discard(request_id)
        try:
            return await future
        except asyncio.CancelledError:
            self._loop.queue_abort(request_id)
            raise

    def reserve_pages(self, request_id: str, num_tokens: int) -> tuple[int, ...]:
        """Allocates and pins destination pages for `num_tokens` prompt tokens (decode role)."""
        if not 0 < num_tokens < self.max_context:
            raise InvalidRequestError(f"num_tokens must be in [1, {self.max_context}), got {num_tokens}")
        with self._lock:
            self._check_open_and_unique(request_id)
            pages = self._cache.allocate(pages_for(num_tokens, self.page_size))
            self._allocator.pin(request_id, pages)
        return tuple(pages)

    def pin_prefix(
        self, owner: str, token_ids: Sequence[int], cache_salt: str = "", first_page: int = 0
    ) -> tuple[int, ...]:
        """Pins the cached pages of the longest run of `token_ids`' full pages from `first_page` on (keys
        chained from the first page under `cache_salt`), no request needed: a replica shares them with a
        peer's read (`SharePrefix`). The run needs no page before `first_page` cached: each key names
        its whole prefix already.

        They are held for `owner`, an id no request uses, until `release_pages(owner)`, so nothing evicts
        or rewrites them meanwhile; nothing cached pins nothing and returns ()."""
        check_cache_salt(cache_salt)
        p = self.page_size
        full = len(token_ids) // p
        if not 0 <= first_page < full:
            raise InvalidRequestError(f"first_page must be in [0, {full}), got {first_page}")
        keys = page_keys(chain_seed(self.layout_fingerprint, cache_salt), token_ids[: full * p], p)
        with self._lock:
            self._check_open_and_unique(owner)
            pages = self._cache.match(keys[first_page:], token_ids[first_page * p :], full - first_page)
            if pages:
                self._allocator.pin(owner, pages)
        return tuple(pages)

    def release_pages(self, request_id: str) -> None:
        """Unpins a prefill's pages, a pinned prefix's or frees an unclaimed reservation. Idempotent."""
        with self._lock:
            self._cache.release(self._allocator.unpin(request_id))

    def quarantine_pages(self, request_id: str, until: asyncio.Future[None] | None = None) -> int:
        """Takes a request's pinned pages out of use (a read into them may still be running: freed, they
        could be overwritten under another request) until `until` completes (the read has ended), for good
        without it or if it fails; returns how many. Idempotent."""
        with self._lock:
            pages = self._allocator.unpin(request_id)
            self._quarantined += len(pages)  # their references stay held: never handed out meanwhile
        if not pages:
            return 0
        log.error("%d pages of %s kept out of use: a read into them may still be running", len(pages),
                  request_id)  # fmt: skip

        def lift() -> None:
            with self._lock:
                self._cache.release(pages)
                self._quarantined -= len(pages)
            log.info("%d pages of %s back in use: the read into them ended", len(pages), request_id)

        if until is not None:
            on_success(until, lift)
        return len(pages)

    def decode_from_pages(
        self,
        request_id: str,
        token_ids: Sequence[int],
        first_token: int,
        first_logprob: float,
        sampling: Sampling,
        cache_salt: str = "",
    ) -> TokenStream:
        """Continues a request whose prompt KV is in its reserved pages; the first event is `first_token`.
        With a page store the answer's full pages are written through under `cache_salt` (the prompt's
        are the prefill's to write); without one the request neither reads nor fills the prefix cache."""
        salt = cache_salt if self._store is not None else None
        req = self._new_request(request_id, token_ids, sampling, Role.DECODE, salt)
        if not 0 <= first_token < self.config.vocab_size:
            raise InvalidRequestError(f"first_token {first_token} out of vocabulary")
        return TokenStream(self._stream(req, first=(first_token, first_logprob)))

    async def abort(self, request_id: str) -> None:
        """Stops a request (its stream ends with ABORT) or drops its pinned pages; returns at once.

        Only a request the engine loop holds (scheduled or waiting) or one on its way there needs the
        loop: anything else (a request that finished, a prefill's pinned pages, a reservation) no step
        can be writing, so its pins are dropped here, as `release_pages` would, without waking the loop's
        thread (a decode aborts every request it served once it ended)."""
        if self._store is not None:
            self._store.abort(request_id)
        if request_id not in self._entering:
            with self._lock:
                if self._sched.find(request_id) is None:
                    self._cache.release(self._allocator.unpin(request_id))
                    return
        self._loop.queue_abort(request_id)

    def use_page_store(
        self,
        store: PageStoreClient,
        contract_fingerprint: str,
        share: SharePull | None = None,
        stand_s: float = 0.0,
        stand_share: float = 0.0,
    ) -> None:
        """Fetches stored prefixes before admission (with `share`, stored pages another replica wrote are
        first asked of that replica) and writes computed prompt pages through (see
        `xavier_core.engine.store_link`); with `share`, the pages written stand `stand_s` for other
        replicas, at most `stand_share` of the pool at a time. Call once, from the event loop the requests
        run on."""
        link = StoreLink(store, contract_fingerprint, self._sched, self._lock, asyncio.get_running_loop())
        link.share = share
        link.stand_s = stand_s
        link.stand_limit = int(stand_share * self._allocator.num_pages)
        with self._lock:
            self._store = link
            self._sched.on_prompt_done = link.prompt_done
            self._sched.on_output_pages = link.output_pages

    def stats(self) -> EngineStats:
        """Pool and queue occupancy and prefix-cache counters."""
        decoder = self._loop.decoder
        with self._lock:
            s = self._sched
            return EngineStats(
                pages_total=self._allocator.num_pages,
                pages_free=self._cache.available(),
                pages_pinned=self._allocator.num_pinned,
                running=len(s.running),
                waiting=len(s.waiting),
                pages_quarantined=self._quarantined,
                prompt_tokens_computed=s.prompt_tokens_computed,
                prompt_tokens_cached=s.prompt_tokens_cached,
                prompt_tokens_cached_store=s.prompt_tokens_cached_store,
                store=self._store.stats() if self._store is not None else None,
                extra={
                    "pages_cached": self._cache.num_cached,
                    "pages_evictable": self._cache.num_evictable,
                    "evictions": self._cache.evictions,
                    "preemptions": s.preemptions,
                    "steps": self._loop.steps,
                    "decode_graphs": decoder.graphs_captured if decoder else 0,
                    # Prefill chunks run as decode rows (`DecodeRunner.accepts`), not by the general forward.
                    "static_prefill_chunks": decoder.prefill_chunks if decoder else 0,
                    # Of them, chunks alone in their step: the request's K/V gathered once per layer.
                    "static_shared_chunks": decoder.shared_steps if decoder else 0,
                },
            )

    async def close(self) -> None:
        """Stops the engine loop; live requests end with `EngineClosedError`."""
        await self._loop.stop()

    # Internals.
    def _new_request(
        self, request_id: str, token_ids: Sequence[int], sampling: Sampling, role: Role, salt: str | None
    ) -> Request:
        sampling.check()
        if any(t >= self.config.vocab_size for t, _ in sampling.logit_bias):
            raise InvalidRequestError(
                f"logit_bias names token ids outside the vocabulary [0, {self.vocab_size})"
            )
        if sampling.min_tokens and sampling.grammar is not None:
            raise InvalidRequestError(
                "min_tokens cannot be combined with a grammar"
            )  # nothing could be sampled
        prompt = check_prompt(token_ids, self.config.vocab_size, self.max_context)
        if sampling.resumed_output_tokens >= len(prompt):
            raise InvalidRequestError(
                f"resumed_output_tokens ({sampling.resumed_output_tokens}) must be below the prompt's "
                f"{len(prompt)} tokens"
            )
        if salt is not None:
            check_cache_salt(salt)
        seed = None if salt is None else chain_seed(self.layout_fingerprint, salt)
        return Request(
            id=request_id,
            prompt=prompt,
            sampling=sampling,
            role=role,
            deliver=lambda _: None,
            tokenizer=self.tokenizer,
            eos_ids=self.eos_token_ids,
            max_context=self.max_context,
            chain_seed=seed,
            device=self.device,
            cache_salt=salt or "",
        )

    async def _compile_grammar(self, req: Request) -> None:
        """Gives a request with `sampling.grammar` its matcher (compiled off the event loop); a decode's
        matcher then replays its first token. A resumed request's matcher first accepts its resumed
        output. Requests without a grammar skip this."""
        if req.sampling.grammar is not None:
            req.grammar = await asyncio.to_thread(self._grammars.matcher, req.sampling.grammar)
            if req.resumed:
                await asyncio.to_thread(req.replay_resumed)

    async def _take_prefix(self, req: Request) -> None:
        """With a page store, the request takes its local and stored prefix before it is queued (not one
        that wants its prompt's logprobs: it computes the whole prompt)."""
        if self._store is not None and req.role is not Role.DECODE and not req.sampling.prompt_logprobs:
            await self._store.take_prefix(req)

    def release_prefix(self, req: Request) -> None:
        """Drops the pages a request holds that never reached the engine loop."""
        with self._lock:
            self._cache.release(req.pages)
            req.pages = []

    async def _stream(
        self, req: Request, first: tuple[int, float] | None
    ) -> AsyncGenerator[StreamEvent, None]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Delivery] = asyncio.Queue()
        req.deliver = queue.put_nowait
        submitted = done = False
        started = time.perf_counter()
        self._entering.add(req.id)
        try:
            await self._compile_grammar(req)
            if first is not None:
                event = self._claim_reservation(req, *first)
                done = event.finish is not None
                yield event
                if done:
                    return
            else:
                try:
                    await self._take_prefix(req)
                except RequestAbortedError:
                    done = True
                    yield AbortEvent()
                    return
            req.queued_at = time.perf_counter()
            self._submit(req, loop)
            submitted = True
            self._entering.discard(req.id)
            tokens = 0
            while not done:
                item = await queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if isinstance(item, TokenEvent) and first is None and tokens == 0:
                    record_first_token(
                        started, req.queued_at, req.scheduled_at, req.sampled_at, time.perf_counter()
                    )
                    # The first token says how much of the prompt was not computed (set at admission).
                    item = dataclasses.replace(
                        item, cached_tokens=req.cached_tokens, cached_tokens_store=req.cached_tokens_store
                    )
                if isinstance(item, TokenEvent | AbortEvent):
                    tokens += isinstance(item, TokenEvent)
                    done = item.finish is not None
                    yield item
        finally:
            self._entering.discard(req.id)
            if not done and submitted:
                self._loop.queue_abort(req.id)
            elif not done and req.pages:  # holds a reservation or a prefix but never reached the loop
                self.release_prefix(req)

    def _claim_reservation(self, req: Request, token: int, logprob: float) -> TokenEvent:
        with self._lock:
            if self._sched.find(req.id) is not None:
                raise InvalidRequestError(f"request id {req.id!r} is already live")
            pages = self._allocator.unpin(req.id)
            if not pages:
                raise RequestNotFoundError(f"no reserved pages for request {req.id!r}")
            if len(pages) != pages_for(len(req.prompt), self.page_size):
                self._cache.release(pages)
                raise InvalidRequestError(
                    f"request {req.id!r} reserved {len(pages)} pages but its prompt needs "
                    f"{pages_for(len(req.prompt), self.page_size)}"
                )
            req.pages, req.num_computed, req.admitted = pages, len(req.prompt), True
            return self._sched.accept_first_token(req, token, logprob)

    def _check_open_and_unique(self, request_id: str) -> None:
        if self._loop.closed:
            raise EngineClosedError("engine closed")
        if self._sched.find(request_id) is not None or self._allocator.is_pinned(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")

    def _submit(self, req: Request, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            if req.role is not Role.DECODE:
                self._check_open_and_unique(req.id)
                # New work is bounded; a decode is not, its prefill already ran and its pages are held.
                if len(self._sched.waiting) >= self.max_queued:
                    raise EngineBusyError(
                        f"the engine has {self.max_queued} requests waiting (engine.max_queued); retry later"
                    )
            elif self._loop.closed:
                self._cache.release(req.pages)
                raise EngineClosedError("engine closed")
            self._loop.submit(req, loop)
