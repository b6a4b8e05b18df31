"""Engine admission: past engine.max_queued waiting requests, new work is refused and nothing is kept."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from tests.engine.conftest import collect, prompt_of
from xavier_core.engine.api import EngineBusyError, Sampling
from xavier_core.engine.reference import ReferenceEngine
from xavier_core.runtime.domain_errors import engine_status


def test_queue_bound_refuses_new_work_and_leaks_nothing(
    engine_factory: Callable[..., ReferenceEngine],
) -> None:
    engine = engine_factory("llama", max_running=1, max_queued=2)

    async def main() -> None:
        prompt = prompt_of(engine, 8)
        sampling = Sampling(max_tokens=400, ignore_eos=True)
        tasks: list[asyncio.Task[object]] = []
        refused: BaseException | None = None
        for i in range(8):
            tasks.append(asyncio.create_task(collect(engine.generate(f"r{i}", prompt, sampling))))
            await asyncio.sleep(0.05)  # the stream submits on its first step
            if tasks[-1].done():
                refused = tasks[-1].exception()
                break
        # One runs and two wait; the fourth (or the third, if the first was not yet admitted) is refused.
        assert isinstance(refused, EngineBusyError), refused
        assert len(tasks) in (3, 4)
        status = engine_status(refused)
        assert (status.code, status.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "ENGINE_QUEUE_FULL")
        for task in tasks[:-1]:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _ in range(200):
            stats = engine.stats()
            if stats.running == stats.waiting == stats.pages_pinned == 0:
                break
            await asyncio.sleep(0.02)
        assert (stats.running, stats.waiting, stats.pages_pinned) == (0, 0, 0)
        # Room again once the queue drained.
        events = await collect(engine.generate("after", prompt, Sampling(max_tokens=2, ignore_eos=True)))
        assert len(events) == 2

    asyncio.run(main())
