"""Replicas that share prefixes (`handoff.share_prefixes`): a store hit whose pages another replica wrote
is copied from that replica's pool, not READ from the store: straight from where they stand while the
writer lets them (`handoff.standing_share_seconds`), else after asking it (DecodeService.SharePrefix), both
through the transfer port; the answer is the one computing gives; every pin ends; a holder that is gone is
a store READ, never a failed request. Real processes, real NIXL DRAM transfers, the tiny model."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from collections.abc import Iterator

import pytest

from tests.pagestore.engines import StoreMesh, generate, prompt, wait_for
from tests.pagestore.test_engines import _assert_quiet, _store_pages
from xavier_core.engine.tiny import make_tiny

pytestmark = pytest.mark.integration

PREFIX = 640  # 40 full pages of 16 tokens
SUFFIX = 24
STANDING_S = 3.0
"""How long the pages a replica writes through stand in its pool (a bounded wait outlasts it)."""


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreMesh]:
    model = make_tiny(tmp_path_factory.mktemp("models") / "tiny-qwen2", "qwen2")
    m = StoreMesh(model, tmp_path_factory.mktemp("sharing-mesh"))
    m.env = {
        "XAVIER_HANDOFF__SHARE_PREFIXES": "1",
        "XAVIER_HANDOFF__ROOM_LEASE_SECONDS": "3",
        "XAVIER_HANDOFF__WARM_INTERVAL_SECONDS": "0.2",
        "XAVIER_HANDOFF__STANDING_SHARE_SECONDS": str(STANDING_S),
    }
    try:
        m.start_directory()
        m.start_store()
        for name in ("unified-a", "unified-b", "unified-c"):
            m.start_unified(name, "--pagestore", m.store.address)
        yield m
    finally:
        m.stop()


def _reads(mesh: StoreMesh, name: str) -> dict[str, float]:
    """A replica's `xavier_pagestore_client_reads_total` by path (direct, nixl, holder)."""
    text = urllib.request.urlopen(f"http://{mesh.procs[name].metrics}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r'^xavier_pagestore_client_reads_total\{path="(\w+)"\} (\S+)$', text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def _steps(mesh: StoreMesh, name: str) -> dict[str, float]:
    """A replica's `xavier_pagestore_client_fetch_seconds_total` by step."""
    text = urllib.request.urlopen(f"http://{mesh.procs[name].metrics}/metrics", timeout=5).read().decode()
    pattern = r'^xavier_pagestore_client_fetch_seconds_total\{step="(\w+)"\} (\S+)$'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.M)}


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def _warmed(mesh: StoreMesh, name: str) -> float:
    text = urllib.request.urlopen(f"http://{mesh.procs[name].metrics}/metrics", timeout=5).read().decode()
    m = re.search(r'^xavier_transfer_peers_warmed_total\{role="unified"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


async def test_replicas_that_share_connect_to_each_other_before_their_first_share(mesh: StoreMesh) -> None:
    for name in ("unified-a", "unified-b", "unified-c"):  # each to the two others, none to itself
        await wait_for(lambda n=name: _warmed(mesh, n) >= 2, 30, f"{name} warming its port")
        assert _warmed(mesh, name) == 2


@pytest.mark.parametrize("stands", [True, False], ids=["standing", "asked"])
async def test_a_hit_written_by_a_peer_is_copied_from_its_pool(mesh: StoreMesh, stands: bool) -> None:
    """While A's pages stand, B copies them without asking (no SharePrefix: no `holder_ask` step); once
    they stand no more, B asks A first. Either way nothing is READ from the store."""
    a, b = mesh.procs["unified-a"].address, mesh.procs["unified-b"].address
    salt = f"t-share-{stands}"
    shared = prompt(11 if stands else 14, PREFIX)
    first, second = shared + prompt(12, SUFFIX), shared + prompt(13, SUFFIX)
    cold = await generate(a, second, salt=f"{salt}-cold")  # the reference: nothing reused
    assert (await generate(a, first, salt=salt)).usage.cached_tokens == 0
    await wait_for(lambda: _store_pages(mesh, salt) >= len(first) // 16, 30, "A's write-through")
    if not stands:  # the store committed them before it counted them: this outlasts their standing
        await asyncio.sleep(STANDING_S)

    before, steps_before = _reads(mesh, "unified-b"), _steps(mesh, "unified-b")
    warm = await generate(b, second, salt=salt)
    got = _delta(_reads(mesh, "unified-b"), before)
    assert got.get("holder", 0) >= 1, got
    assert not got.get("direct") and not got.get("nixl"), f"B READ the store: {got}"
    steps = _delta(_steps(mesh, "unified-b"), steps_before)  # the copy's two parts, timed apart
    assert steps.get("holder_copy", 0) > 0, steps
    assert bool(steps.get("holder_ask")) is not stands, steps
    assert steps.get("holder_ask", 0) + steps["holder_copy"] <= steps["holder"], steps
    assert not steps.get("read") and not steps.get("verify"), steps
    assert warm.usage.cached_tokens_store >= PREFIX - 16
    assert warm.tokens == cold.tokens
    await _assert_quiet(mesh)  # A's pins ended (the standing, or the share with B's read); leases released


async def test_another_salt_is_never_shared(mesh: StoreMesh) -> None:
    a, b = mesh.procs["unified-a"].address, mesh.procs["unified-b"].address
    shared = prompt(21, PREFIX)
    await generate(a, shared + prompt(22, SUFFIX), salt="t-one")
    await wait_for(lambda: _store_pages(mesh, "t-one") >= PREFIX // 16, 30, "A's write-through")
    before = _reads(mesh, "unified-b")
    other = await generate(b, shared + prompt(23, SUFFIX), salt="t-two")
    assert other.usage.cached_tokens == 0
    assert _delta(_reads(mesh, "unified-b"), before) == {}
    await _assert_quiet(mesh)


async def test_a_holder_that_is_gone_leaves_a_store_read(mesh: StoreMesh) -> None:
    c = mesh.procs["unified-c"].address
    b = mesh.procs["unified-b"].address
    shared = prompt(31, PREFIX)
    first, second = shared + prompt(32, SUFFIX), shared + prompt(33, SUFFIX)
    await generate(c, first, salt="t-gone")
    await wait_for(lambda: _store_pages(mesh, "t-gone") >= len(first) // 16, 30, "C's write-through")
    cold = await generate(b, second, salt="t-gone-cold")
    mesh.procs["unified-c"].kill()  # the directory still lists it a while
    del mesh.procs["unified-c"]

    before = _reads(mesh, "unified-b")
    warm = await generate(b, second, salt="t-gone")
    got = _delta(_reads(mesh, "unified-b"), before)
    if mesh.device == "cuda":
        # A CUDA pool B has mapped (an earlier copy of this module) outlives C: the driver keeps an
        # allocation another process has open, and pages that stood when C died are whole, so B may copy
        # them without asking. Either way the answer must be right.
        assert got.get("holder", 0) + got.get("direct", 0) + got.get("nixl", 0) >= 1, got
    else:  # C's pool went with it: the silent pull and the ask both fail, and B READs the store
        assert not got.get("holder"), got
        assert got.get("direct", 0) + got.get("nixl", 0) >= 1, got
    assert warm.usage.cached_tokens_store >= PREFIX - 16
    assert warm.tokens == cold.tokens
    await _assert_quiet(mesh)
