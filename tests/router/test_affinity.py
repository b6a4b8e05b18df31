"""Prefix affinity in P/D pair selection: a repeated prompt prefix goes back to the prefill that has it."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2
from xavier_client import Client
from xavier_services.router.peers import PeerPool, affinity_key

from tests.cli.mesh import Mesh, shared_cache, start_up


def _pool(loads: dict[str, int]) -> PeerPool:
    pool = PeerPool("", rpc_timeout=1.0, refresh_seconds=1e9, attempts=1, affinity_slack=2)
    peers = [
        dpb.Peer(
            peer_id=name,
            role=types_pb2.ROLE_PREFILL,
            contract_fingerprint="f",
            load=dpb.PeerLoad(outstanding_requests=n),
        )
        for name, n in loads.items()
    ]
    peers.append(dpb.Peer(peer_id="d", role=types_pb2.ROLE_DECODE, contract_fingerprint="f"))
    pool._peers, pool._fetched_at = peers, time.monotonic()  # a fresh ListPeers answer
    return pool


async def test_affinity_sticks_within_the_slack_and_yields_beyond_it() -> None:
    pool = _pool({"p1": 0, "p2": 0})
    key = affinity_key([1, 2, 3], "", 64)
    first = (await pool.pick_pair(key)).prefill.peer_id
    other = "p2" if first == "p1" else "p1"
    for _ in range(10):  # equal load: without affinity, ties would split at random
        assert (await pool.pick_pair(key)).prefill.peer_id == first
    pool.inflight[first] = 1  # within the slack of 2
    assert (await pool.pick_pair(key)).prefill.peer_id == first
    pool.inflight[first] = 3  # beyond it: the least-loaded wins and becomes the remembered one
    assert (await pool.pick_pair(key)).prefill.peer_id == other
    pool.inflight[first] = 0
    assert (await pool.pick_pair(key)).prefill.peer_id == other
    assert pool.affinity_hits == 12


async def test_router_processes_that_share_nothing_send_a_new_prefix_to_the_same_prefill() -> None:
    # Two pools stand for two router processes: neither has seen any of these prefixes.
    a, b = _pool({"p1": 0, "p2": 0, "p3": 1}), _pool({"p1": 0, "p2": 0, "p3": 1})
    keys = [affinity_key([k, 1, 2], "", 64) for k in range(90)]
    chosen = [(await a.pick_pair(k)).prefill.peer_id for k in keys]
    assert chosen == [(await b.pick_pair(k)).prefill.peer_id for k in keys]
    assert all(chosen.count(c) >= 20 for c in ("p1", "p2", "p3"))  # spread evenly: 28, 31, 31
    assert a.affinity_hits == 0
    b.inflight["p1"] = 5  # beyond the slack in b alone: b yields, a keeps the rank's choice
    on_p1 = [k for k, c in zip(keys, chosen, strict=True) if c == "p1"]
    assert on_p1 and {(await b.pick_pair(k)).prefill.peer_id for k in on_p1} <= {"p2", "p3"}
    assert {(await a.pick_pair(k)).prefill.peer_id for k in on_p1} == {"p1"}


def test_affinity_keys() -> None:
    long = list(range(100))
    assert affinity_key(long, "", 64) == affinity_key([*range(64), 7, 7], "", 64)  # only the prefix counts
    assert affinity_key(long, "", 64) != affinity_key(long, "tenant-b", 64)  # salts never share
    assert affinity_key(long, "", 0) is None and affinity_key([], "", 64) is None


@pytest.fixture(scope="module")
def two_prefills(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    mesh = start_up(
        tmp_path_factory.mktemp("affinity"),
        shared_cache(tmp_path_factory),
        "--prefill",
        "2",
        "--decode",
        "1",
        "--compute",
        "null",
        "--router-workers",
        "2",
        "--no-pagestore",  # a prefill's cached tokens then come from its own prefix cache alone
    )
    yield mesh
    mesh.stop()


@pytest.mark.integration
def test_repeated_prefix_hits_the_same_prefill_cache(two_prefills: Mesh) -> None:
    prompt = "the quick brown fox jumps over a lazy dog " * 12  # several pages
    with Client(two_prefills.grpc) as client:
        first = client.generate(prompt, max_tokens=2, mode="pd", ignore_eos=True)
        repeats = [client.generate(prompt, max_tokens=2, mode="pd", ignore_eos=True) for _ in range(6)]
        status = client.cluster_status()
    assert first.cached_tokens == 0
    # With two idle prefills a tie breaks at random: only affinity sends all six to the warm cache.
    assert all(r.cached_tokens > 0 for r in repeats), [r.cached_tokens for r in repeats]
    prefills = [p for p in status.peers if p.role == types_pb2.ROLE_PREFILL]
    computed = sorted(p.engine.prompt_tokens_computed for p in prefills)
    assert computed[0] == 0  # the other prefill never saw the prompt


@pytest.mark.integration
def test_router_processes_send_one_prefix_to_one_prefill(two_prefills: Mesh) -> None:
    # The mesh's router is two processes; each request below is on a connection of its own, which the
    # kernel gives either one, and neither has seen what the other sent.
    for n in range(4):
        prompt = f"prefix number {n}: " + "the quick brown fox jumps over a lazy dog " * 12
        body = {"model": two_prefills.model.name, "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
        cached = []
        for _ in range(4):
            with httpx.Client(timeout=30) as client:
                r = client.post(f"http://{two_prefills.http}/v1/completions", json=body)
                assert r.status_code == 200, r.text
                cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert cached[0] == 0 and all(c > 0 for c in cached[1:]), (n, cached)
