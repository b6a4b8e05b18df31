"""The engine loop: one background thread that schedules, runs the model and hands results back.

The asyncio side only queues requests and aborts under `lock` and wakes the loop; the loop hands results
back with `call_soon_threadsafe`, one call per event loop per step. Aborts are applied by the loop between
steps, so a request's pages are never freed while a forward pass may still write them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Protocol

import torch

from xavier_core.engine.api import AbortEvent
from xavier_core.engine.decode_graph import DecodeRunner
from xavier_core.engine.errors import EngineClosedError
from xavier_core.engine.kv_pool import KvPool
from xavier_core.engine.model import ForwardBatch
from xavier_core.engine.prefix_cache import PrefixCache
from xavier_core.engine.request import Delivery, Request
from xavier_core.engine.runner import build_batch, prompt_rows, record_prompt_logprobs, sample
from xavier_core.engine.scheduler import Scheduler, StepPlan

log = logging.getLogger(__name__)


class ForwardModel(Protocol):
    """What the loop needs of a model: one forward step over the paged pool (`CausalLM`, `NullLM`)."""

    def forward(self, batch: ForwardBatch, pool: KvPool) -> torch.Tensor: ...


class EngineLoop:
    """Owns the scheduler's thread; `lock` guards the scheduler, the cache and the allocator."""

    def __init__(
        self,
        model: ForwardModel,
        pool: KvPool,
        sched: Scheduler,
        cache: PrefixCache,
        decoder: DecodeRunner | None = None,
    ) -> None:
        self.model = model
        self.decoder = decoder  # runs the steps it accepts when set (static shapes, CUDA graphs)
        self.pool = pool
        self.sched = sched
        self.cache = cache
        self.lock = threading.Lock()
        self.closed = False
        self.steps = 0
        self._wake = threading.Condition(self.lock)
        self._aborts: list[str] = []
        self._loops: dict[Request, asyncio.AbstractEventLoop] = {}
        self._thread = threading.Thread(target=self._run, name="xavier-engine", daemon=True)
        self._thread.start()

    def submit(self, req: Request, loop: asyncio.AbstractEventLoop) -> None:
        """Queues a request; call with `lock` held."""
        self._loops[req] = loop
        self.sched.add(req)
        self._wake.notify()

    def queue_abort(self, request_id: str) -> None:
        """Asks the loop to abort a request (or drop its pins) before the next step."""
        with self.lock:
            self._aborts.append(request_id)
            self._wake.notify()

    async def stop(self) -> None:
        """Stops the thread; live requests end with `EngineClosedError`."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self._wake.notify()
        await asyncio.to_thread(self._thread.join)
        with self.lock:
            reqs = self.sched.fail_all()
        self.deliver([(r, EngineClosedError("engine closed")) for r in reqs])

    def deliver(self, items: list[tuple[Request, Delivery]]) -> None:
        """Hands results to their requests' event loops."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Request, Delivery]]] = {}
        for req, item in items:
            loop = self._loops.get(req)
            if req.finish is not None or isinstance(item, BaseException):
                self._loops.pop(req, None)
            if loop is not None:
                by_loop.setdefault(loop, []).append((req, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_dispatch, batch)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                log.debug("dropping %d deliveries for a closed event loop", len(batch))

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        if self.pool.device.type == "cuda":
            torch.cuda.set_device(self.pool.device)  # a new thread starts on cuda:0
        while True:
            with self.lock:
                while not self.closed and not self._aborts and not self.sched.has_work():
                    self._wake.wait()
                if self.closed:
                    return
                aborted = self._apply_aborts()
                plan, failed = self.sched.schedule()
            self.deliver(aborted + failed)
            if plan.items:
                self._step(plan)

    def _apply_aborts(self) -> list[tuple[Request, Delivery]]:
        out: list[tuple[Request, Delivery]] = []
        for rid in self._aborts:
            req = self.sched.abort(rid)
            if req is not None:
                out.append((req, AbortEvent()))
            else:
                self.cache.release(self.cache.allocator.unpin(rid))
        self._aborts.clear()
        return out

    def _step(self, plan: StepPlan) -> None:
        started = time.perf_counter()
        for req, _ in plan.items:
            req.scheduled_at = req.scheduled_at or started
        try:
            if self.decoder is not None and self.decoder.accepts(plan.items):
                logits = self.decoder.run(plan.items)  # the sampling rows only: it takes no prompt rows
            else:
                rows = prompt_rows(plan)
                batch = build_batch(plan, self.pool.page_size, self.pool.device, rows)
                logits = self.model.forward(batch, self.pool)
                if rows:
                    record_prompt_logprobs(logits[len(batch.sample_idx) :], rows)
            sampled = sample(logits[: len(plan.sampling)], plan.sampling)
        except Exception as exc:
            log.exception("engine step failed; failing every live request")
            with self.lock:
                reqs = self.sched.fail_all()
            self.deliver([(r, exc) for r in reqs])
            return
        with self.lock:
            out = self.sched.complete(plan, sampled)
            self.steps += 1
        ended = time.perf_counter()
        for req, _ in plan.items:
            if req.output and not req.sampled_at:
                req.sampled_at = ended
        self.deliver(out)


def _dispatch(batch: list[tuple[Request, Delivery]]) -> None:
    for req, item in batch:
        req.deliver(item)
