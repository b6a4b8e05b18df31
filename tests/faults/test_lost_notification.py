"""An injected lost NIXL notification: the reader's "done" never reaches the prefill.

The prefill runs with XAVIER_FAULT_DROP_DONE_NOTIFICATIONS=1 (the test-only hook in KvManager.progress):
every "done" its sources receive is discarded (one that comes after the room already ended is ignored as
late: `xavier_transfer_notifications_ignored`). The requests must still complete, and the prefill must
unpin through the room's completion as the directory reports it (its room feed, the second source of
truth in `_hold_until_read`), well before the notification wait's fallback timeout.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from xavier.v1 import types_pb2

from tests.pd.conftest import FAST_ENV, Mesh, mesh_stats, wait_drained
from tests.support.pd_driver import pd_generate, peer, unified_generate
from xavier_core.transfer.port.kv_port import DROP_DONE_ENV

pytestmark = pytest.mark.integration

REQUESTS = 6
# The prefill's fallbacks without the room's word: 2 room leases (8 s) for the outcome, lease + park
# timeout (9 s) for the notification. Unpinning sooner than this can only come from the room feed.
FALLBACK_S = 8.0


@pytest.fixture(scope="module")
def lossy_mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    m = Mesh(tiny_model, tmp_path_factory.mktemp("lost-notif"), dict(FAST_ENV))
    try:
        m.start_directory()
        m.env = {**FAST_ENV, DROP_DONE_ENV: "1"}
        m.start_peer("prefill-0", "prefill")
        m.env = dict(FAST_ENV)
        m.start_peer("decode-0", "decode")
        m.start_peer("unified-0", "unified")
        yield m
    finally:
        m.stop()


async def test_lost_done_notification_unpins_through_room_completion(lossy_mesh: Mesh) -> None:
    mesh = lossy_mesh
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(40 + 17 * i)] for i in range(REQUESTS)]
    async with (
        grpc.aio.insecure_channel(mesh.directory) as d,
        grpc.aio.insecure_channel(mesh.procs["prefill-0"].address) as p,
        grpc.aio.insecure_channel(mesh.procs["decode-0"].address) as c,
        grpc.aio.insecure_channel(mesh.procs["unified-0"].address) as u,
    ):
        pp, dd = await peer(d, types_pb2.ROLE_PREFILL), await peer(d, types_pb2.ROLE_DECODE)
        results = await asyncio.gather(*(pd_generate(d, p, c, pp, dd, t, 6) for t in prompts))
        ended = time.monotonic()
        # Every request completed, with the tokens a colocated run gives.
        for toks, res in zip(prompts, results, strict=True):
            assert res.finish == types_pb2.FINISH_REASON_LENGTH, res
            assert res.tokens == await unified_generate(u, toks, 6)

    stats = await wait_drained(mesh, timeout=FALLBACK_S * 2)
    unpinned_after = time.monotonic() - ended
    assert not any(stats.values()), stats
    assert unpinned_after < FALLBACK_S - 2.0, f"unpinned only after {unpinned_after:.1f}s (a fallback)"

    # The fault really happened: no request's "done" unpinned anything. The fault hook dropped it, or it
    # came after the room feed had ended its room (the decode's read-end agent sends it apart from the
    # READ, so it can) and the prefill ignored it as a stranger's.
    # A late one is taken in once the room feed ends its room (the port polls a while after that).
    ignored = _ignored(mesh.procs["prefill-0"].metrics)
    for _ in range(100):
        if ignored.get("injected", 0) + ignored.get("unknown_room", 0) >= REQUESTS:
            break
        await asyncio.sleep(0.1)
        ignored = _ignored(mesh.procs["prefill-0"].metrics)
    dropped = ignored["injected"]
    assert dropped + ignored["unknown_room"] == REQUESTS and ignored["bad_token"] == 0, ignored
    assert mesh.procs["prefill-0"].log().count("done notification dropped (fault injection)") == dropped
    print(
        f"lost notification: faults injected {dropped}, late {ignored['unknown_room']}, "
        f"requests served {len(results)}, "
        f"unpinned {unpinned_after:.2f}s after the last request, leaks found 0"
    )
    assert (await mesh_stats(mesh))["prefill-0.pages_pinned"] == 0


def _ignored(metrics: str) -> dict[str, int]:
    """The prefill's `xavier_transfer_notifications_ignored` counters, by why."""
    import urllib.request

    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    prefix = 'xavier_transfer_notifications_ignored_total{role="prefill",why="'
    mine = [ln[len(prefix) :] for ln in lines if ln.startswith(prefix)]
    return {ln.split('"')[0]: int(float(ln.split()[-1])) for ln in mine}
