"""One store process for the module; every test must leave it with no lease, reservation or pin (I2)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.pagestore.support import start_store, stats
from tests.support.procs import ServiceProc


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProc]:
    svc = start_store(tmp_path_factory.mktemp("pagestore"))
    yield svc
    assert svc.stop() == 0, svc.log()[-2000:]


@pytest.fixture(autouse=True)
def _no_leases_left(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "store" not in request.fixturenames:
        return
    svc: ServiceProc = request.getfixturevalue("store")
    got = stats(svc.address)
    assert got.leases == 0
    assert all(n.leases == 0 and n.reserved_pages == 0 and n.pinned_pages == 0 for n in got.namespaces)
