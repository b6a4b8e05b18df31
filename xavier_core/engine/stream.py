"""The token stream `generate` and `decode_from_pages` return.

`Engine.generate` is declared `async def ... -> AsyncIterator[StreamEvent]` without a `yield`, which type
checkers read as a coroutine *returning* an iterator, while the natural call is `async for ev in
engine.generate(...)`. `TokenStream` serves both: it is an async iterator, and awaiting it (or driving it
as a coroutine) immediately returns the stream itself.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Coroutine, Generator
from types import TracebackType
from typing import Any

from xavier_core.engine.api import StreamEvent


class TokenStream(AsyncIterator[StreamEvent], Coroutine[Any, Any, "TokenStream"]):
    """An async iterator of `StreamEvent`s that is also awaitable (yielding itself)."""

    def __init__(self, events: AsyncGenerator[StreamEvent, None]) -> None:
        self._events = events

    def __aiter__(self) -> TokenStream:
        return self

    async def __anext__(self) -> StreamEvent:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        """Stops consuming: a request still running is aborted."""
        await self._events.aclose()

    def __await__(self) -> Generator[Any, None, TokenStream]:
        return self
        yield  # unreachable: makes this a generator that returns at once

    def send(self, value: Any) -> Any:
        """Coroutine protocol: completes at once with the stream as its value."""
        raise StopIteration(self)

    def throw(
        self,
        typ: type[BaseException] | BaseException,
        val: BaseException | object = None,
        tb: TracebackType | None = None,
    ) -> Any:
        """Coroutine protocol: re-raises the thrown exception."""
        if isinstance(typ, BaseException):
            raise typ
        raise typ()

    def close(self) -> None:
        """Coroutine protocol: nothing to do (use `aclose` to stop the stream)."""
