"""A router of several processes on one pair of addresses (`router.workers`, `router/workers.py`).

The workers' link (real socketpairs, in one loop) and the lead's /metrics over every process's (real metrics
servers), then a two-process router against the shared mesh:
the kernel spreads connections over both, an Abort and the status reach every worker whichever one the
caller's connection landed on, a killed worker is started again, and the workers stop with their lead.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter
from xavier.v1 import router_service_pb2 as rpb
from xavier.v1 import router_service_pb2_grpc as rpb_grpc
from xavier_client import Client
from xavier_services.router.config import RouterConfig
from xavier_services.router.workers import (
    Link,
    LinkClosed,
    Siblings,
    check_ports_free,
    merged_registry,
    share,
)

from tests.cli.mesh import Mesh
from tests.support.procs import ServiceProc, start_service
from xavier_core.runtime import ConfigError, load_config
from xavier_core.runtime.metrics import start_metrics_server

# --- the link, in one loop ------------------------------------------------------------------------------


class _Held:
    """What a worker's router answers: which request ids it serves."""

    def __init__(self, *ids: str) -> None:
        self.ids = set(ids)

    def __call__(self, msg: dict[str, object]) -> object:
        if msg["op"] == "abort":
            found = msg["id"] in self.ids
            self.ids.discard(str(msg["id"]))
            return found
        return len(self.ids)


async def _router_of_three() -> tuple[Siblings, list[Siblings], list[asyncio.Task[None]]]:
    lead = Siblings(timeout=2.0)
    lead.local = _Held("on-lead")
    workers, tasks = [], []
    for index, held in ((1, _Held("on-1", "also-on-1")), (2, _Held())):
        ours, theirs = socket.socketpair()
        worker = Siblings(timeout=2.0)
        worker.local = held
        worker.lead_link = Link(theirs, worker.serve_lead)

        async def serve(msg: dict[str, object], index: int = index) -> object:
            return await lead.serve_worker(index, msg)

        lead.links[index] = Link(ours, serve)
        tasks += [asyncio.ensure_future(link.run()) for link in (lead.links[index], worker.lead_link)]
        workers.append(worker)
    return lead, workers, tasks


def test_an_ask_reaches_every_other_worker_through_the_lead() -> None:
    async def main() -> None:
        lead, (one, two), tasks = await _router_of_three()
        # From worker 2: the lead answers for itself and worker 1.
        assert sorted(await two.others({"op": "abort", "id": "on-1"})) == [False, True]
        assert await two.others({"op": "abort", "id": "on-1"}) == [False, False]  # gone once aborted
        assert sorted(await two.others({"op": "abort", "id": "on-lead"})) == [False, True]
        assert sorted(await one.others({"op": "active"})) == [0, 0]
        # From the lead: each worker, not itself.
        assert sorted(await lead.others({"op": "active"})) == [0, 1]
        # Worker 1's link closes: its asks fail at once, and the others leave it out.
        one.lead_link.close()  # type: ignore[union-attr]
        await asyncio.wait_for(lead.links[1].closed.wait(), 2)
        assert await one.others({"op": "active"}) == []
        assert await two.others({"op": "abort", "id": "also-on-1"}) == [False]
        with pytest.raises(LinkClosed):
            await lead.links[1].ask({"op": "active"}, 1.0)
        for task in tasks:
            task.cancel()

    asyncio.run(main())


def test_the_limits_are_split_between_the_workers_and_the_key_is_checked() -> None:
    one = share(
        RouterConfig(workers=3, max_inflight_requests=256, max_queued_requests=0, http_max_connections=10)
    )
    assert (one.max_inflight_requests, one.max_queued_requests, one.http_max_connections) == (86, 0, 4)
    assert share(RouterConfig()) == RouterConfig()
    with pytest.raises(ConfigError) as info:
        load_config(RouterConfig, env={"XAVIER_WORKERS": "0"})
    assert [key for key, _, _ in info.value.issues] == ["workers"]


def test_the_leads_metrics_hold_every_process_each_sample_labelled() -> None:
    lead, worker = CollectorRegistry(), CollectorRegistry()
    Counter("xavier_router_requests", "r", ("mode",), registry=lead).labels("pd").inc(2)
    Counter("xavier_router_requests", "r", ("mode",), registry=worker).labels("pd").inc(5)
    Counter("xavier_router_worker_restarts", "w", registry=lead).inc()
    served = start_metrics_server("127.0.0.1:0", worker)
    shown = start_metrics_server("127.0.0.1:0", lead)
    with socket.socket() as gone:  # a worker restarting: its old address answers nothing
        gone.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{gone.getsockname()[1]}"
    try:
        shown.serve(merged_registry(lead, lambda: {1: served.address, 2: dead}))
        with urllib.request.urlopen(f"http://{shown.address}/metrics", timeout=10) as resp:
            page = resp.read().decode()
        with urllib.request.urlopen(
            f"http://{shown.address}/metrics?name[]=xavier_router_requests_total", timeout=10
        ) as resp:
            asked = resp.read().decode()
    finally:
        shown.close()
        served.close()
    assert 'xavier_router_requests_total{mode="pd",worker="0"} 2.0' in page
    assert 'xavier_router_requests_total{mode="pd",worker="1"} 5.0' in page
    assert 'xavier_router_worker_restarts_total{worker="0"} 1.0' in page
    types = re.findall(r"^# TYPE (\S+)", page, re.M)
    assert len(types) == len(set(types)), types  # one family per name, however many processes
    assert 'worker="2"' not in page
    assert 'xavier_router_requests_total{mode="pd",worker="1"} 5.0' in asked and "restarts" not in asked


def test_a_lead_refuses_a_port_another_socket_shares() -> None:
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(ConfigError) as info:
            check_ports_free(RouterConfig(workers=2, listen=f"127.0.0.1:{port}", http_listen="127.0.0.1:0"))
        assert [key for key, _, _ in info.value.issues] == ["listen"]


# --- two processes against the shared mesh --------------------------------------------------------------


def _start(mesh: Mesh, workdir: Path) -> ServiceProc:
    args = ["--model", str(mesh.model), "--directory", mesh.directory, "--mode", "pd"]
    args += ["--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--workers", "2"]
    return start_service("xavier-router", args, workdir, name="router", timeout=120)


def _info(proc: ServiceProc) -> dict[str, object]:
    return dict(json.loads((proc.log_path.parent / "router.ready").read_text()))


def _requests(metrics: str) -> float:
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as resp:
        page = resp.read().decode()
    return sum(float(v) for v in re.findall(r"^xavier_router_requests_total\{[^}]*\} (\S+)$", page, re.M))


def _by_process(metrics: str) -> dict[str, float]:
    """The requests of each process of a router, as its lead's /metrics labels them (`worker`)."""
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as resp:
        page = resp.read().decode()
    out: dict[str, float] = {}
    for labels, value in re.findall(r"^xavier_router_requests_total\{([^}]*)\} (\S+)$", page, re.M):
        worker = re.search(r'worker="(\d+)"', labels)
        assert worker is not None, labels  # every sample says which process it came from
        out[worker.group(1)] = out.get(worker.group(1), 0.0) + float(value)
    return out


def _worker_pids(lead: int) -> list[int]:
    """The lead's children that are router workers (the tokenizer's helper process is not)."""
    pids = []
    for child in Path(f"/proc/{lead}/task/{lead}/children").read_text().split():
        try:
            if b"--worker-index" in Path(f"/proc/{child}/cmdline").read_bytes():
                pids.append(int(child))
        except FileNotFoundError:
            pass
    return pids


def _alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def _complete(http: str, mesh: Mesh, n: int) -> None:
    """`n` completions, each on a connection of its own (the kernel picks a worker per connection)."""
    body = {"model": mesh.model.name, "prompt": "Spread me", "max_tokens": 4, "ignore_eos": True}
    for _ in range(n):
        with httpx.Client(timeout=30) as client:
            r = client.post(f"http://{http}/v1/completions", json=body)
            assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def router(mesh: Mesh, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProc]:
    proc = _start(mesh, tmp_path_factory.mktemp("workers"))
    yield proc
    assert proc.stop(timeout=30) == 0


@pytest.mark.integration
def test_both_workers_serve_connections_to_the_one_address(router: ServiceProc, mesh: Mesh) -> None:
    info = _info(router)
    _complete(str(info["http"]), mesh, 24)
    (worker,) = info["workers"]  # type: ignore[misc]
    # The lead's /metrics holds every process's, each labelled; the worker's own holds its alone.
    counts = _by_process(router.metrics)
    assert sorted(counts) == ["0", "1"] and sum(counts.values()) == 24, counts
    assert all(c > 0 for c in counts.values()), counts  # 24 connections all on one of two workers: 2**-23
    assert _requests(worker["metrics"]) == counts["1"]


class _Own:
    """RouterService calls on a TCP connection of their own (gRPC's channels otherwise share one per
    address within a process), which the kernel gives either worker."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        self.stub = rpb_grpc.RouterServiceStub(self.channel)

    def __enter__(self) -> rpb_grpc.RouterServiceStub:
        return self.stub

    def __exit__(self, *exc: object) -> None:
        self.channel.close()


@pytest.mark.integration
def test_an_abort_and_the_status_reach_every_worker(router: ServiceProc, mesh: Mesh) -> None:
    # Over six requests, a status and an abort that miss the serving worker are all but certain.
    for n in range(6):
        with Client(router.address) as client:
            stream = client.generate_stream(f"Long answer {n}", max_tokens=4000, mode="pd", ignore_eos=True)
            chunks = iter(stream)
            assert next(chunks).token_ids
            with _Own(router.address) as other:
                assert other.GetClusterStatus(rpb.GetClusterStatusRequest(), timeout=10).requests_active == 1
            with _Own(router.address) as other:
                assert other.Abort(rpb.AbortRequest(request_id=stream.request_id), timeout=10).found
            assert [c.finish_reason for c in chunks][-1] == "abort"
            with _Own(router.address) as other:
                assert not other.Abort(rpb.AbortRequest(request_id=stream.request_id), timeout=10).found
    with Client(router.address) as probe:
        deadline = time.monotonic() + 20
        while probe.cluster_status().requests_active:
            assert time.monotonic() < deadline
            time.sleep(0.1)


@pytest.mark.integration
def test_a_killed_worker_is_started_again(router: ServiceProc, mesh: Mesh) -> None:
    info = _info(router)
    (old,) = _worker_pids(router.proc.pid)
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 90
    while True:
        pids = _worker_pids(router.proc.pid)
        if pids and pids != [old] and "router worker ready" in router.log().split("exited; starting it")[-1]:
            break
        assert time.monotonic() < deadline, router.log()
        time.sleep(0.2)
    _complete(str(info["http"]), mesh, 16)
    assert router.proc.poll() is None
    with urllib.request.urlopen(f"http://{router.metrics}/metrics", timeout=10) as resp:
        assert 'xavier_router_worker_restarts_total{worker="0"} 1.0' in resp.read().decode()
    assert _by_process(router.metrics).get("1", 0) > 0  # the new worker's, from its new metrics address


@pytest.mark.integration
def test_the_workers_stop_with_their_lead(mesh: Mesh, tmp_path: Path) -> None:
    lead = _start(mesh, tmp_path / "term")
    (worker,) = _worker_pids(lead.proc.pid)
    assert lead.stop(timeout=30) == 0
    assert not _alive(worker)
    # A lead that is killed leaves its workers their link's end: they drain and exit.
    lead = _start(mesh, tmp_path / "kill")
    (worker,) = _worker_pids(lead.proc.pid)
    lead.kill()
    deadline = time.monotonic() + 30
    while _alive(worker):
        assert time.monotonic() < deadline, "a worker outlived its lead"
        time.sleep(0.1)
