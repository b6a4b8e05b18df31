"""The SDK against `xavier up`: stream and unary agree, async cancel, models and status."""

from __future__ import annotations

import json
from typing import Any

import pytest
from xavier.v1 import router_service_pb2 as rpb
from xavier_client import AsyncClient, Client

from tests.cli.mesh import Mesh

pytestmark = pytest.mark.integration


def test_stream_and_unary_agree(mesh: Mesh) -> None:
    with Client(mesh.grpc) as client:
        chunks = list(client.generate_stream("Good morning", max_tokens=10, ignore_eos=True, logprobs=True))
        unary = client.generate("Good morning", max_tokens=10, ignore_eos=True, logprobs=True)
    ids = [i for c in chunks for i in c.token_ids]
    assert ids == unary.token_ids and len(ids) == 10
    assert "".join(c.text for c in chunks) == unary.text
    assert len(unary.logprobs) == 10
    assert unary.prompt_tokens > 0 and unary.completion_tokens == 10
    assert 0 < unary.time_to_first_token <= unary.total_time
    assert chunks[-1].finish_reason == "length"


@pytest.mark.parametrize("mode", ["pd", "colocated"])
def test_the_engine_controls_through_the_sdk(mesh: Mesh, mode: str) -> None:
    """Alternatives, a logit bias and a grammar, as Sampling fields, reach the engine over either path."""
    with Client(mesh.grpc) as client:
        tops = client.generate(
            "Good morning", max_tokens=3, ignore_eos=True, logprobs=True, top_logprobs=2, mode=mode
        )
        assert len(tops.top_logprobs) == 3 and all(len(alts) == 2 for alts in tops.top_logprobs)
        plain = client.generate("Good morning", max_tokens=4, ignore_eos=True, mode=mode)
        forced = next(t for t in range(100, 200) if t not in plain.token_ids)
        biased = client.generate(
            "Good morning", max_tokens=4, ignore_eos=True, logit_bias={forced: 100.0}, mode=mode
        )
        assert biased.token_ids == [forced] * 4
        answer = client.generate("Give me JSON", max_tokens=48, json_object=True, mode=mode)
        assert answer.finish_reason == "stop" and isinstance(json.loads(answer.text), dict), answer.text


def test_models_and_status(mesh: Mesh) -> None:
    with Client(mesh.grpc) as client:
        (model,) = client.list_models()
        st = client.cluster_status()
    assert model.id == mesh.model.name and model.max_context > 0
    assert set(model.modes) >= {rpb.ROUTING_MODE_PD, rpb.ROUTING_MODE_COLOCATED}
    assert model.layout.num_layers > 0
    roles = sorted(p.role for p in st.peers)
    assert len(roles) == 3 and st.default_mode == rpb.ROUTING_MODE_PD
    for p in st.peers:
        assert p.peer_id and p.epoch > 0 and p.address and not p.error
        assert p.model_name == mesh.model.name and len(p.contract_fingerprint) == 64
        assert p.engine.pages_total > 0
    assert st.HasField("rooms") and st.rooms.active == 0
    # The public status names no transfer endpoint, NIXL metadata or memory address, at any depth.
    assert _field_names(rpb.GetClusterStatusResponse.DESCRIPTOR).isdisjoint(
        {"endpoint", "agent_name", "agent_metadata", "regions", "base_address", "layout"}
    )


def _field_names(desc: Any, seen: set[str] | None = None) -> set[str]:
    seen = set() if seen is None else seen
    names: set[str] = set()
    if desc.full_name in seen:
        return names
    seen.add(desc.full_name)
    for f in desc.fields:
        names.add(f.name)
        if f.message_type is not None:
            names |= _field_names(f.message_type, seen)
    return names


async def test_async_cancel_mid_stream(mesh: Mesh) -> None:
    async with AsyncClient(mesh.grpc) as client:
        stream = client.generate_stream("Tell a long story", max_tokens=300, ignore_eos=True)
        n = 0
        async for _ in stream:
            n += 1
            if n == 2:
                stream.cancel()
        assert n == 2
        res = await client.generate("After cancel", max_tokens=3)
        assert res.completion_tokens == 3
