"""The answers of one streamed OpenAI request, as one stream of (choice index, message).

A streamed request with `n` > 1 or a prompt batch runs one router request per choice, side by side;
`merge` interleaves their messages in the order they arrive, each tagged with its choice's index (the
index OpenAI's chunks carry), and ends when every choice has ended. The first failure ends the whole
stream (the others are cancelled and closed) and is raised; closing the merged stream early closes every
request's stream, which aborts what still runs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from xavier.v1 import router_service_pb2 as rpb

# What a choice's pump hands over: a message, its end (None) or its failure.
_Item = tuple[int, rpb.GenerateResponse | BaseException | None]


async def merge(
    gens: Sequence[AsyncIterator[rpb.GenerateResponse]],
) -> AsyncGenerator[tuple[int, rpb.GenerateResponse]]:
    """Every choice's messages as they arrive, tagged with the choice's index (its place in `gens`)."""
    queue: asyncio.Queue[_Item] = asyncio.Queue()

    async def pump(index: int, gen: AsyncIterator[rpb.GenerateResponse]) -> None:
        try:
            async for msg in gen:
                await queue.put((index, msg))
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put((index, exc))
        else:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        live = len(tasks)
        while live:
            index, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for gen in gens:
            await close_quietly(gen)


async def close_quietly(gen: AsyncIterator[Any]) -> None:
    """Closes an answer's stream (an async generator: what still runs is aborted), whatever it raises."""
    aclose = getattr(gen, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()


@dataclass
class Choices:
    """Which choices of a stream have begun and ended, and the usage they add up to (a prompt counts
    once, however many choices it has, as OpenAI's usage)."""

    n: int
    begun: set[int] = field(default_factory=set)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def begin(self, index: int) -> bool:
        """True the first time `index` is seen (its first chunk is due)."""
        if index in self.begun:
            return False
        self.begun.add(index)
        return True

    def end(self, index: int, last: rpb.GenerateResponse) -> None:
        """Adds the usage of a choice's last message."""
        if index % self.n == 0:
            self.prompt_tokens += last.usage.prompt_tokens
            self.cached_tokens += last.usage.cached_tokens
        self.completion_tokens += last.usage.completion_tokens
