"""A decode connects its transfer port to the prefills of its layout before their first request
(`handoff.warm_interval_seconds`, `peer/warming.py`): the prefill's agent is loaded and the read-end
agent's connection made while nothing waits, and the first request then reads through them. Real
processes, real NIXL DRAM transfers, the tiny model."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from xavier.v1 import types_pb2

from tests.pd.conftest import FAST_ENV, Mesh, pair_mesh, wait_drained
from tests.support.pd_driver import pd_generate, peer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    env = {**FAST_ENV, "XAVIER_HANDOFF__WARM_INTERVAL_SECONDS": "0.2"}  # rounds keep coming meanwhile
    with pair_mesh(tiny_model, tmp_path_factory.mktemp("warming"), env) as m:
        yield m


def _counter(mesh: Mesh, name: str, sample: str) -> float:
    with urllib.request.urlopen(f"http://{mesh.procs[name].metrics}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(sample + " "))


WARMED = 'xavier_transfer_peers_warmed_total{role="decode"}'
PULLED = 'xavier_transfers_by_transport_total{role="decode",transport="nixl"}'


async def test_the_decode_connects_to_its_prefill_before_the_first_request(pair: Mesh) -> None:
    deadline = time.monotonic() + 30
    while _counter(pair, "decode-0", WARMED) < 1:
        assert time.monotonic() < deadline, "the decode never warmed its port to the prefill"
        await asyncio.sleep(0.05)
    assert _counter(pair, "decode-0", PULLED) == 0  # warmed with no request behind it

    async with (
        grpc.aio.insecure_channel(pair.directory) as directory,
        grpc.aio.insecure_channel(pair.procs["prefill-0"].address) as prefill,
        grpc.aio.insecure_channel(pair.procs["decode-0"].address) as decode,
    ):
        p = await peer(directory, types_pb2.ROLE_PREFILL)
        d = await peer(directory, types_pb2.ROLE_DECODE)
        out = await pd_generate(directory, prefill, decode, p, d, list(range(3, 83)), 4)
    assert len(out.tokens) == 4
    assert _counter(pair, "decode-0", PULLED) == 1
    assert _counter(pair, "decode-0", WARMED) == 1  # one registration, warmed once, not per round
    await wait_drained(pair)
