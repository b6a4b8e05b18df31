"""Opt-in, one or two GPUs: the sampling controls the SGLang peers declare (`xavier_sglang.features`)
take effect on real SGLang servers, through the router, for an SGLang P/D pair (xavier backend) and a
unified server:

- `logit_bias` pushing the end-of-sequence token ends the answer at once, and `min_tokens` then forbids
  it for N tokens;
- a JSON schema's and a regex's outputs are sentences of their grammars (JSON without free whitespace);
- `frequency_penalty` and `presence_penalty` change a greedy answer;
- `min_p` 1.0 at temperature 1 keeps only the most likely token (the greedy answer);
- on the unified server, `top_logprobs` returns k alternatives per token and `prompt_logprobs` one
  logprob per prompt token after the first; a pair refuses both by name (UNSUPPORTED_PARAMETER);
- `repetition_penalty` is refused by name on both.

Skipped unless `XAVIER_TEST_SGLANG=1`, a CUDA device and sglang importable; run as test_gpu_pd.py is
(same PYTHONPATH, `-o timeout=1500`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from xavier_client import Client, InvalidArgumentError

from tests.cli.mesh import Mesh

# The GPU tests' gate (opt-in XAVIER_TEST_SGLANG=1, a CUDA device, sglang importable) is
# test_gpu_pd's: importing it skips this module with the same reason.
# The model (`gpu_model`) and the plugin's PYTHONPATH (`sglang_env`) are conftest's.
from tests.sglang.conftest import start_sglang
from tests.sglang.test_gpu_pd import PD_GPUS

pytestmark = [pytest.mark.sglang, pytest.mark.gpu, pytest.mark.slow]

PROMPT = [(5 * j) % 400 + 10 for j in range(24)]
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
    flags = ["--gpus", PD_GPUS] if mode == "pd" else ["--unified", "1", "--gpus", "0"]
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


def test_logprob_alternatives_where_declared(mesh: tuple[str, Mesh]) -> None:
    mode, up = mesh
    with Client(up.grpc, timeout=300) as client:
        if mode == "pd":
            for kw in ({"top_logprobs": 3}, {"prompt_logprobs": True}):
                with pytest.raises(InvalidArgumentError):
                    client.generate(PROMPT, max_tokens=4, mode=mode, logprobs=True, **kw)
            return
        out = client.generate(PROMPT, max_tokens=8, mode=mode, ignore_eos=True, logprobs=True, top_logprobs=3)
        assert len(out.top_logprobs) == len(out.token_ids) == 8
        for token, top, lp in zip(out.token_ids, out.top_logprobs, out.logprobs, strict=True):
            assert len(top) == 3 and token in top and top[token] == pytest.approx(lp, abs=1e-3)
        stream = client.generate_stream(PROMPT, max_tokens=2, mode=mode, logprobs=True, prompt_logprobs=True)
        first = next(iter(stream))
        stream.cancel()
        assert first.raw is not None and len(first.raw.prompt_logprobs.logprobs) == len(PROMPT) - 1
