"""Several router processes on one pair of addresses (`router.workers`): the kernel spreads connections.

A router process does at most one core's work, and its Python work per streamed token makes that core the
mesh's ceiling at high concurrency. With `workers` N > 1 the process started, the lead, binds its gRPC
and HTTP ports with SO_REUSEPORT and starts N - 1 workers that bind the same ports. Each is a whole
router (its own peers, channels, admission and metrics) and the kernel hands each new connection to one
of them. The router's request and connection limits are split evenly between them (`share`).

The lead holds one socketpair to each worker, their only link (nothing on the network), carrying JSON
lines both ways (`Link`):
- a worker whose link closes (the lead is gone) drains and stops;
- a worker that exits while the lead runs is started again; until then the others take its share of
  new connections (the kernel routes to the sockets that are bound);
- an Abort of a request that another worker serves is asked of every worker through the lead, and
  GetClusterStatus counts the requests that every worker serves (`Siblings`);
- the lead's stop stops the workers (SIGTERM: each drains within its own grace).

Each worker serves its own /metrics (port 0 on the lead's metrics host); the lead's ready file lists
them under "workers".
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import math
import os
import signal
import socket
import sys
import tempfile
import urllib.request
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from xavier_core.runtime import ConfigError, parse_host_port
from xavier_core.runtime.logging import get_logger
from xavier_core.runtime.metrics import get_registry
from xavier_services.router.config import RouterConfig

_log = get_logger("xavier.router.workers")

Ask = dict[str, Any]
Serve = Callable[[Ask], Awaitable[Any]]

READY_SECONDS = 120.0
"""How long a worker may take to load the tokenizer and bind before the lead gives up on it."""
RESTART_SECONDS = (0.5, 10.0)
"""A dead worker is started again after the first, doubling up to the second while starts keep failing."""


class LinkClosed(ConnectionError):
    """The other end of a worker link is gone."""


def share(config: RouterConfig) -> RouterConfig:
    """One worker's config: the request and connection limits split evenly between the workers."""
    n = config.workers
    if n == 1:
        return config
    return config.model_copy(
        update={
            "max_inflight_requests": math.ceil(config.max_inflight_requests / n),
            "max_queued_requests": math.ceil(config.max_queued_requests / n),
            "http_max_connections": math.ceil(config.http_max_connections / n),
        }
    )


def check_ports_free(config: RouterConfig) -> None:
    """A port given outright must be free: a socket of this user bound with SO_REUSEPORT there (an older
    router, say) would otherwise silently share the lead's connections."""
    issues = []
    for key, address in (("listen", config.listen), ("http_listen", config.http_listen)):
        if not address:
            continue
        host, port = parse_host_port(address)
        if port == 0:
            continue
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host or "0.0.0.0", port))
            except OSError as exc:
                issues.append((key, f"cannot bind {address}: {exc.strerror}", "workers > 1"))
    if issues:
        raise ConfigError(issues)


class Link:
    """One end of a worker socketpair: asks and their answers as JSON lines, both ways."""

    def __init__(self, sock: socket.socket, serve: Serve) -> None:
        self._sock = sock
        self._serve = serve
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._seq = itertools.count(1)
        self._answering: set[asyncio.Task[None]] = set()
        self._opened = asyncio.Event()
        self.closed = asyncio.Event()

    async def run(self) -> None:
        """Reads until the other end closes; every open ask then fails with LinkClosed."""
        try:
            reader, self._writer = await asyncio.open_connection(sock=self._sock)
            self._opened.set()
            while line := await reader.readline():
                msg = json.loads(line)
                if "answer" in msg:
                    fut = self._pending.pop(msg["answer"], None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg.get("value"))
                    continue
                task = asyncio.ensure_future(self._answer(msg))
                self._answering.add(task)
                task.add_done_callback(self._answering.discard)
        except (ConnectionError, ValueError) as exc:
            _log.warning("worker link broke", error=str(exc))
        finally:
            self.close()

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        self._opened.set()  # an ask waiting for the link to open sees it closed
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(LinkClosed("worker link closed"))
        self._pending.clear()
        for task in self._answering:
            task.cancel()
        if self._writer is not None:
            self._writer.close()
        else:
            self._sock.close()

    async def ask(self, msg: Ask, timeout: float) -> Any:
        """The other end's answer to `msg` (LinkClosed if the link is or goes down, TimeoutError)."""
        await asyncio.wait_for(self._opened.wait(), timeout)
        if self.closed.is_set() or self._writer is None:
            raise LinkClosed("worker link closed")
        seq = next(self._seq)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[seq] = fut
        try:
            self._send({**msg, "ask": seq})
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._pending.pop(seq, None)

    async def _answer(self, msg: Ask) -> None:
        try:
            value = await self._serve(msg)
        except Exception:
            _log.exception("worker ask failed", op=msg.get("op"))
            value = None
        with contextlib.suppress(ConnectionError, RuntimeError):
            self._send({"answer": msg["ask"], "value": value})

    def _send(self, msg: Ask) -> None:
        assert self._writer is not None
        self._writer.write(json.dumps(msg, separators=(",", ":")).encode() + b"\n")


Local = Callable[[Ask], Any]
"""This process's own answer to an ask (`router_answer`)."""


def router_answer(router: Any) -> Local:
    """What one worker answers: `abort` (was the request here) and `active` (requests served here)."""

    def answer(msg: Ask) -> Any:
        if msg["op"] == "abort":
            return router.abort(str(msg["id"]))
        if msg["op"] == "active":
            return router.active
        raise ValueError(f"unknown worker ask {msg['op']!r}")

    return answer


class Siblings:
    """The other workers of this router, for the servicer: `others(ask)` is each one's answer.

    In a worker, the ask goes to the lead, which answers for itself and every other worker; in the lead,
    it goes to every worker's link at once. A worker that does not answer within the timeout (gone,
    restarting) is left out."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.lead_link: Link | None = None
        self.links: dict[int, Link] = {}
        self.local: Local | None = None

    async def others(self, msg: Ask) -> list[Any]:
        if self.lead_link is not None:
            try:
                values = await self.lead_link.ask({"op": "all", "inner": msg}, self.timeout)
            except (LinkClosed, TimeoutError):
                return []
            return list(values or [])
        return await self._fan_out(msg, skip=None)

    async def serve_worker(self, index: int, msg: Ask) -> Any:
        """The lead's answer to worker `index`: to `all`, its own answer and every other worker's."""
        if msg["op"] != "all":
            raise ValueError(f"unknown lead ask {msg['op']!r}")
        inner = msg["inner"]
        assert self.local is not None
        return [self.local(inner), *await self._fan_out(inner, skip=index)]

    async def serve_lead(self, msg: Ask) -> Any:
        """A worker's answer to the lead."""
        assert self.local is not None
        return self.local(msg)

    async def _fan_out(self, msg: Ask, skip: int | None) -> list[Any]:
        links = [link for i, link in self.links.items() if i != skip and not link.closed.is_set()]
        answers = await asyncio.gather(
            *(link.ask(msg, self.timeout) for link in links), return_exceptions=True
        )
        return [a for a in answers if not isinstance(a, BaseException)]


class _Child:
    """A worker process, started with posix_spawn and awaited through a pidfd.

    Not fork: the lead runs gRPC's threads, and a fork of it runs gRPC's fork handlers in the child,
    which abort it (c-ares' resolver) before it can exec."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], keep_fd: int) -> None:
        os.set_inheritable(keep_fd, True)  # the one descriptor the worker inherits beside stdio
        try:
            self.pid = os.posix_spawn(argv[0], list(argv), env)
        finally:
            os.set_inheritable(keep_fd, False)
        self.returncode: int | None = None
        loop = asyncio.get_running_loop()
        self._done: asyncio.Future[int] = loop.create_future()
        self._pidfd = os.pidfd_open(self.pid)
        loop.add_reader(self._pidfd, self._reap)

    def _reap(self) -> None:
        asyncio.get_running_loop().remove_reader(self._pidfd)
        os.close(self._pidfd)
        try:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        except ChildProcessError:  # reaped by another waiter: its status is lost, not its end
            self.returncode = -1
        self._done.set_result(self.returncode)

    async def wait(self) -> int:
        return await asyncio.shield(self._done)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # not reaped yet: the pid is still this process's
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@dataclass
class _Worker:
    index: int
    proc: _Child
    link: Link
    reader: asyncio.Task[None]
    metrics: str | None


class Merged:
    """The lead's `/metrics`: its own metrics and every running worker's, each sample labelled with the
    process it came from (`worker`, 0 for the lead), so one scrape of the router's metrics address sees
    the whole router (`sum without (worker)` adds the processes up). A worker's metrics are read from its
    own `/metrics` at each scrape; one that does not answer (restarting) is left out of that scrape."""

    def __init__(
        self, own: CollectorRegistry, workers: Callable[[], dict[int, str]], timeout: float = 2.0
    ) -> None:
        self.own = own
        self.workers = workers
        self.timeout = timeout

    def describe(self) -> list[Metric]:
        """The names served (every process runs the same code: the lead's), for a scrape that asks for some
        by name (`name[]`)."""
        return list(self.own.collect())

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}

        def add(found: Iterable[Metric], worker: int) -> None:
            for family in found:
                merged = families.get(family.name)
                if merged is None:
                    merged = Metric(family.name, family.documentation, family.type, family.unit)
                    families[family.name] = merged
                label = str(worker)
                merged.samples += [s._replace(labels={**s.labels, "worker": label}) for s in family.samples]

        # The lead's own through the text format too, so that its families split as the workers' do
        # (a counter's `_created` samples, for one, come back as a family of their own).
        add(text_string_to_metric_families(generate_latest(self.own).decode()), 0)
        for index, address in sorted(self.workers().items()):
            try:
                with urllib.request.urlopen(f"http://{address}/metrics", timeout=self.timeout) as resp:
                    text = resp.read().decode()
            except OSError:
                continue
            add(text_string_to_metric_families(text), index)
        yield from families.values()


def merged_registry(own: CollectorRegistry, workers: Callable[[], dict[int, str]]) -> CollectorRegistry:
    """A registry that collects `Merged`: what the lead's /metrics serves."""
    registry = CollectorRegistry()
    registry.register(Merged(own, workers))
    return registry


class Workers:
    """The lead's side: starts workers 1..N-1 on the lead's bound addresses, keeps them running, stops them.

    `argv` is the lead's own command line; each worker runs it again with its addresses, ready file and
    metrics address set, and the hidden `--worker-index` and `--worker-link` flags."""

    def __init__(self, config: RouterConfig, argv: Sequence[str], siblings: Siblings) -> None:
        self.config = config
        self.argv = list(argv)
        self.siblings = siblings
        self.grpc = ""
        self.http = ""
        self._dir = Path(tempfile.mkdtemp(prefix="xavier-router-workers-"))
        self._workers: dict[int, _Worker] = {}
        self._keepers: list[asyncio.Task[None]] = []
        self._stopping = False
        self.restarts = Counter(
            "xavier_router_worker_restarts",
            "Router workers that exited while their lead ran and were started again.",
            registry=get_registry(),
        )

    async def start(self, grpc_address: str, http_address: str) -> list[dict[str, Any]]:
        """Starts every worker and waits until each is ready; returns their ready-file entries."""
        self.grpc, self.http = grpc_address, http_address
        started = await asyncio.gather(
            *(self._start(i) for i in range(1, self.config.workers)), return_exceptions=True
        )
        failed = [w for w in started if isinstance(w, BaseException)]
        for w in started:
            if isinstance(w, _Worker):
                self._workers[w.index] = w
                self._keepers.append(asyncio.ensure_future(self._keep(w.index)))
        if failed:
            await self.stop(self.config.grace_seconds)
            raise failed[0]
        return self.entries()

    def metrics(self) -> dict[int, str]:
        """Each running worker's metrics address (read from the metrics server's thread: a snapshot)."""
        return {w.index: w.metrics for w in list(self._workers.values()) if w.metrics}

    def entries(self) -> list[dict[str, Any]]:
        return [
            {"index": w.index, "pid": w.proc.pid, "metrics": w.metrics}
            for w in sorted(self._workers.values(), key=lambda w: w.index)
        ]

    def _command(self, index: int, ready: Path, link_fd: int) -> list[str]:
        metrics = ""
        if self.config.metrics_listen:
            host, _ = parse_host_port(self.config.metrics_listen)
            metrics = f"{host}:0"
        return [
            sys.executable, "-m", "xavier_services.router.main", *self.argv,
            "--listen", self.grpc, "--http", self.http, "--ready-file", str(ready),
            "--metrics-listen", metrics, "--worker-index", str(index), "--worker-link", str(link_fd),
        ]  # fmt: skip

    async def _start(self, index: int) -> _Worker:
        ready = self._dir / f"worker-{index}.json"
        ready.unlink(missing_ok=True)
        ours, theirs = socket.socketpair()
        # Only the lead may tell systemd anything (NotifyAccess=main).
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NOTIFY_SOCKET", "WATCHDOG_"))}
        try:
            proc = _Child(self._command(index, ready, theirs.fileno()), env, theirs.fileno())
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        link = Link(ours, functools.partial(self.siblings.serve_worker, index))
        reader = asyncio.ensure_future(link.run())
        self.siblings.links[index] = link
        try:
            info = await self._ready(index, proc, ready)
        except BaseException:
            link.close()
            proc.kill()
            await proc.wait()
            raise
        _log.info("router worker ready", index=index, pid=proc.pid)
        return _Worker(index, proc, link, reader, info.get("metrics"))

    async def _ready(self, index: int, proc: _Child, ready: Path) -> dict[str, Any]:
        deadline = asyncio.get_running_loop().time() + READY_SECONDS
        while (info := _read_ready(ready)) is None:
            if proc.returncode is not None:
                raise RuntimeError(f"router worker {index} exited with code {proc.returncode} before ready")
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"router worker {index} was not ready within {READY_SECONDS:.0f} s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 0.05)
        return info

    async def _keep(self, index: int) -> None:
        """Starts worker `index` again whenever it exits while the lead runs."""
        pause = RESTART_SECONDS[0]
        while True:
            worker = self._workers[index]
            code = await worker.proc.wait()
            worker.link.close()
            if self._stopping:
                return
            _log.error("router worker exited; starting it again", index=index, code=code, pid=worker.proc.pid)
            self.restarts.inc()
            while not self._stopping:
                await asyncio.sleep(pause)
                try:
                    self._workers[index] = await self._start(index)
                    pause = RESTART_SECONDS[0]
                    break
                except Exception as exc:
                    _log.error("router worker did not start", index=index, error=str(exc))
                    pause = min(pause * 2, RESTART_SECONDS[1])

    async def stop(self, grace: float) -> None:
        """SIGTERM to every worker; each has `grace` to drain, then SIGKILL."""
        self._stopping = True
        for task in self._keepers:
            task.cancel()
        workers = list(self._workers.values())
        for w in workers:
            w.proc.send_signal(signal.SIGTERM)
        done = await asyncio.gather(
            *(asyncio.wait_for(w.proc.wait(), grace) for w in workers), return_exceptions=True
        )
        for w, result in zip(workers, done, strict=True):
            if isinstance(result, BaseException) and w.proc.returncode is None:
                _log.warning("router worker did not stop within its grace", index=w.index)
                w.proc.kill()
                await w.proc.wait()
            w.link.close()
            w.reader.cancel()
        for path in self._dir.glob("*"):
            path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self._dir.rmdir()


def _read_ready(path: Path) -> dict[str, Any] | None:
    """A worker's ready file, once written (it is replaced whole, never seen half-written)."""
    try:
        return dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None


def join_lead(link_fd: int, siblings: Siblings, on_lost: Callable[[], None]) -> asyncio.Task[None]:
    """A worker's side: reads the lead's link (answering its asks) and calls `on_lost` when it closes."""
    link = Link(socket.socket(fileno=link_fd), siblings.serve_lead)
    siblings.lead_link = link

    async def run() -> None:
        await link.run()
        _log.warning("router lead is gone; this worker stops")
        on_lost()

    return asyncio.ensure_future(run())
