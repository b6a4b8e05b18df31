"""The engine stats of a hosted SGLang server, from SGLang's own load report.

SGLang 0.5.17 through 0.5.23 serve `GET /v1/loads?include=core` without `--enable-metrics` (its
Prometheus `/metrics` needs that flag; `/server_info` gives the pool's capacity but not its use): per
rank, `num_running_reqs`, `num_waiting_reqs`, `max_total_num_tokens` (the KV pool in tokens) and
`num_used_tokens` (tokens held by requests: the pool less its free and evictable radix-cache slots).
Pages are those tokens over the page size the service launched SGLang with (`--page-size`), so
`pages_free` counts evictable cached pages as free, as SGLang's allocator does. A server that does not
answer in time leaves the pool fields unset: the stats then carry the service's own count of requests
in flight, never a stale or made-up pool.
"""

from __future__ import annotations

from typing import Any

from xavier.v1 import types_pb2

from xavier_core.runtime.errors import XavierError
from xavier_core.runtime.logging import get_logger
from xavier_services.sglang_host.client import SglangHttp

__all__ = ["engine_stats", "from_load"]

log = get_logger(__name__)
LOAD_TIMEOUT_S = 2.0
"""A stats call waits this long for SGLang's load report at most (its scheduler answers it between steps)."""


def from_load(load: dict[str, Any], page_size: int) -> types_pb2.EngineStats:
    """EngineStats from one rank of `/v1/loads`; ValueError when a field is missing or not a count."""
    try:
        capacity, used = int(load["max_total_num_tokens"]), int(load["num_used_tokens"])
        running, waiting = int(load["num_running_reqs"]), int(load["num_waiting_reqs"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"SGLang's load report lacks a count: {exc}") from None
    if min(capacity, used, running, waiting) < 0 or used > capacity:
        raise ValueError(f"SGLang's load report is inconsistent: {used} of {capacity} tokens used")
    total = capacity // page_size
    used_pages = min(total, -(-used // page_size))  # a partly filled page is taken
    return types_pb2.EngineStats(
        pages_total=total, pages_free=total - used_pages, running=running, waiting=waiting
    )


async def engine_stats(http: SglangHttp | None, inflight: int, page_size: int) -> types_pb2.EngineStats:
    """SGLang's pool and queues when it reports them; else only `inflight` (requests this service has
    open with SGLang) as running."""
    if http is not None:
        try:
            return from_load(await http.load(LOAD_TIMEOUT_S), page_size)
        except (XavierError, ValueError) as exc:
            log.warning("sglang load report unavailable; stats carry requests in flight only", error=str(exc))
    return types_pb2.EngineStats(running=inflight)
