"""KV pools shaped like an engine's (per layer a K and a V buffer) and a source process for tests."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import numpy as np
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from xavier_core.transfer import (
    KvBuffer,
    KvManager,
    KvPoll,
    KvPort,
    KvReceiver,
    NixlAgent,
    SourceInfo,
    endpoint_proto,
)

_T = TypeVar("_T")

LAYERS, HEADS, HEAD_DIM, PAGE_SIZE, PAGES = 4, 2, 64, 16, 64


def make_pool(seed: int | None, pages: int = PAGES, dtype: str = "float16") -> list[np.ndarray]:
    """2*LAYERS buffers [pages*PAGE_SIZE, HEADS, HEAD_DIM]; random bytes from `seed`, zeros if None."""
    shape = (pages * PAGE_SIZE, HEADS, HEAD_DIM)
    if seed is None:
        return [np.zeros(shape, dtype=dtype) for _ in range(2 * LAYERS)]
    rng = np.random.default_rng(seed)
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return [
        rng.integers(0, 256, nbytes, dtype=np.uint8).view(dtype).reshape(shape) for _ in range(2 * LAYERS)
    ]


def kv_buffers(pool: list[np.ndarray]) -> list[KvBuffer]:
    return [KvBuffer(a.ctypes.data, a.nbytes, a.nbytes // (a.shape[0] // PAGE_SIZE), "cpu") for a in pool]


def page_bytes(pool: list[np.ndarray], pages: list[int]) -> list[bytes]:
    """Per buffer, the bytes of `pages` in order (what a reader must end up with)."""
    return [a.reshape(-1, PAGE_SIZE * HEADS * HEAD_DIM)[pages].tobytes() for a in pool]


def _serve(conn: Connection, name: str, seed: int) -> None:
    from xavier_core.transfer import KvSender

    pool = make_pool(seed)
    bufs = kv_buffers(pool)
    agent = NixlAgent(name, bufs, progress_thread=False)
    manager = KvManager(agent, bufs, PAGE_SIZE)
    senders: dict[str, KvSender] = {}
    polling = True
    conn.send(("ready", os.getpid()))
    while True:
        if conn.poll(0.0005 if polling else 0.02):
            cmd, *args = conn.recv()
            if cmd == "stop":
                break
            if cmd == "polling":
                polling = bool(args[0])
                reply: Any = polling
            elif cmd == "publish":
                room, pages = args
                sender = senders[room] = KvSender(manager, room)
                sender.init(len(pages))
                info = sender.send(pages)
                endpoint = endpoint_proto(info.agent_name, info.metadata, info.buffers)
                reply = (info.to_proto().SerializeToString(), endpoint.SerializeToString())
            elif cmd == "state":
                s = senders[args[0]]
                reply = (s.poll().name, s.in_flight(), s.error)
            elif cmd == "mark_complete":
                senders[args[0]].mark_complete()
                reply = senders[args[0]].poll().name
            else:
                reply = f"unknown command {cmd}"
            conn.send(reply)
        if polling:
            manager.progress()
    agent.close()
    conn.send("closed")


@dataclass
class Source:
    """A source process (prefill-like) holding a pool filled from `seed`; driven over a pipe."""

    conn: Connection
    proc: mp.process.BaseProcess
    pid: int
    pool: list[np.ndarray]

    def call(self, *cmd: Any, timeout: float = 10.0) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"source did not answer {cmd[0]!r}")
        return self.conn.recv()

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.proc.join(5)


@contextlib.contextmanager
def source_process(name: str, seed: int) -> Iterator[Source]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child, name, seed), daemon=True)
    proc.start()
    if not parent.poll(30):
        proc.kill()
        raise TimeoutError("source process did not start")
    _, pid = parent.recv()
    src = Source(parent, proc, pid, make_pool(seed))
    try:
        yield src
    finally:
        if proc.is_alive():
            with contextlib.suppress(OSError, TimeoutError):
                src.call("stop", timeout=5)
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def poll_until(fn: Callable[[], _T], want: Container[_T], timeout: float = 10.0) -> _T:
    deadline = time.monotonic() + timeout
    while (got := fn()) not in want:
        if time.monotonic() > deadline:
            raise AssertionError(f"still {got} after {timeout}s (wanted {want})")
        time.sleep(0.001)
    return got


def publish(source: Source, room: str, pages: list[int]) -> SourceInfo:
    desc, endpoint = source.call("publish", room, pages)
    return SourceInfo.from_proto(
        dpb.SourceDescriptor.FromString(desc), types_pb2.TransferEndpoint.FromString(endpoint)
    )


@contextlib.contextmanager
def reader_manager(name: str, pool: list[np.ndarray], *, read_end_agent: bool) -> Iterator[KvManager]:
    """A reading side over `pool`: its agent (no progress thread) and KV manager, closed after."""
    bufs = kv_buffers(pool)
    agent = NixlAgent(name, bufs, progress_thread=False, read_end_agent=read_end_agent)
    try:
        yield KvManager(agent, bufs, PAGE_SIZE)
    finally:
        agent.close()


def receive(manager: KvManager, room: str, dest: list[int]) -> KvReceiver:
    rx = KvReceiver(manager, room)
    rx.init()
    assert rx.poll() == KvPoll.BOOTSTRAPPING
    rx.send_metadata(dest)
    assert rx.poll() == KvPoll.WAITING_FOR_INPUT
    return rx


async def serve_port(
    conn: Connection,
    port: KvPort,
    host_id: str,
    wait_s: float = 10,
    extra: dict[str, Callable[..., Any]] | None = None,
) -> None:
    """A source process's command loop over `port`: publish, wait, unpublish (and `extra` commands,
    answered with their return value) until ("stop",); closes the port."""
    conn.send("ready")
    while True:
        cmd, *args = await asyncio.to_thread(conn.recv)
        reply: Any = None
        if cmd == "stop":
            break
        if cmd == "publish":
            desc = await port.publish(args[0], args[1], "fp")
            reply = (desc.SerializeToString(), port.endpoint(host_id).SerializeToString())
        elif cmd == "wait":
            reply = await port.wait_read_end(args[0], wait_s)
        elif cmd == "unpublish":
            await port.unpublish(args[0], completed=args[1])
            reply = (port.published, port.totals.transfers)
        else:
            reply = (extra or {})[cmd](*args)
        conn.send(reply)
    await port.close()
    conn.send("closed")


@contextlib.contextmanager
def spawned(
    target: Callable[..., None], *args: Any, start_s: float = 60, stop_s: float = 10
) -> Iterator[Connection]:
    """Runs `target(conn, *args)` in a spawned process that sends "ready" once up and ends on ("stop",);
    yields this side's end of the pipe, and kills the process if it does not stop."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    try:
        if not parent.poll(start_s):
            raise TimeoutError("source process did not start")
        assert parent.recv() == "ready"
        yield parent
    finally:
        with contextlib.suppress(OSError):
            parent.send(("stop",))
            parent.poll(stop_s)
        proc.join(stop_s)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
