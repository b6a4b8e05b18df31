"""The stats of an SGLang-hosting service read SGLang's `/v1/loads` report: the installed SGLang declares the
route, and its own `LoadSnapshot.to_dict({"core"})` (what the route returns per rank) carries every field
`xavier_services.sglang_host.stats.from_load` reads, with the meaning it gives them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.managers.load_snapshot", reason="the real sglang package is not installed")

from sglang.srt.managers.load_snapshot import LoadSnapshot
from xavier_services.sglang_host.stats import from_load

pytestmark = pytest.mark.sglang


def test_the_route_is_declared() -> None:
    spec = importlib.util.find_spec("sglang.srt.entrypoints.v1_loads")
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).read_text()
    assert '@router.get("/v1/loads")' in source and "include" in source


def test_sglangs_core_report_maps_to_engine_stats() -> None:
    snapshot = LoadSnapshot(
        num_running_reqs=3, num_waiting_reqs=4, num_used_tokens=100, max_total_num_tokens=1024
    )
    core = snapshot.to_dict({"core"})
    stats = from_load(core, page_size=16)
    assert (stats.pages_total, stats.pages_free, stats.running, stats.waiting) == (64, 64 - 7, 3, 4)
    # An idle server reports zeros, which are counts too (not missing fields).
    assert from_load(LoadSnapshot(max_total_num_tokens=64).to_dict({"core"}), page_size=16).pages_free == 4
