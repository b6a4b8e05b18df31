"""An injected stuck read: the decode's READ into its reserved pages never ends.

The decode runs with XAVIER_FAULT_STUCK_READS naming a file (the test-only hook in KvReceiver): while the
file exists its READs are never seen to end, so a pull times out and its READ is still "in flight" at the
park timeout. The request must end with a clear status (UNAVAILABLE, reason TRANSFER_STUCK), and the
decode must keep the pages that READ may still write out of use (quarantined, counted), never free them;
the prefill unpins its source, the directory ends the room, and the decode stays up. Once the READ ends
(the file goes), the decode takes the pages back: nothing is lost for good.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from xavier.v1 import decode_service_pb2 as dec
from xavier.v1 import decode_service_pb2_grpc as dec_grpc
from xavier.v1 import types_pb2

from tests.pd.conftest import FAST_ENV, Mesh, mesh_stats
from tests.support.pd_driver import pd_generate, peer
from xavier_core.runtime.errors import from_rpc_error
from xavier_core.transfer.port.kv_port import STUCK_READS_ENV

pytestmark = pytest.mark.integration

SHORT = {"XAVIER_HANDOFF__TRANSFER_TIMEOUT_SECONDS": "1", "XAVIER_HANDOFF__PARK_TIMEOUT_SECONDS": "1"}


@pytest.fixture(scope="module")
def stuck_mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    workdir = tmp_path_factory.mktemp("stuck-read")
    m = Mesh(tiny_model, workdir, {**FAST_ENV, **SHORT})
    try:
        m.start_directory()
        m.start_peer("prefill-0", "prefill")
        hook = workdir / "reads-stuck"
        hook.touch()  # the decode's READs look in flight while this file exists
        m.env = {**FAST_ENV, **SHORT, STUCK_READS_ENV: str(hook)}
        m.start_peer("decode-0", "decode")
        yield m
    finally:
        m.stop()


def _unstick(mesh: Mesh) -> None:
    Path(mesh.env[STUCK_READS_ENV]).unlink()


async def _decode_engine(mesh: Mesh) -> types_pb2.EngineStats:
    async with grpc.aio.insecure_channel(mesh.procs["decode-0"].address) as ch:
        stats = await dec_grpc.DecodeServiceStub(ch).GetDecodeStats(dec.GetDecodeStatsRequest(), timeout=5)
    return stats.engine


async def test_a_read_still_running_at_the_park_timeout_quarantines_its_pages(stuck_mesh: Mesh) -> None:
    mesh = stuck_mesh
    rng = random.Random(11)
    prompt = [rng.randrange(3, 500) for _ in range(70)]  # 5 pages of 16 tokens
    before = await _decode_engine(mesh)
    async with (
        grpc.aio.insecure_channel(mesh.directory) as d,
        grpc.aio.insecure_channel(mesh.procs["prefill-0"].address) as p,
        grpc.aio.insecure_channel(mesh.procs["decode-0"].address) as c,
    ):
        pp, dd = await peer(d, types_pb2.ROLE_PREFILL), await peer(d, types_pb2.ROLE_DECODE)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pd_generate(d, p, c, pp, dd, prompt, 4)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert from_rpc_error(err.value).reason == "TRANSFER_STUCK"

    after = await _decode_engine(mesh)  # the decode is up and answers
    assert after.pages_quarantined == before.pages_quarantined + 5
    assert after.pages_free == before.pages_free - 5  # taken out of use, not freed
    for _ in range(100):  # the prefill unpins and the directory ends the room (the decode said it failed)
        stats = await mesh_stats(mesh)
        if not any(stats.values()):
            break
        await asyncio.sleep(0.1)
    assert not any(stats.values()), stats
    assert (await _decode_engine(mesh)).pages_quarantined == before.pages_quarantined + 5  # still held

    _unstick(mesh)  # the READ ends: the decode takes its pages back
    for _ in range(300):
        now = await _decode_engine(mesh)
        if now.pages_quarantined == before.pages_quarantined:
            break
        await asyncio.sleep(0.1)
    assert now.pages_quarantined == before.pages_quarantined and now.pages_free == before.pages_free
