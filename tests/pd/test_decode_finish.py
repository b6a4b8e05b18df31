"""What a pair handoff's decode relies on to free a request unshielded: the reference engine's abort,
the one call of that finish that is awaited, ends without ever waiting, whatever it aborts, so no cancel
can land in the middle of the finish."""

from __future__ import annotations

from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest

from xavier_core.engine.api import Sampling
from xavier_core.engine.reference import ReferenceEngine
from xavier_core.engine.tiny import make_tiny


def _ends_without_waiting(call: Coroutine[Any, Any, None]) -> None:
    with pytest.raises(StopIteration):
        call.send(None)


async def test_the_engines_abort_ends_without_waiting(tmp_path: Path) -> None:
    engine = ReferenceEngine.load(make_tiny(tmp_path, "qwen2", max_position=64), num_pages=64)
    try:
        prompt = engine.tokenizer.encode(
            "the quick brown fox jumps over the lazy dog", add_special_tokens=False
        )
        sampling = Sampling(max_tokens=2, ignore_eos=True)
        async for _ in engine.generate("finished", prompt, sampling):
            pass
        _ends_without_waiting(engine.abort("finished"))
        engine.reserve_pages("reserved", len(prompt))
        _ends_without_waiting(engine.abort("reserved"))
        _ends_without_waiting(engine.abort("unknown"))
        live = engine.generate("live", prompt, Sampling(max_tokens=10_000, ignore_eos=True))
        await anext(live)
        _ends_without_waiting(engine.abort("live"))  # the loop holds it: the abort is queued to it
        async for _ in live:
            pass
        assert engine.stats().pages_pinned == 0
    finally:
        await engine.close()
