"""Bounded, jittered retries of UNAVAILABLE: the one retry loop of Xavier's internal calls.

Only UNAVAILABLE is retried (the server did not act, or the call is idempotent by request id); every
other error is raised at once, typed. A raw ``grpc.aio.AioRpcError`` is turned into its typed
``XavierError`` so callers see one kind of error whether the call went through a stub or a client.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from .errors import Unavailable, XavierError, from_rpc_error

__all__ = ["backoff_delay", "retry_unavailable"]

T = TypeVar("T")


def backoff_delay(attempt: int, base_delay: float, max_delay: float) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (1-based): exponential, capped, jittered
    to 50-150% so that callers failing together do not retry together."""
    capped: float = min(max_delay, base_delay * 2.0 ** (attempt - 1))
    return capped * (0.5 + random.random())


async def retry_unavailable(
    fn: Callable[[], Awaitable[T]],
    *,
    attempts: int,
    base_delay: float,
    max_delay: float,
    on_retry: Callable[[XavierError], None] | None = None,
) -> T:
    """Awaits ``fn()`` up to ``attempts`` times while it fails with UNAVAILABLE.

    ``on_retry`` runs before each wait (e.g. to forget a cached peer list). The last error is raised.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, got {attempts}")
    for attempt in range(1, attempts + 1):
        try:
            return await fn()
        except grpc.aio.AioRpcError as rpc_err:
            err = from_rpc_error(rpc_err)
        except Unavailable as unavailable:
            err = unavailable
        if not isinstance(err, Unavailable) or attempt == attempts:
            raise err
        if on_retry is not None:
            on_retry(err)
        await asyncio.sleep(backoff_delay(attempt, base_delay, max_delay))
    raise Unavailable("retries exhausted")  # unreachable: the last attempt returns or raises
