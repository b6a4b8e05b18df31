"""The router's request path, shared by the gRPC servicer and the HTTP front.

Each request's flow runs in the task that reads it (`_read`), with no task or queue of its own between
them. Its wait for the next step is the only place anything interrupts it: Abort, the router's close
and the progress deadline cancel that wait (`_Live.interrupt`), never a send to the client in progress,
and a client cancel or disconnect cancels the reading task itself. However it stops, the flow is
closed where it stands, so its own cleanup (cancel calls, abort the room) runs. `_serve` sends the
steps and the last response that `stream` builds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from typing import Any

import aiohttp
import grpc
from prometheus_client import CollectorRegistry
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import router_service_pb2 as rpb
from xavier.v1 import types_pb2

from xavier_core.runtime import GenericError, Unavailable, XavierError, get_registry
from xavier_services.router.admission import Admission
from xavier_services.router.config import RouterConfig
from xavier_services.router.flows import FlowEnv, Step, Trace, colocated_flow
from xavier_services.router.health import role_name
from xavier_services.router.migration import Migration, migrating
from xavier_services.router.native import native_flow
from xavier_services.router.observe import RequestRecord, RouterMetrics
from xavier_services.router.offload import ProcessEncoder
from xavier_services.router.pacing import WaitDeadline
from xavier_services.router.pd import pd_flow
from xavier_services.router.peers import PeerPool
from xavier_services.router.prompts import ModelInfo, PromptEncoder, prompt_size
from xavier_services.router.request import Prepared, prepare
from xavier_services.router.stream import Tally, last_response, step_response

_MODE_NAMES = {
    rpb.ROUTING_MODE_PD: "pd",
    rpb.ROUTING_MODE_COLOCATED: "colocated",
    rpb.ROUTING_MODE_NATIVE: "native",
}
_BY_NAME = {v: k for k, v in _MODE_NAMES.items()}


class ProgressTimeout(XavierError):
    """No token arrived within the progress deadline; the request was ended and its room freed."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "PROGRESS_TIMEOUT"


class _Live:
    """A request being served: the task that last waited on its flow's next step, the progress deadline
    on those waits (`deadline.since` is when the wait in progress began), and why it was told to stop
    (`ABORTED` or `TIMED_OUT`), once it was. A wait for a step longer than `progress` seconds
    interrupts the flow (`TIMED_OUT`); the time a step takes to send never counts."""

    __slots__ = ("deadline", "task", "why")

    ABORTED = "aborted"
    TIMED_OUT = "timed_out"

    def __init__(self, loop: asyncio.AbstractEventLoop, progress: float) -> None:
        self.task: asyncio.Task[Any] | None = None
        self.why: str | None = None
        self.deadline = WaitDeadline(loop, progress, self._timed_out)

    def interrupt(self, why: str) -> None:
        """Stops the flow: its wait for a step is cancelled now, or, while a step is being sent, the
        reader closes it before asking for the next one. The first reason given stands."""
        if self.why is not None:
            return
        self.why = why
        if self.deadline.since is not None and self.task is not None:
            self.task.cancel()

    def _timed_out(self) -> None:
        self.interrupt(_Live.TIMED_OUT)


class Router:
    """Prepares requests, picks a mode and runs its flow; tracks live requests for Abort."""

    def __init__(
        self,
        config: RouterConfig,
        encoder: PromptEncoder,
        model: ModelInfo,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config
        self.encoder = encoder
        self.model = model
        self.pool = PeerPool(
            config.directory,
            config.rpc_timeout_seconds,
            config.peer_refresh_seconds,
            config.retry_attempts,
            affinity_slack=config.prefix_affinity_slack,
            health_interval=config.health_interval_seconds,
            health_timeout=config.health_timeout_seconds,
            peer_sessions=config.peer_sessions,
            retire_after=config.request_timeout_seconds + 60.0,
        )
        self._metrics = RouterMetrics(registry or get_registry())
        self.pool.health.on_change = self._peer_changed
        self.admission = Admission(
            config.max_inflight_requests,
            config.max_queued_requests,
            config.queue_timeout_seconds,
            config.retry_after_seconds,
        )
        admission = self.admission
        self._metrics.queued.set_function(lambda: admission.queued)  # read at scrape time
        self._tokenizers = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tokenize")
        if config.model is not None and encoder.offload is None:
            encoder.offload = ProcessEncoder(config.model, config.offload_tokenize_chars)
        self._live: dict[str, _Live] = {}
        self._quiet = asyncio.Event()  # set while no request is live
        self._quiet.set()
        self._background: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None
        self.env = FlowEnv(
            self.pool,
            config.request_timeout_seconds,
            self.spawn,
            config.prefix_affinity_tokens,
            config.failover_attempts,
            config.peer_wait_seconds,
            config.decode_progress_seconds,
        )

    @property
    def active(self) -> int:
        return len(self._live)

    def start(self) -> None:
        """Starts the background peer health probe (needs the running loop)."""
        if self.pool.directory is not None:
            self.pool.health.start(self.pool.peers)

    def _peer_changed(self, peer: dpb.Peer, up: bool, why: str) -> None:
        if not up:
            self._metrics.peer_down.labels(role_name(peer.role)).inc()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Runs cleanup in the background, kept referenced until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """Aborts live requests, waits for their cleanup, closes channels."""
        for live in list(self._live.values()):
            live.interrupt(_Live.ABORTED)
        with contextlib.suppress(TimeoutError):  # a reader that stopped reading holds nothing of ours
            await asyncio.wait_for(self._quiet.wait(), self.config.rpc_timeout_seconds)
        if self._background:
            await asyncio.wait(self._background, timeout=self.config.rpc_timeout_seconds)
        if self._session is not None:
            await self._session.close()
        await self.pool.close()
        self._tokenizers.shutdown(wait=False, cancel_futures=True)
        if self.encoder.offload is not None:
            self.encoder.offload.close()

    async def prepare_async(self, req: rpb.GenerateRequest) -> Prepared:
        """`prepare` on a tokenizer thread, so a huge prompt or chat never stalls the event loop's
        streams; a prompt below `inline_prepare_chars` is prepared here, where it costs less."""
        if prompt_size(req) < self.config.inline_prepare_chars:
            return prepare(req, self.encoder, self.model)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizers, prepare, req, self.encoder, self.model)

    async def available_modes(self) -> list[int]:
        """Modes that have peers now, in preference order."""
        modes = []
        try:
            roles = {p.role for p in await self.pool.usable()}
        except Exception:  # a directory outage leaves native mode usable
            roles = set()
        if types_pb2.ROLE_PREFILL in roles and types_pb2.ROLE_DECODE in roles:
            modes.append(rpb.ROUTING_MODE_PD)
        if types_pb2.ROLE_UNIFIED in roles:
            modes.append(rpb.ROUTING_MODE_COLOCATED)
        if self.config.native.enabled:
            modes.append(rpb.ROUTING_MODE_NATIVE)
        return modes

    async def default_mode(self) -> int:
        if self.config.default_mode != "auto":
            return int(_BY_NAME[self.config.default_mode])

        async def first_mode() -> int:
            modes = await self.available_modes()
            if not modes:
                raise Unavailable("no peers are registered yet", reason="NO_PEERS")
            return modes[0]

        return await self.pool.wait_for_peers(first_mode, self.config.peer_wait_seconds)

    def _flow(self, prep: Prepared, mode: int, trace: Trace, moves: list[Migration]) -> AsyncIterator[Step]:
        if mode in (rpb.ROUTING_MODE_PD, rpb.ROUTING_MODE_COLOCATED):
            flow = pd_flow if mode == rpb.ROUTING_MODE_PD else colocated_flow
            limit, tokenizer = self.config.migration_limit, self.encoder.tokenizer
            return migrating(prep, lambda p, avoid: flow(p, self.env, trace, avoid), limit, tokenizer, moves)
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return native_flow(prep, self.config.native, self._session, self.config.request_timeout_seconds)

    async def generate(self, prep: Prepared) -> AsyncIterator[rpb.GenerateResponse]:
        """Runs a prepared request and yields its responses; the last carries usage and timings.

        The request first takes a serving slot (RESOURCE_EXHAUSTED when the limits are full); a gap of
        `progress_timeout_seconds` without a token ends it with DEADLINE_EXCEEDED, and its flow's
        cleanup frees its room and calls on every service.
        """
        rec = RequestRecord(prep.request_id, prompt_tokens=len(prep.token_ids))
        try:
            async with self.admission.slot() as queued_s:
                rec.queue_seconds = queued_s
                self._metrics.queue_time.observe(queued_s)
                async for resp in self._serve(prep, rec):
                    yield resp
        except XavierError as err:
            rec.status, rec.cause = err.code.name, err.reason
            self._metrics.failures.labels(err.reason).inc()
            if err.reason == err.code.name:
                # No ErrorInfo: a transport status, whose text names internal addresses.
                raise GenericError(err.code, f"a cluster service failed ({err.code.name})") from None
            raise
        except (asyncio.CancelledError, GeneratorExit):
            rec.status, rec.cause = "CANCELLED", "client"
            self._metrics.cancels.labels("client").inc()
            raise
        finally:
            rec.duration = time.monotonic() - prep.arrival
            rec.log()

    async def _serve(self, prep: Prepared, rec: RequestRecord) -> AsyncIterator[rpb.GenerateResponse]:
        mode = prep.mode or await self.default_mode()
        if prep.request_id in self._live:
            prep.request_id = f"{prep.request_id}-{int(time.monotonic_ns())}"
        trace = Trace()
        moves: list[Migration] = []
        rec.peers, rec.failed_peers = trace.peers, trace.failed
        rid = rec.request_id = prep.request_id
        live = self._live[rid] = _Live(asyncio.get_running_loop(), self.config.progress_timeout_seconds)
        self._quiet.clear()
        self._metrics.active.inc()
        mode_name = rec.mode = _MODE_NAMES.get(mode, "unknown")
        tally = Tally()
        try:
            flow = self._flow(prep, mode, trace, moves)
            async with aclosing(self._read(flow, live, prep, rec, tally)) as steps:
                async for step in steps:
                    yield step_response(rid, mode, step)
            total = time.monotonic() - prep.arrival
            if tally.ttft is not None and tally.completion > 1:
                self._metrics.mode(mode_name).tpot.observe((total - tally.ttft) / (tally.completion - 1))
            rec.finish = types_pb2.FinishReason.Name(tally.finish)
            yield last_response(rid, mode, len(prep.token_ids), tally, total)
            self._metrics.finished(mode_name, rec.finish).inc()
        finally:
            if trace.failovers:
                self._metrics.failovers.inc(trace.failovers)
            for move in moves:
                self._metrics.migrations.labels(move.cause).inc()
            rec.migrations = [move.describe() for move in moves]
            live.deadline.stop()
            self._live.pop(rid, None)
            if not self._live:
                self._quiet.set()
            self._metrics.active.dec()

    async def _read(
        self, flow: AsyncIterator[Step], live: _Live, prep: Prepared, rec: RequestRecord, tally: Tally
    ) -> AsyncGenerator[Step, None]:
        """The steps to send (those with tokens or text), read from the flow into `tally` until a step
        finishes the request or the flow ends (finish ABORT, as when it is aborted) or fails (its error
        raised); a gap of `progress_timeout_seconds` raises `ProgressTimeout`. The flow is closed when
        this ends, however it ends."""
        progress = self.config.progress_timeout_seconds
        metrics = self._metrics.mode(rec.mode)
        async with aclosing(flow) as steps:  # type: ignore[type-var]
            while True:
                step = await self._next(steps, live)
                if live.why == _Live.TIMED_OUT:
                    raise ProgressTimeout(
                        f"no token for {progress:g} s; the request was ended", seconds=progress
                    )
                if step is None:  # the flow ran out of steps, or was aborted
                    tally.finish = types_pb2.FINISH_REASON_ABORT
                    if live.why == _Live.ABORTED:
                        rec.status, rec.cause = "CANCELLED", "abort"
                        self._metrics.cancels.labels("abort").inc()
                    return
                if tally.ttft is None and step.token_ids:
                    rec.ttft = tally.ttft = time.monotonic() - prep.arrival
                    metrics.ttft.observe(tally.ttft)
                tally.add(step)
                rec.completion_tokens = tally.completion
                metrics.output_tokens.inc(len(step.token_ids))
                if tally.finish:
                    return
                if step.token_ids or step.text:
                    yield step

    @staticmethod
    async def _next(steps: AsyncIterator[Step], live: _Live) -> Step | None:
        """The flow's next step, or None once it ran out or was told to stop (`live.why` says why)."""
        if live.why is not None:
            return None
        live.task = asyncio.current_task()  # a reader may read each step in a task of its own
        live.deadline.watch()
        try:
            return await anext(steps)
        except StopAsyncIteration:
            return None
        except asyncio.CancelledError:
            task = live.task
            if live.why is None or task is None or task.uncancel() > 0:
                raise  # the reader itself is cancelled (a client that left)
            return None
        finally:
            live.deadline.unwatch()

    def abort(self, request_id: str) -> bool:
        """Stops a live request; its stream ends with FINISH_REASON_ABORT. True when it was live."""
        live = self._live.get(request_id)
        if live is None:
            return False
        live.interrupt(_Live.ABORTED)
        return True
