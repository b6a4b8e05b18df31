"""Migration of requests whose sampling depends on which tokens are output: a grammar, a frequency
penalty and min_tokens, each through a real router with a decode killed (kill -9) at a seeded token.

The resumed request carries `SamplingParams.resumed_output_tokens`: the new prefill and decode count
the tokens sent as output (penalties) and advance the grammar over them, and the router lowers
min_tokens by them. Each stream must complete across its seam; what follows the seam equals a fresh
run of prompt + the tokens before it with the same field set, and (the math being the same) the whole
answer equals the uninterrupted run, which is reported, and asserted where no float tie can break it.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from xavier.v1 import types_pb2

from tests.faults.migration_mesh import (
    MigrationMesh,
    Streamed,
    fresh,
    idle,
    migration_mesh,
    migrations,
    prompt_ids,
    request,
    serving_decode,
    stream,
)

pytestmark = pytest.mark.integration

# 100 integers: about 400 tokens, long enough to be killed mid-stream, and an answer easy to check.
_ITEMS = 100
_SCHEMA = {
    "type": "object",
    "properties": {
        "xs": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 99},
            "minItems": _ITEMS,
            "maxItems": _ITEMS,
        }
    },
    "required": ["xs"],
}


@pytest.fixture(scope="module")
def mig(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MigrationMesh]:
    with migration_mesh(tiny_model, tmp_path_factory.mktemp("migration-sampling")) as m:
        yield m


async def _killed_mid_stream(
    mig: MigrationMesh, rid: str, ids: list[int], max_tokens: int, at: int, **sampling: object
) -> tuple[Streamed, int]:
    """Streams a request, kills (-9) its decode once the client has `at` tokens; the stream and the
    tokens the client had at its one move. The victim is started again."""
    got = asyncio.Event()
    req = request(rid, ids, max_tokens, **sampling)
    task = asyncio.ensure_future(
        stream(mig.router.grpc, req, lambda s: got.set() if len(s.tokens) >= at else None)
    )
    victim = await serving_decode(mig.mesh)
    await got.wait()
    mig.mesh.procs[victim].kill()  # kill -9, reaped
    out = await task
    assert out.error is None, out.error
    [move] = migrations(mig.router)[rid]
    assert move.cause == "unavailable" and move.at >= at, move
    await idle(mig)
    mig.restart(victim)
    return out, move.at


async def _continued(
    mig: MigrationMesh, ids: list[int], out: Streamed, seam: int, max_tokens: int, **sampling: object
) -> list[int]:
    """A fresh run of prompt + the tokens before the seam, told they are resumed output."""
    req = request("", ids + out.tokens[:seam], max_tokens - seam, **sampling)
    req.sampling.resumed_output_tokens = seam
    after = await stream(mig.router.grpc, req)
    assert after.error is None, after.error
    return after.tokens


async def test_a_json_schema_stream_stays_valid_across_the_seam(mig: MigrationMesh) -> None:
    ids, at = prompt_ids(31), random.Random(31).randrange(3, 40)
    grammar = {"json_schema": json.dumps(_SCHEMA)}
    whole = await stream(mig.router.grpc, request("whole", ids, 800, **grammar))
    out, seam = await _killed_mid_stream(mig, "schema", ids, 800, at, **grammar)
    assert out.finish == types_pb2.FINISH_REASON_STOP and len(out.tokens) > seam + 10, out
    value = json.loads(out.text)
    assert list(value) == ["xs"] and len(value["xs"]) == _ITEMS
    assert all(isinstance(x, int) and 0 <= x <= 99 for x in value["xs"])
    assert out.text == mig.text(ids, out.tokens)
    assert out.tokens[seam:] == await _continued(mig, ids, out, seam, 800, **grammar)
    print(f"json schema: seam at {seam}; equal to the uninterrupted run: {out.tokens == whole.tokens}")


async def test_a_frequency_penalty_continues_the_uninterrupted_run(mig: MigrationMesh) -> None:
    ids, at, max_tokens = prompt_ids(41), random.Random(41).randrange(5, 40), 500
    penalty = {"frequency_penalty": 1.0}
    plain = await fresh(mig, ids, max_tokens)
    whole = await fresh(mig, ids, max_tokens, **penalty)
    assert whole.tokens != plain.tokens  # the penalty shapes this answer
    out, seam = await _killed_mid_stream(mig, "penalty", ids, max_tokens, at, **penalty)
    assert len(out.tokens) == max_tokens and out.finish == types_pb2.FINISH_REASON_LENGTH, out
    after = await _continued(mig, ids, out, seam, max_tokens, **penalty)
    assert out.tokens[seam:] == after
    # Without the field the tokens sent would be plain prompt, the penalty blind to them.
    blind = await fresh(mig, ids + out.tokens[:seam], max_tokens - seam, **penalty)
    assert blind.tokens != after
    print(f"frequency penalty: seam at {seam}; equal to the uninterrupted run: {out.tokens == whole.tokens}")


async def test_min_tokens_counts_the_tokens_sent(mig: MigrationMesh) -> None:
    ids, at, max_tokens, least = prompt_ids(51), random.Random(51).randrange(5, 40), 700, 400
    # A stop token the logit bias makes the greedy choice whenever min_tokens leaves it unmasked: the
    # answer is exactly `least` other tokens, then the stop. A resumed request whose min_tokens were
    # not lowered by the tokens sent would run `seam` tokens longer.
    stop = 7
    rules: dict[str, object] = {"stop_token_ids": [stop], "min_tokens": least, "logit_bias": {stop: 100.0}}
    whole = await stream(mig.router.grpc, request("whole-min", ids, max_tokens, **rules))
    out, seam = await _killed_mid_stream(mig, "min", ids, max_tokens, at, **rules)
    assert out.finish == types_pb2.FINISH_REASON_STOP and len(out.tokens) == least + 1, (seam, out)
    assert out.tokens[-1] == stop and stop not in out.tokens[:least]
    assert out.tokens == whole.tokens
    later = {**rules, "min_tokens": least - seam}
    assert out.tokens[seam:] == await _continued(mig, ids, out, seam, max_tokens, **later)
    print(f"min_tokens: seam at {seam}; {len(out.tokens)} tokens")
