"""OpenAI logprobs through the whole mesh: alternatives per token (completions `logprobs` N, chat
`top_logprobs`), `echo` with the prompt's logprobs, `max_tokens: 0` with `echo`, and lm-eval's
loglikelihood requests. Every value is checked against a transformers forward pass of the mesh's tiny
checkpoint (log_softmax of its logits)."""

from __future__ import annotations

import json
from functools import cache
from operator import itemgetter
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.cli.mesh import Mesh

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.integration

_TOL = 2e-4  # float32 on the CPU: the engine's paged forward against transformers' dense one
_TIE = 1e-3  # alternatives closer than this may be ordered either way by the two forwards
_HI = [{"role": "user", "content": "a"}]
_PROMPTS = ([5, 17, 99, 3, 250, 41, 8, 77, 12], [300, 2, 64, 64, 9, 130])


@cache
def _hf(model: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


@cache
def _tok(model: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(model)


def _logprobs(model: Path, ids: list[int]) -> torch.Tensor:
    """Row i: the log-distribution of token i + 1 given tokens 0..i."""
    with torch.no_grad():
        return torch.log_softmax(_hf(model)(torch.tensor([ids])).logits[0].float(), dim=-1)


def _text(model: Path, token: int) -> str:
    return str(_tok(model).decode([token], skip_special_tokens=False))


def _post(mesh: Mesh, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"http://{mesh.http}/v1/{path}", json={"model": mesh.model.name, **body}, timeout=120)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _check_alternatives(got: dict[str, float], row: torch.Tensor, chosen: int, n: int, model: Path) -> None:
    """`got` holds the n most likely tokens of `row` and the chosen one, with their logprobs."""
    values, ids = torch.topk(row, n + 1)
    expect = {_text(model, int(t)): float(v) for t, v in zip(ids[:n], values[:n], strict=True)}
    expect.setdefault(_text(model, chosen), float(row[chosen]))
    if float(values[n - 1] - values[n]) < _TIE:  # the n-th place is a near tie: compare values only
        assert len(got) == len(expect)
    else:
        assert got.keys() == expect.keys()
        for key, value in expect.items():
            assert got[key] == pytest.approx(value, abs=_TOL)


@pytest.mark.parametrize("mode", ["pd", "colocated"])
def test_echo_logprobs_are_the_models(mesh: Mesh, mode: str) -> None:
    prompt = _PROMPTS[0]
    n = 3
    got = _post(
        mesh,
        "completions",
        {"prompt": prompt, "echo": True, "logprobs": n, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
         "xavier_mode": mode},
    )  # fmt: skip
    lp = got["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 4 == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing scores token 0
    # Greedy generation: each generated token is the argmax after everything before it.
    generated: list[int] = []
    for _ in range(4):
        row = _logprobs(mesh.model, prompt + generated)[-1]
        generated.append(int(row.argmax()))
    ids = prompt + generated
    rows = _logprobs(mesh.model, ids)
    assert lp["tokens"] == [_text(mesh.model, t) for t in ids]
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(float(rows[i - 1, ids[i]]), abs=_TOL), i
        _check_alternatives(lp["top_logprobs"][i], rows[i - 1], ids[i], n, mesh.model)
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    assert lp["text_offset"] == offsets
    text = got["choices"][0]["text"]
    assert text == "".join(lp["tokens"])  # a token-id prompt echoes as its decoded text
    assert got["usage"]["completion_tokens"] == 4 and got["usage"]["prompt_tokens"] == len(prompt)


def test_echo_streamed_is_the_same_answer(mesh: Mesh) -> None:
    body = {"prompt": "The quick brown fox", "echo": True, "logprobs": 2, "max_tokens": 5, "temperature": 0}
    whole = _post(mesh, "completions", body)["choices"][0]
    chunks = []
    with httpx.stream(
        "POST",
        f"http://{mesh.http}/v1/completions",
        json={"model": mesh.model.name, "stream": True, **body},
        timeout=120,
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:])["choices"][0])
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert whole["text"].startswith("The quick brown fox")
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for c in chunks if c["logprobs"] for v in c["logprobs"][key]] == whole["logprobs"][key]
    assert chunks[-1]["finish_reason"] == whole["finish_reason"]


def test_echo_without_logprobs_and_max_tokens_zero(mesh: Mesh) -> None:
    prompt = "Once upon a time"
    plain = _post(mesh, "completions", {"prompt": prompt, "echo": True, "max_tokens": 3, "temperature": 0})
    alone = _post(mesh, "completions", {"prompt": prompt, "max_tokens": 3, "temperature": 0})
    assert plain["choices"][0]["text"] == prompt + alone["choices"][0]["text"]
    assert plain["choices"][0]["logprobs"] is None
    zero = _post(mesh, "completions", {"prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 1})
    choice = zero["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert zero["usage"]["completion_tokens"] == 0
    ids = list(_tok(mesh.model)(prompt)["input_ids"])
    assert choice["logprobs"]["tokens"] == [_text(mesh.model, t) for t in ids]
    rows = _logprobs(mesh.model, ids)
    expect = [None] + [pytest.approx(float(rows[i - 1, ids[i]]), abs=_TOL) for i in range(1, len(ids))]
    assert choice["logprobs"]["token_logprobs"] == expect
    r = httpx.post(
        f"http://{mesh.http}/v1/completions",
        json={"model": mesh.model.name, "prompt": prompt, "max_tokens": 0},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"  # 0 only with echo


@pytest.mark.parametrize("mode", ["pd", "colocated"])
def test_chat_top_logprobs_are_the_models(mesh: Mesh, mode: str) -> None:
    n = 4
    body = {
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": n,
        "xavier_mode": mode,
    }
    got = _post(mesh, "chat/completions", body)
    content = got["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    # The same tokens scored by transformers after the chat prompt, rendered by the model's template.
    text = _tok(mesh.model).apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
    prompt = list(_tok(mesh.model)(text, add_special_tokens=False)["input_ids"])
    generated = []
    for entry in content:
        row = _logprobs(mesh.model, prompt + generated)[-1]
        chosen = int(row.argmax())
        assert entry["token"] == _text(mesh.model, chosen)
        assert entry["logprob"] == pytest.approx(float(row[chosen]), abs=_TOL)
        alts = entry["top_logprobs"]
        assert len(alts) == n and alts[0]["token"] == entry["token"]
        values, ids = torch.topk(row, n + 1)
        assert [a["logprob"] for a in alts] == [pytest.approx(float(v), abs=_TOL) for v in values[:n]]
        if float(values[n - 1] - values[n]) >= _TIE:
            assert [a["token"] for a in alts] == [_text(mesh.model, int(t)) for t in ids[:n]]
        assert all(a["bytes"] == list(a["token"].encode()) or "\ufffd" in a["token"] for a in alts)
        generated.append(chosen)


def _lm_eval_parse_logprobs(outputs: list[dict[str, Any]], ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval 0.4's `LocalCompletionsAPI.parse_logprobs` (lm_eval/models/openai_completions.py), as it
    reads a loglikelihood answer: the continuation's summed logprobs and whether each of its tokens was
    the most likely one."""
    res = []
    for out in outputs:
        for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens, strict=False):
            assert ctxlen > 0
            logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
            tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
            top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
            is_greedy = True
            for tok, top in zip(tokens_logprobs, top_logprobs, strict=False):
                if tok != max(top.values()):
                    is_greedy = False
                    break
            res.append((logprobs, is_greedy))
    return res


def test_lm_eval_loglikelihood_requests(mesh: Mesh) -> None:
    """lm-eval's `local-completions` loglikelihood request (its `_create_payload` with generate=False):
    a batch of token-id prompts, each context + continuation, `echo` and `logprobs: 1`, one token."""
    context = _PROMPTS[1]
    greedy: list[int] = []
    for _ in range(3):
        greedy.append(int(_logprobs(mesh.model, context + greedy)[-1].argmax()))
    other = [int(_logprobs(mesh.model, context)[-1].argsort()[5]), 7, 7]  # not the greedy first token
    requests = [context + greedy, context + other]
    payload = {
        "model": mesh.model.name,
        "prompt": requests,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    r = httpx.post(f"http://{mesh.http}/v1/completions", json=payload, timeout=120)
    assert r.status_code == 200, r.text
    got = _lm_eval_parse_logprobs([r.json()], [len(context)] * 2)
    for (total, is_greedy), ids, want_greedy in zip(got, requests, (True, False), strict=True):
        rows = _logprobs(mesh.model, ids)
        expect = sum(float(rows[i - 1, ids[i]]) for i in range(len(context), len(ids)))
        assert total == pytest.approx(expect, abs=4 * _TOL)
        assert is_greedy is want_greedy


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("completions", {"prompt": "a", "logprobs": 21}, "logprobs"),
        ("chat/completions", {"messages": _HI, "top_logprobs": 3}, "top_logprobs"),
        ("chat/completions", {"messages": _HI, "echo": True}, "echo"),
    ],
)  # fmt: skip
def test_bad_logprobs_requests_are_400_naming_the_parameter(
    mesh: Mesh, path: str, body: dict[str, Any], param: str
) -> None:
    r = httpx.post(f"http://{mesh.http}/v1/{path}", json={"model": mesh.model.name, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
