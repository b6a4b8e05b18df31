"""Opt-in, one or two GPUs: the sampling controls the SGLang peers declare (`xavier_sglang.features`)
take effect on real SGLang servers, through the router, for an SGLang P/D pair (xavier backend) and a
unified server:

- `logit_bias` pushing the end-of-sequence token ends the answer at once, and `min_tokens` then forbids
  it for N tokens;
- a JSON schema's and a regex's outputs are sentences of their grammars (JSON without free whitespace);
- `frequency_penalty` and `presence_penalty` change a greedy answer;
- `min_p` 1.0 at temperature 1 keeps only the most likely token (the greedy answer);
- `top_logprobs` returns k alternatives per token (the first token's too: on a pair the decode streams
  them, handed over from the prefill in the aux buffer) and `prompt_logprobs` one logprob per prompt
  token after the first, on the first response (on a pair, from the prefill's answer); the pair's
  equal the unified server's of the same mesh (greedy, within `TOL`; an alternative one side lacks
  may only be a near tie at the k-th place);
- `repetition_penalty` is refused by name on both.

The pd mesh also runs a unified server (GPU 0) to compare the pair's logprobs with.

Skipped unless `XAVIER_TEST_SGLANG=1`, a CUDA device and sglang importable; run as test_gpu_pd.py is
(same PYTHONPATH, `-o timeout=1500`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from xavier.v1 import types_pb2
from xavier_client import Client, InvalidArgumentError

from tests.cli.mesh import Mesh

# The GPU tests' gate (opt-in XAVIER_TEST_SGLANG=1, a CUDA device, sglang importable) is
# test_gpu_pd's: importing it skips this module with the same reason.
# The model (`gpu_model`) and the plugin's PYTHONPATH (`sglang_env`) are conftest's.
from tests.sglang.conftest import start_sglang
from tests.sglang.test_gpu_pd import PD_GPUS

pytestmark = [pytest.mark.sglang, pytest.mark.gpu, pytest.mark.slow]

PROMPT = [(5 * j) % 400 + 10 for j in range(24)]
TOL = 1e-2  # the pair's logprobs against the unified server's (fp16 model, float32 logprobs)
SCHEMA = {
    "type": "object",
    "properties": {"a": {"enum": ["x", "y"]}, "b": {"type": "boolean"}},
    "required": ["a", "b"],
}


def _eos(checkpoint: Path) -> int:
    eos = json.loads((checkpoint / "config.json").read_text())["eos_token_id"]
    return int(eos[0] if isinstance(eos, list) else eos)


@pytest.fixture(scope="module", params=["pd", "colocated"])
def mesh(
    request: pytest.FixtureRequest,
    gpu_model: Path,
    sglang_env: None,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, Mesh]]:
    mode = str(request.param)
    # The pd mesh's unified server (GPU 0, after the pair) is what the pair's logprobs are compared with.
    flags = ["--gpus", PD_GPUS, "--unified", "1"] if mode == "pd" else ["--unified", "1", "--gpus", "0"]
    tmp = tmp_path_factory.mktemp(mode)
    up = start_sglang(tmp, gpu_model, mode, *flags)
    yield mode, up
    assert up.stop(timeout=120) == 0


def test_logit_bias_and_min_tokens(mesh: tuple[str, Mesh], gpu_model: Path) -> None:
    mode, up = mesh
    eos = _eos(gpu_model)
    with Client(up.grpc, timeout=300) as client:
        ended = client.generate(PROMPT, max_tokens=16, mode=mode, logit_bias={eos: 100.0})
        assert ended.token_ids == [eos] and ended.finish_reason == "stop"
        held = client.generate(PROMPT, max_tokens=16, mode=mode, logit_bias={eos: 100.0}, min_tokens=5)
        assert eos not in held.token_ids[:5] and held.token_ids[5:] == [eos], held.token_ids
        assert held.finish_reason == "stop"


def test_grammars_shape_the_output(mesh: tuple[str, Mesh]) -> None:
    mode, up = mesh
    with Client(up.grpc, timeout=300) as client:
        out = client.generate(PROMPT, max_tokens=32, mode=mode, json_schema=json.dumps(SCHEMA))
        assert out.finish_reason == "stop", out.text
        value = json.loads(out.text)
        assert set(value) == {"a", "b"} and value["a"] in ("x", "y") and isinstance(value["b"], bool)
        assert out.text == json.dumps(value)  # no free whitespace: the separators of Xavier's grammars
        obj = client.generate(PROMPT, max_tokens=48, mode=mode, json_object=True)
        assert obj.finish_reason != "stop" or isinstance(json.loads(obj.text), dict)
        regex = client.generate(PROMPT, max_tokens=8, mode=mode, regex="(yes|no)")
        assert regex.text in ("yes", "no") and regex.finish_reason == "stop"


def test_penalties_and_min_p(mesh: tuple[str, Mesh]) -> None:
    mode, up = mesh
    with Client(up.grpc, timeout=300) as client:
        plain = client.generate(PROMPT, max_tokens=48, mode=mode, ignore_eos=True)
        # Penalties only touch tokens the output already has: the greedy answer must repeat one.
        assert len(set(plain.token_ids)) < len(plain.token_ids), plain.token_ids
        for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
            got = client.generate(PROMPT, max_tokens=48, mode=mode, ignore_eos=True, **kw)
            assert got.token_ids != plain.token_ids, kw
        only_top = client.generate(
            PROMPT, max_tokens=48, mode=mode, ignore_eos=True, temperature=1.0, min_p=1.0
        )
        assert only_top.token_ids == plain.token_ids
        with pytest.raises(InvalidArgumentError) as info:
            client.generate(PROMPT, max_tokens=4, mode=mode, repetition_penalty=1.5)
        assert "repetition_penalty" in str(info.value)


@dataclass
class _Logprobs:
    """One greedy answer's tokens with their logprobs and alternatives, and the prompt's logprobs."""

    token_ids: list[int]
    logprobs: list[float]
    top: list[dict[int, float]]
    prompt: list[float]
    prompt_top: list[dict[int, float]]
    carried_at: list[int]  # the responses that carried the prompt's logprobs


def _alternatives(tops: Iterable[types_pb2.TopLogprobs]) -> list[dict[int, float]]:
    return [dict(zip(a.token_ids, a.logprobs, strict=True)) for a in tops]


def _logprobs(client: Client, mode: str, k: int) -> _Logprobs:
    stream = client.generate_stream(
        PROMPT, max_tokens=8, mode=mode, ignore_eos=True, logprobs=True, top_logprobs=k, prompt_logprobs=True
    )
    msgs = [c.raw for c in stream if c.raw is not None]
    carried = [i for i, m in enumerate(msgs) if m.HasField("prompt_logprobs")]
    prompt = msgs[carried[0]].prompt_logprobs if carried else types_pb2.PromptLogprobs()
    return _Logprobs(
        token_ids=[t for m in msgs for t in m.token_ids],
        logprobs=[v for m in msgs for v in m.logprobs],
        top=_alternatives(a for m in msgs for a in m.top_logprobs),
        prompt=list(prompt.logprobs),
        prompt_top=_alternatives(prompt.top_logprobs),
        carried_at=carried,
    )


def _same_alternatives(got: dict[int, float], want: dict[int, float], where: str) -> None:
    """Equal within TOL; a token only one side lists must be a near tie with the other's k-th."""
    for token in got.keys() & want.keys():
        assert got[token] == pytest.approx(want[token], abs=TOL), (where, token, got, want)
    for mine, other in ((got, want), (want, got)):
        for token in mine.keys() - other.keys():
            assert mine[token] <= min(other.values()) + TOL, (where, token, got, want)


def test_logprob_alternatives_and_prompt_logprobs(mesh: tuple[str, Mesh]) -> None:
    mode, up = mesh
    k = 3
    with Client(up.grpc, timeout=300) as client:
        out = _logprobs(client, mode, k)
        unified = _logprobs(client, "colocated", k) if mode == "pd" else out
    assert len(out.top) == len(out.token_ids) == len(out.logprobs) == 8
    for token, top, lp in zip(out.token_ids, out.top, out.logprobs, strict=True):
        assert len(top) == k and token in top and top[token] == pytest.approx(lp, abs=1e-3)
    assert out.carried_at == [0]  # the first response, before any later one
    assert len(out.prompt) == len(out.prompt_top) == len(PROMPT) - 1
    assert all(len(top) == k for top in out.prompt_top)
    # The pair's against the unified server's (greedy: the same tokens).
    assert out.token_ids == unified.token_ids
    assert out.logprobs == pytest.approx(unified.logprobs, abs=TOL)
    assert out.prompt == pytest.approx(unified.prompt, abs=TOL)
    for i, (got, want) in enumerate(zip(out.top, unified.top, strict=True)):
        _same_alternatives(got, want, f"output token {i}")
    for i, (got, want) in enumerate(zip(out.prompt_top, unified.prompt_top, strict=True)):
        _same_alternatives(got, want, f"prompt token {i + 1}")
