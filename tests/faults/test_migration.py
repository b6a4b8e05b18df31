"""Request migration through a real router: a decode killed (kill -9) or stopped (SIGSTOP) mid-stream.

1 prefill + 2 decodes + routers, all processes on loopback. A migrated stream must complete with no token
lost or repeated: what follows its seam (the `migrations` field of the router's request line says where)
equals a fresh run of prompt + the tokens before it (greedy, or seeded at the advanced seed), and its text
equals the detokenized answer. The limit, a move with no pair left, a client cancel during a move and
the opt-out each end with a clear status; after every test every counter on every service is 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
import pytest
from xavier.v1 import router_service_pb2 as rpb
from xavier.v1 import router_service_pb2_grpc as rpb_grpc
from xavier.v1 import types_pb2

from tests.faults.conftest import Router, metric_values, metrics_page, start_router
from tests.faults.migration_mesh import (
    DECODES,
    MIGRATION_ENV,
    MigrationMesh,
    Streamed,
    fresh,
    idle,
    migration_mesh,
    migrations,
    prompt_ids,
    request,
    serving_decode,
    stream,
    when,
)
from xavier_core.runtime.errors import XavierError, from_rpc_error
from xavier_core.sampling import advance_seed

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def mig(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MigrationMesh]:
    with migration_mesh(tiny_model, tmp_path_factory.mktemp("migration")) as m:
        yield m


async def test_kill_a_decode_under_16_streams_loses_no_token(mig: MigrationMesh) -> None:
    # A round whose kill lands after the killed decode sent its streams' last tokens (the router and the
    # client may read far behind a decode on a loaded machine) moves nothing: it still checks every
    # answer, and the next round kills again. One of three rounds must move a stream.
    for rnd in range(3):
        await both_decodes_selected(mig, f"kill-{rnd}")  # the router may know one decode so far
        rng = random.Random(22 + rnd)
        first, at = rng.choice(DECODES), rng.randrange(16 * 4, 16 * 40)
        killed: list[str] = []
        try:
            prefer = [first, *(d for d in DECODES if d != first)]
            if await _kill_under_16_streams(mig, f"kill-{rnd}", prefer, at, killed):
                return
        finally:  # the tests after this one need both decodes, whatever happened here
            for victim in killed:
                mig.restart(victim)
    raise AssertionError("in 3 rounds no stream was on the killed decode when it died")


async def _kill_under_16_streams(
    mig: MigrationMesh, tag: str, prefer: list[str], at: int, killed: list[str]
) -> int:
    """One round: 16 streams, a decode killed mid-way, every answer checked; the number of streams moved."""
    n, max_tokens = 16, 400
    prompts = [prompt_ids(100 + i) for i in range(n)]
    # The kill waits until every stream has a decode token at the client (from there on a broken stream
    # migrates; before, it fails over), and until the router, which the client reads behind, has
    # streamed at least `at` tokens in all (a seeded point; with 400 tokens a stream every stream is
    # still mid-stream then).
    decoding: set[str] = set()

    def seen(s: Streamed) -> None:
        if len(s.tokens) >= 2:
            decoding.add(s.request_id)

    async def sent() -> float:
        page = await metrics_page(mig.router.proc.metrics)
        return sum(metric_values(page, "xavier_router_output_tokens_total").values())

    base = await sent()

    async def killer() -> None:
        for _ in range(6000):
            if len(decoding) == n and await sent() - base >= at:
                # The seeded decode if it runs a stream now, else the other: the router may have put
                # all 16 on one decode, and a kill of an idle one would test nothing.
                victim = await serving_decode(mig.mesh, prefer=prefer)
                killed.append(victim)
                mig.mesh.procs[victim].kill()  # kill -9, reaped
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the streams never reached the kill point")

    kill = asyncio.ensure_future(killer())
    outs = await asyncio.gather(
        *(stream(mig.router.grpc, request(f"{tag}-{i}", p, max_tokens), seen) for i, p in enumerate(prompts))
    )
    await kill
    moved = migrations(mig.router)
    whole_equal = 0
    for i, (ids, out) in enumerate(zip(prompts, outs, strict=True)):
        assert out.error is None, out.error
        assert len(out.tokens) == max_tokens and out.finish == types_pb2.FINISH_REASON_LENGTH, out
        assert out.usage is not None and out.usage.completion_tokens == max_tokens
        assert out.text == mig.text(ids, out.tokens), i  # text continues exactly over the seam
        seams = [m.at for m in moved.get(out.request_id, [])]
        for seam in seams:
            after = await fresh(mig, ids + out.tokens[:seam], max_tokens - seam)
            assert out.tokens[seam:] == after.tokens, (i, seam)
        whole = (await fresh(mig, ids, max_tokens)).tokens
        assert seams or out.tokens == whole, i  # an unmoved stream (a failover at most) is the plain run
        whole_equal += out.tokens == whole
    n_moved = sum(1 for o in outs if o.request_id in moved)
    if not n_moved:
        await idle(mig)
        return 0
    every = [m for ms in moved.values() for m in ms]
    assert all(m.cause == "unavailable" and m.cached is not None and m.seam_s is not None for m in every)
    seams_ms = sorted(round(1000 * (m.seam_s or 0), 1) for m in every)
    print(
        f"migrated {n_moved}/{n} streams; whole answers equal to an uninterrupted run: {whole_equal}/{n}; "
        f"seam ms {seams_ms}; cached/new prompt {[(m.cached, m.prompt) for m in every]}"
    )
    page = await metrics_page(mig.router.proc.metrics)
    assert metric_values(page, 'xavier_router_migrations_total{cause="unavailable"}'), page
    await idle(mig)
    return n_moved


async def test_seeded_stream_continues_at_the_advanced_seed(mig: MigrationMesh) -> None:
    ids, max_tokens, seed = prompt_ids(7), 300, 1234
    sampling = {"temperature": 1.0, "seed": seed}
    at = random.Random(5).randrange(3, 30)
    got = asyncio.Event()
    task = asyncio.ensure_future(
        stream(
            mig.router.grpc,
            request("seeded", ids, max_tokens, **sampling),
            lambda s: got.set() if len(s.tokens) >= at else None,
        )
    )
    victim = await serving_decode(mig.mesh)
    await got.wait()
    mig.mesh.procs[victim].kill()  # kill -9, reaped
    out = await task
    assert out.error is None and len(out.tokens) == max_tokens, out
    [move] = migrations(mig.router)["seeded"]
    seam = move.at
    assert move.cause == "unavailable" and seam >= at
    after = await fresh(
        mig, ids + out.tokens[:seam], max_tokens - seam, temperature=1.0, seed=advance_seed(seed, seam)
    )
    assert out.tokens[seam:] == after.tokens
    whole = await fresh(mig, ids, max_tokens, **sampling)
    print(f"seeded: seam at {seam}; equal to the uninterrupted seeded run: {out.tokens == whole.tokens}")
    await idle(mig)
    mig.restart(victim)


async def test_sigstop_a_decode_mid_stream_migrates(mig: MigrationMesh) -> None:
    n, max_tokens = 6, 400
    started = [asyncio.Event() for _ in range(n)]
    tasks = [
        asyncio.ensure_future(
            stream(
                mig.router.grpc,
                request(f"stop-{i}", prompt_ids(300 + i), max_tokens),
                lambda s, i=i: started[i].set() if len(s.tokens) >= 3 else None,
            )
        )
        for i in range(n)
    ]
    for ev in started:
        await ev.wait()
    victim = await serving_decode(mig.mesh)
    os.kill(mig.mesh.procs[victim].proc.pid, signal.SIGSTOP)
    try:
        outs = await asyncio.gather(*tasks)  # with no migration these would wait 20 s and fail
    finally:
        os.kill(mig.mesh.procs[victim].proc.pid, signal.SIGCONT)
    moved = migrations(mig.router)
    for i, out in enumerate(outs):
        assert out.error is None and len(out.tokens) == max_tokens, out
        assert out.text == mig.text(prompt_ids(300 + i), out.tokens)
    stalled = [o for o in outs if any(m.cause == "stalled" for m in moved.get(o.request_id, []))]
    assert stalled, moved
    seams = [m.seam_s for o in stalled for m in moved[o.request_id]]
    print(f"SIGSTOP: {len(stalled)}/{n} streams moved; seam s after the deadline {seams}")
    await idle(mig)


def _decodes_of(router: Router, request_ids: set[str]) -> list[str]:
    """The decode of each of `request_ids` that completed, from the router's request lines."""
    out = []
    for line in router.proc.log().splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            if event.get("event") == "request" and event.get("request_id") in request_ids:
                out += [
                    p.split(":", 1)[1]
                    for p in str(event.get("peers", "")).split(",")
                    if p.startswith("decode:")
                ]
    return out


async def both_decodes_selected(mig: MigrationMesh, tag: str) -> None:
    """Waits until both decodes are back in selection after the tests before (restarts, stops): each
    serves a request."""
    for attempt in range(60):
        rids = [f"warm-{tag}-{attempt}-{i}" for i in range(4)]
        await asyncio.gather(*(stream(mig.router.grpc, request(r, prompt_ids(690), 2)) for r in rids))
        if set(_decodes_of(mig.router, set(rids))) == set(DECODES):
            return
        await asyncio.sleep(0.5)
    raise AssertionError("the router never sent requests to both decodes")


async def test_a_decode_stalled_before_its_first_token_fails_over(mig: MigrationMesh) -> None:
    """A decode stopped (SIGSTOP) before any request on it streamed a decode token: each of those
    requests fails over to the other decode after the progress deadline (2 s here), as a dead peer's
    would, instead of waiting the overall progress deadline (20 s here) and failing."""
    await both_decodes_selected(mig, "stalled")
    victim = DECODES[0]
    os.kill(mig.mesh.procs[victim].proc.pid, signal.SIGSTOP)
    try:
        # Sent at once, well within the victim's directory lease: selection still alternates onto it.
        outs = await asyncio.gather(
            *(stream(mig.router.grpc, request(f"early-{i}", prompt_ids(700 + i), 12)) for i in range(6))
        )
    finally:
        os.kill(mig.mesh.procs[victim].proc.pid, signal.SIGCONT)
    for out in outs:
        assert out.error is None and len(out.tokens) == 12, out
    lines = [json.loads(x) for x in mig.router.proc.log().splitlines() if x.startswith("{")]
    failed_over = {
        e["request_id"]
        for e in lines
        if e.get("event") == "request" and victim in str(e.get("failed_peers", "")) and
        str(e.get("request_id", "")).startswith("early-")
    }  # fmt: skip
    assert failed_over, "no request was sent to the stopped decode"
    for out in outs:  # the answer is the other pair's own: the client saw nothing of the stalled one
        assert out.tokens == (await fresh(mig, prompt_ids(700 + int(out.request_id[6:])), 12)).tokens
    await idle(mig)


async def test_opt_out_gets_the_old_error(mig: MigrationMesh) -> None:
    req = request("opt-out", prompt_ids(9), 400)
    req.no_migration = True
    got = asyncio.Event()
    task = asyncio.ensure_future(
        stream(mig.router.grpc, req, lambda s: got.set() if len(s.tokens) >= 5 else None)
    )
    victim = await serving_decode(mig.mesh)
    await got.wait()
    mig.mesh.procs[victim].kill()  # kill -9, reaped
    out = await task
    assert out.error is not None and out.error.code() == grpc.StatusCode.UNAVAILABLE
    assert from_rpc_error(out.error).reason == "PEER_FAILED"
    assert "127.0.0.1" not in (out.error.details() or "")
    assert "opt-out" not in migrations(mig.router)
    await idle(mig)
    mig.restart(victim)


async def _stop_mid_stream(
    mig: MigrationMesh, address: str, rid: str
) -> tuple[asyncio.Future[Streamed], str, list[Streamed]]:
    """Starts a long stream, SIGSTOPs its decode once 3 tokens came; the stream's task, the stopped
    decode and the stream as it goes (filled at its first token)."""
    live: list[Streamed] = []

    def seen(s: Streamed) -> None:
        live[:] = [s]

    task = asyncio.ensure_future(stream(address, request(rid, prompt_ids(len(rid)), 400), seen))
    await when(lambda: bool(live) and len(live[0].tokens) >= 3)
    victim = await serving_decode(mig.mesh)
    os.kill(mig.mesh.procs[victim].proc.pid, signal.SIGSTOP)
    return task, victim, live


async def test_migration_limit_is_a_clear_error(mig: MigrationMesh) -> None:
    limited = start_router(mig.mesh, "router-limit1", **MIGRATION_ENV, XAVIER_MIGRATION_LIMIT="1")
    mig.routers.append(limited)
    task, first, live = await _stop_mid_stream(mig, limited.grpc, "limited")
    try:
        await when(lambda: "limited" in migrations_started(limited))  # moved once, to the other decode
        at = len(live[0].tokens)
        await when(lambda: len(live[0].tokens) >= at + 3)  # the new decode streams
        second = await serving_decode(mig.mesh, exclude=first)
    except BaseException:
        os.kill(mig.mesh.procs[first].proc.pid, signal.SIGCONT)
        raise
    err, out = await _failed_while_stopped(mig, task, second)
    assert err.reason == "MIGRATION_LIMIT" and err.metadata["migrations"] == "1", err
    assert len(out.tokens) > 3
    await idle(mig)


async def _failed_while_stopped(
    mig: MigrationMesh, task: asyncio.Future[Streamed], stop: str
) -> tuple[XavierError, Streamed]:
    """Stops `stop` too, reads the stream to its end, resumes both decodes; the stream's error (an
    UNAVAILABLE naming no internal address) and the stream."""
    try:
        os.kill(mig.mesh.procs[stop].proc.pid, signal.SIGSTOP)
        out = await task
    finally:
        for name in DECODES:
            os.kill(mig.mesh.procs[name].proc.pid, signal.SIGCONT)
    assert out.error is not None and out.error.code() == grpc.StatusCode.UNAVAILABLE, out
    assert "127.0.0.1" not in (out.error.details() or "")
    return from_rpc_error(out.error), out


def migrations_started(router: Router) -> set[str]:
    """Request ids the router has begun to move (its "migrating request" lines)."""
    out = set()
    for line in router.proc.log().splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            if event.get("event") == "migrating request":
                out.add(event["request_id"])
    return out


async def test_no_pair_left_is_a_clear_error(mig: MigrationMesh) -> None:
    task, victim, _ = await _stop_mid_stream(mig, mig.router.grpc, "nopair")
    other = next(n for n in DECODES if n != victim)
    err, _ = await _failed_while_stopped(mig, task, other)
    assert err.reason == "MIGRATION_FAILED" and err.metadata["peer_id"] == victim, err
    await idle(mig)


async def test_client_cancel_during_a_migration_leaks_nothing(mig: MigrationMesh) -> None:
    # Probes far apart: the stopped prefill stays in selection, so the move's re-prefill goes to it.
    slow = start_router(mig.mesh, "router-slowprobe", **MIGRATION_ENV, XAVIER_HEALTH_INTERVAL_SECONDS="600")
    mig.routers.append(slow)
    prefill = mig.mesh.procs["prefill-0"].proc.pid
    task, victim, _ = await _stop_mid_stream(mig, slow.grpc, "cancelled")
    os.kill(prefill, signal.SIGSTOP)  # the move's re-prefill cannot finish: the request is mid-move
    try:
        await when(lambda: "cancelled" in migrations_started(slow))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        os.kill(prefill, signal.SIGCONT)
        os.kill(mig.mesh.procs[victim].proc.pid, signal.SIGCONT)
    await idle(mig)
    log = [json.loads(line) for line in slow.proc.log().splitlines() if line.startswith("{")]
    [line] = [e for e in log if e.get("request_id") == "cancelled" and e.get("event") == "request"]
    assert line["status"] == "CANCELLED" and line["migrations"].startswith("stalled:"), line


async def selectable(router: Router, peer_id: str, up: bool = True, bound: float = 60.0) -> None:
    """Waits until the router has `peer_id` in selection (`up`) or out of it, by its own cluster status,
    not a log line: a peer stopped past its lease leaves the directory's list (no "out of selection" line
    if that came first) and registers under a new epoch the router never saw down (no "back" line)."""
    async with grpc.aio.insecure_channel(router.grpc) as ch:
        stub = rpb_grpc.RouterServiceStub(ch)
        for _ in range(int(bound / 0.1)):
            status = await stub.GetClusterStatus(rpb.GetClusterStatusRequest(), timeout=10)
            listed = [p for p in status.peers if p.peer_id == peer_id]
            if up and any(not p.error for p in listed):
                return
            if not up and all(p.error.startswith("out of selection") for p in listed):
                return
            await asyncio.sleep(0.1)
    raise AssertionError(f"{peer_id} never went {'back in' if up else 'out of'} selection")


@dataclass
class Sse:
    """One SSE completion stream as the client saw it."""

    text: str = ""
    chunks: int = 0
    finish: str | None = None
    usage: dict[str, int] | None = None
    error: dict[str, object] | None = None


async def sse(http: str, body: dict[str, object], started: asyncio.Event) -> Sse:
    out = Sse()
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"http://{http}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=120)
        ) as resp,
    ):
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                out.error = event["error"]
                continue
            if event.get("usage"):
                out.usage = event["usage"]
            for choice in event["choices"]:
                out.text += choice["text"]
                out.finish = choice.get("finish_reason") or out.finish
            out.chunks += 1
            if out.chunks >= 3:
                started.set()
    return out


async def test_sse_streams_migrate_and_the_opt_out_gets_an_error_event(mig: MigrationMesh) -> None:
    """Every stream starts on one decode (the other stopped meanwhile); that decode is killed once the
    other is back: the SSE streams go on with exact text and usage, the opted-out one ends with
    PEER_FAILED."""
    keep, victim = DECODES
    # Both in selection first: a decode still out after an earlier test's restart would pass the wait below.
    await both_decodes_selected(mig, "sse")
    os.kill(mig.mesh.procs[keep].proc.pid, signal.SIGSTOP)
    try:
        await selectable(mig.router, keep, up=False)
        n, max_tokens = 4, 300
        prompts = [prompt_ids(500 + i) for i in range(n)]
        starts = [asyncio.Event() for _ in range(n)]
        bodies: list[dict[str, object]] = [
            {
                "prompt": p,
                "max_tokens": max_tokens,
                "stream": True,
                "ignore_eos": True,
                "temperature": 0,
                "stream_options": {"include_usage": True},
                "user_request_id": f"sse-{i}",
                **({"xavier_migration": False} if i == n - 1 else {}),
            }
            for i, p in enumerate(prompts)
        ]
        tasks = [
            asyncio.ensure_future(sse(mig.router.http, b, e)) for b, e in zip(bodies, starts, strict=True)
        ]
        for ev in starts:
            await ev.wait()
    finally:
        os.kill(mig.mesh.procs[keep].proc.pid, signal.SIGCONT)
    await selectable(mig.router, keep)
    mig.mesh.procs[victim].kill()  # kill -9, reaped
    outs = await asyncio.gather(*tasks)
    moved = migrations(mig.router)
    for i, (ids, out) in enumerate(zip(prompts[:-1], outs[:-1], strict=True)):
        assert out.error is None and out.finish == "length", out
        assert out.usage is not None and out.usage["completion_tokens"] == max_tokens, out.usage
        [move] = moved[f"sse-{i}"]
        cause, at = move.cause, move.at
        before = (await fresh(mig, ids, at)).tokens  # what went out before the seam (greedy, unmoved)
        after = (await fresh(mig, ids + before, max_tokens - at)).tokens
        assert cause == "unavailable" and out.text == mig.text(ids, before + after), i
    opted = outs[-1]
    assert opted.error is not None and opted.error["code"] == "PEER_FAILED", opted
    assert "127.0.0.1" not in json.dumps(opted.error)
    await idle(mig)
    mig.restart(victim)


async def test_colocated_stream_migrates_to_another_unified_replica(mig: MigrationMesh) -> None:
    """The same wrapper serves colocated requests: a unified replica killed mid-stream hands its
    streams to the other replica, which re-prefills prompt + tokens sent."""
    replicas = ("unified-0", "unified-1")
    for name in replicas:
        mig.mesh.start_peer(name, "unified")
    try:
        n, max_tokens = 4, 400
        prompts = [prompt_ids(700 + i) for i in range(n)]
        starts = [asyncio.Event() for _ in range(n)]

        def req(i: int) -> rpb.GenerateRequest:
            r = request(f"co-{i}", prompts[i], max_tokens)
            r.mode = rpb.ROUTING_MODE_COLOCATED
            return r

        tasks = [
            asyncio.ensure_future(
                stream(
                    mig.router.grpc, req(i), lambda s, i=i: starts[i].set() if len(s.tokens) >= 3 else None
                )
            )
            for i in range(n)
        ]
        for ev in starts:
            await ev.wait()
        victim = await serving_decode(mig.mesh, prefer=list(replicas))
        mig.mesh.procs[victim].kill()  # kill -9, reaped
        outs = await asyncio.gather(*tasks)
        moved = migrations(mig.router)
        for i, out in enumerate(outs):
            assert out.error is None and len(out.tokens) == max_tokens, out
            for move in moved.get(out.request_id, []):
                r = req(i)
                r.request_id, r.sampling.max_tokens = "", max_tokens - move.at
                r.token_ids.ids.extend(out.tokens[: move.at])
                after = await stream(mig.router.grpc, r)
                assert out.tokens[move.at :] == after.tokens, (i, move)
        assert any(out.request_id in moved for out in outs), moved
        await idle(mig)
    finally:
        for name in replicas:
            proc = mig.mesh.procs.pop(name, None)
            if proc is not None:
                proc.stop()
