"""The OpenAI-compatible HTTP front, checked with the official `openai` client against `xavier up`."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.cli.mesh import Mesh

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def oa(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{mesh.http}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models(oa: openai.OpenAI, mesh: Mesh) -> None:
    models = oa.models.list().data
    assert [m.id for m in models] == [mesh.model.name]


@pytest.mark.parametrize("mode", ["pd", "colocated"])
def test_completion_unary_and_stream_agree(oa: openai.OpenAI, mesh: Mesh, mode: str) -> None:
    kw = {
        "model": mesh.model.name,
        "prompt": "The quick brown fox",
        "max_tokens": 8,
        "temperature": 0.0,
        "extra_body": {"xavier_mode": mode},
    }
    full = oa.completions.create(**kw)  # type: ignore[call-overload]
    assert full.object == "text_completion"
    assert full.choices[0].finish_reason == "length"
    assert full.usage is not None and full.usage.completion_tokens == 8
    assert full.usage.total_tokens == full.usage.prompt_tokens + 8
    chunks = list(oa.completions.create(stream=True, **kw))  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_unary_stream_and_logprobs(oa: openai.OpenAI, mesh: Mesh) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    full = oa.chat.completions.create(
        model=mesh.model.name, messages=messages, max_tokens=6, temperature=0, logprobs=True, seed=7
    )
    msg = full.choices[0].message
    assert full.object == "chat.completion" and msg.role == "assistant"
    assert full.choices[0].logprobs is not None
    assert len(full.choices[0].logprobs.content or []) == 6
    assert all(lp.logprob <= 0 for lp in full.choices[0].logprobs.content or [])
    stream = oa.chat.completions.create(
        model=mesh.model.name,
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    # As OpenAI: the usage in a last chunk of its own, with no choices; null on every other chunk.
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"


def test_sampling_with_seed_is_reproducible(oa: openai.OpenAI, mesh: Mesh) -> None:
    kw = {
        "model": mesh.model.name,
        "prompt": "Once upon a time",
        "max_tokens": 8,
        "temperature": 1.0,
        "top_p": 0.9,
        "seed": 1234,
    }
    a = oa.completions.create(**kw)  # type: ignore[call-overload]
    b = oa.completions.create(**kw)  # type: ignore[call-overload]
    assert a.choices[0].text == b.choices[0].text


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"prompt": ""}, "EMPTY_PROMPT"),
        ({"prompt": "hi", "max_tokens": 0}, "INVALID_MAX_TOKENS"),
        ({"prompt": "hi", "max_tokens": -3}, "INVALID_MAX_TOKENS"),
        ({"prompt": "hi", "max_tokens": 10**6}, "MAX_TOKENS_TOO_LARGE"),
        ({"prompt": "hello " * 5000, "max_tokens": 1}, "PROMPT_TOO_LONG"),
        ({"prompt": "hi", "n": 257}, "UNSUPPORTED_N"),
        ({"prompt": "hi", "model": "no-such-model"}, "UNKNOWN_MODEL"),
        ({"prompt": "hi", "temperature": -1}, "INVALID_SAMPLING"),
    ],
)
def test_bad_requests_are_400_with_reason(mesh: Mesh, body: dict[str, object], code: str) -> None:
    body = {"model": mesh.model.name, **body}
    r = httpx.post(f"http://{mesh.http}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == code


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_too_large_names_the_parameter_the_client_used(mesh: Mesh, key: str) -> None:
    body = {"model": mesh.model.name, "messages": [{"role": "user", "content": "hi"}], key: 10**6}
    r = httpx.post(f"http://{mesh.http}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "MAX_TOKENS_TOO_LARGE" and r.json()["error"]["param"] == key


def test_bad_chat_is_400_through_the_client(oa: openai.OpenAI, mesh: Mesh) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oa.chat.completions.create(model=mesh.model.name, messages=[], max_tokens=4)
    assert info.value.code == "EMPTY_PROMPT"
    assert info.value.status_code == 400


def test_models_retrieve(oa: openai.OpenAI, mesh: Mesh) -> None:
    got = oa.models.retrieve(mesh.model.name)
    assert got.id == mesh.model.name and got.object == "model"
    with pytest.raises(openai.NotFoundError) as err:
        oa.models.retrieve("no-such-model")
    assert err.value.status_code == 404 and "no-such-model" in str(err.value)


def test_chat_without_max_tokens_runs_to_the_context_limit(mesh: Mesh) -> None:
    """OpenAI's default for chat: no cap but the context. A prompt that leaves a few tokens of context
    gets exactly those (ignore_eos), not the completions default of 16."""
    info = httpx.get(f"http://{mesh.http}/v1/models", timeout=30).json()["data"][0]
    limit = int(info["max_model_len"])
    body = {
        "model": mesh.model.name,
        "messages": [{"role": "user", "content": "a " * (limit - 60)}],
        "ignore_eos": True,
    }
    got = httpx.post(f"http://{mesh.http}/v1/chat/completions", json=body, timeout=120).json()
    usage = got["usage"]
    assert usage["completion_tokens"] == limit - usage["prompt_tokens"] > 16, usage
    assert got["choices"][0]["finish_reason"] == "length"


def test_stop_token_ids_end_the_answer(mesh: Mesh) -> None:
    from xavier_client import Client

    prompt = "The quick brown fox"
    with Client(mesh.grpc) as client:
        ids = list(client.generate(prompt, max_tokens=12, temperature=0.0, ignore_eos=True).token_ids)
    body = {
        "model": mesh.model.name,
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
    }
    stopped = httpx.post(
        f"http://{mesh.http}/v1/completions", json={**body, "stop_token_ids": [ids[2]]}, timeout=60
    ).json()
    assert stopped["choices"][0]["finish_reason"] == "stop", stopped
    assert stopped["usage"]["completion_tokens"] == ids.index(ids[2]) + 1


def test_a_prompt_batch_answers_each_prompt_in_order(oa: openai.OpenAI, mesh: Mesh) -> None:
    """OpenAI's `prompt` list (lm-eval's batches, LangChain's batch): one choice per prompt, indexed in
    order, each the answer the prompt gets alone; usage adds them up."""
    prompts = ["The quick brown fox", "A journey of a thousand miles", "Once upon a time"]
    kw = {"model": mesh.model.name, "max_tokens": 5, "temperature": 0.0}
    alone = [oa.completions.create(prompt=p, **kw) for p in prompts]  # type: ignore[call-overload]
    batch = oa.completions.create(prompt=prompts, **kw)  # type: ignore[call-overload]
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage is not None
    assert batch.usage.completion_tokens == 15
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone if a.usage)


def test_n_choices_per_prompt_in_openais_order(oa: openai.OpenAI, mesh: Mesh) -> None:
    """`n`: every prompt's n choices, prompt after prompt, indexed in order; greedy choices equal the
    prompt's answer alone; seeded sampled choices reproduce; a prompt's tokens count once in usage."""
    prompts = ["The quick brown fox", "Once upon a time"]
    kw = {"model": mesh.model.name, "max_tokens": 5}
    alone = [oa.completions.create(prompt=p, temperature=0.0, **kw) for p in prompts]  # type: ignore[call-overload]
    out = oa.completions.create(prompt=prompts, n=3, temperature=0.0, **kw)  # type: ignore[call-overload]
    assert [c.index for c in out.choices] == list(range(6))
    assert [c.text for c in out.choices] == [a.choices[0].text for a in alone for _ in range(3)]
    assert out.usage is not None and out.usage.completion_tokens == 30
    assert out.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone if a.usage)
    chat = oa.chat.completions.create(
        messages=[{"role": "user", "content": "hi"}], n=2, temperature=1.0, seed=11, **kw
    )  # type: ignore[call-overload]
    again = oa.chat.completions.create(
        messages=[{"role": "user", "content": "hi"}], n=2, temperature=1.0, seed=11, **kw
    )  # type: ignore[call-overload]
    assert [c.index for c in chat.choices] == [0, 1]
    assert [c.message.content for c in chat.choices] == [c.message.content for c in again.choices]


@pytest.mark.parametrize(
    ("path", "body", "code", "param"),
    [
        ("completions", {"prompt": "hi", "model": "no-such-model"}, "UNKNOWN_MODEL", "model"),
        ("completions", {"prompt": [1, 10**7]}, "INVALID_TOKEN_ID", "prompt"),
        ("completions", {"prompt": "hello " * 5000}, "PROMPT_TOO_LONG", "prompt"),
        (
            "chat/completions",
            {"messages": [{"role": "wizard", "content": "x"}]},
            "INVALID_CHAT",
            "messages[0].role",
        ),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "hello " * 5000}]},
            "PROMPT_TOO_LONG",
            "messages",
        ),
    ],
)
def test_errors_name_the_parameter(
    mesh: Mesh, path: str, body: dict[str, object], code: str, param: str
) -> None:
    r = httpx.post(f"http://{mesh.http}/v1/{path}", json={"model": mesh.model.name, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == code and r.json()["error"]["param"] == param, r.json()
