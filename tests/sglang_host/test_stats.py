"""Stats RPCs of an SGLang-hosting service report SGLang's own KV pool and queues (its `/v1/loads`, here
served by the stand-in with SGLang's field names), and only the requests in flight when SGLang does not
report them."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
from xavier.v1 import decode_service_pb2 as dpb
from xavier.v1 import decode_service_pb2_grpc, types_pb2
from xavier_services.sglang_host.stats import from_load

from tests.sglang_host.conftest import Start

pytestmark = pytest.mark.integration
LOAD = {"num_running_reqs": 2, "num_waiting_reqs": 1, "num_used_tokens": 33, "max_total_num_tokens": 4100}


def test_a_load_report_becomes_pages_of_the_launch_page_size() -> None:
    stats = from_load({**LOAD, "token_usage": 0.008, "dp_rank": 0}, page_size=16)
    # 4100 tokens are 256 whole pages; 33 tokens take 3 pages (a partly filled page is taken).
    assert (stats.pages_total, stats.pages_free, stats.running, stats.waiting) == (256, 253, 2, 1)
    assert from_load({**LOAD, "num_used_tokens": 0}, page_size=1).pages_free == 4100


@pytest.mark.parametrize(
    "load",
    [
        {k: v for k, v in LOAD.items() if k != "num_used_tokens"},
        {**LOAD, "num_running_reqs": "many"},
        {**LOAD, "num_used_tokens": 5000},
        {**LOAD, "num_waiting_reqs": -1},
    ],
)
def test_a_malformed_load_report_is_refused(load: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="load report"):
        from_load(load, page_size=16)


def _stats(address: str) -> types_pb2.EngineStats:
    with grpc.insecure_channel(address) as ch:
        stub = decode_service_pb2_grpc.DecodeServiceStub(ch)
        return stub.GetDecodeStats(dpb.GetDecodeStatsRequest(), timeout=10).engine


def _stream_in_background(address: str, max_tokens: int) -> threading.Thread:
    def run() -> None:
        with grpc.insecure_channel(address) as ch:
            stub = decode_service_pb2_grpc.DecodeServiceStub(ch)
            req = dpb.GenerateUnifiedRequest(
                request_id="s1", token_ids=[5, 6], sampling=types_pb2.SamplingParams(max_tokens=max_tokens)
            )
            list(stub.GenerateUnified(req, timeout=60))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _wait_stats(address: str, cond: object, what: str) -> types_pb2.EngineStats:
    deadline = time.monotonic() + 15
    while True:
        stats = _stats(address)
        if cond(stats):  # type: ignore[operator]
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out: {what}; last {stats}")
        time.sleep(0.05)


def test_stats_carry_sglangs_pool(start_sglang_peer: Start, tmp_path: Path) -> None:
    env = {"XAVIER_STANDIN_TOKEN_DELAY": "0.1", "XAVIER_STANDIN_MAX_TOKENS": "2048"}
    unified = start_sglang_peer("unified", env=env)
    idle = _stats(unified.address)
    assert (idle.pages_total, idle.pages_free, idle.running) == (128, 128, 0)  # 2048 tokens, pages of 16
    thread = _stream_in_background(unified.address, max_tokens=30)
    busy = _wait_stats(unified.address, lambda s: s.running == 1, "the stream shows as running")
    assert busy.pages_total == 128 and busy.pages_free == 128 - 2  # 2 + 30 tokens: two pages
    thread.join(30)
    _wait_stats(unified.address, lambda s: s.running == 0 and s.pages_free == 128, "the pool freed")


def test_without_sglangs_report_stats_carry_requests_in_flight(start_sglang_peer: Start) -> None:
    env = {"XAVIER_STANDIN_TOKEN_DELAY": "0.1", "XAVIER_STANDIN_NO_LOADS": "1"}
    unified = start_sglang_peer("unified", env=env)
    thread = _stream_in_background(unified.address, max_tokens=30)
    busy = _wait_stats(unified.address, lambda s: s.running == 1, "the service's own count")
    assert busy.pages_total == 0 and busy.pages_free == 0  # unknown, not made up
    thread.join(30)
