"""Xavier's sampling controls reach SGLang as the installed release's own classes read them: every body
`sglang_host.protocol.generate_body` builds parses as that release's `GenerateReqInput`, its
`sampling_params` build a real `SamplingParams` that `normalize()` (with the model's tokenizer) and
`verify()` accept with the values meant, a request using none of the controls maps to exactly the body
of before, and answers in the shape SGLang's `TokenizerManager.add_logprob_to_meta_info` builds parse
back into Xavier's top and prompt logprobs (a pair's decode is asked for no prompt logprobs). Run under
0.5.23 and the 0.5.17 overlay.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.managers.io_struct", reason="the real sglang package is not installed")

from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.sampling.sampling_params import SamplingParams
from xavier.v1 import types_pb2
from xavier_services.router.request import needed_features
from xavier_services.sglang_host.protocol import Deltas, generate_body
from xavier_sglang.features import PAIR_FEATURES, UNIFIED_FEATURES

pytestmark = pytest.mark.sglang

PROMPT = [5, 6, 7, 8]
SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})

# One request per control SGLang honours, and the sampling_params key and value it must reach.
CONTROLS: dict[str, tuple[types_pb2.SamplingParams, str, Any]] = {
    "min_p": (types_pb2.SamplingParams(min_p=0.25), "min_p", 0.25),
    "min_tokens": (types_pb2.SamplingParams(min_tokens=3), "min_new_tokens", 3),
    "presence_penalty": (types_pb2.SamplingParams(presence_penalty=0.5), "presence_penalty", 0.5),
    "frequency_penalty": (types_pb2.SamplingParams(frequency_penalty=-1.5), "frequency_penalty", -1.5),
    "logit_bias": (
        types_pb2.SamplingParams(logit_bias={9: -2.5, 3: 1.0}),
        "logit_bias",
        {"3": 1.0, "9": -2.5},
    ),
    "include_stop_str_in_output": (
        types_pb2.SamplingParams(include_stop_str_in_output=True, stop=["x"]),
        "no_stop_trim",
        True,
    ),
    "json_schema": (types_pb2.SamplingParams(json_schema=SCHEMA), "json_schema", SCHEMA),
    "json_object": (types_pb2.SamplingParams(json_object=True), "json_schema", '{"type": "object"}'),
    "regex": (types_pb2.SamplingParams(regex="[ab]{2,4}"), "regex", "[ab]{2,4}"),
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


def _sampling(**kw: Any) -> types_pb2.SamplingParams:
    base = types_pb2.SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, top_k=20, seed=7)
    base.MergeFrom(types_pb2.SamplingParams(**kw))
    return base


def _as_sglang(body: dict[str, Any], tokenizer: Any) -> tuple[GenerateReqInput, SamplingParams]:
    """What SGLang's HTTP server and tokenizer manager do with a body (`_create_tokenized_object`)."""
    obj = GenerateReqInput(**json.loads(json.dumps(body)))  # the body crosses as JSON
    obj.normalize_batch_and_arguments()
    params = SamplingParams(**obj.sampling_params)
    params.normalize(tokenizer)
    params.verify(len(tokenizer))
    return obj, params


def test_a_request_using_no_control_maps_to_the_body_of_before(tokenizer: Any) -> None:
    s = _sampling(stop=["\n"], stop_token_ids=[2], logprobs=True)
    body = generate_body("r1", PROMPT, s, bootstrap=("127.0.0.1", 7000, 42))
    assert body == {
        "input_ids": PROMPT,
        "sampling_params": {
            "max_new_tokens": 8,
            "temperature": pytest.approx(0.7),
            "top_p": pytest.approx(0.9),
            "ignore_eos": False,
            "top_k": 20,
            "stop": ["\n"],
            "stop_token_ids": [2],
            "sampling_seed": 7,
        },
        "stream": True,
        "return_logprob": True,
        "rid": "r1",
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": 7000,
        "bootstrap_room": 42,
    }
    obj, params = _as_sglang(body, tokenizer)
    assert obj.logprob_start_len == -1 and obj.top_logprobs_num == 0  # SGLang's defaults
    assert (params.min_p, params.min_new_tokens, params.no_stop_trim) == (0.0, 0, False)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.0, 0.0, 1.0)
    assert params.logit_bias is None and params.json_schema is None and params.regex is None


@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_each_control_reaches_sglangs_sampling_params(name: str, tokenizer: Any) -> None:
    extra, key, want = CONTROLS[name]
    s = _sampling()
    s.MergeFrom(extra)
    _, params = _as_sglang(generate_body("r", PROMPT, s), tokenizer)
    assert getattr(params, key) == (pytest.approx(want) if isinstance(want, float) else want)
    # Every control that maps is one the SGLang peers declare.
    assert {f for f, _ in needed_features(s)} <= set(PAIR_FEATURES)


def test_all_controls_together_are_accepted(tokenizer: Any) -> None:
    s = _sampling(
        min_p=0.1,
        presence_penalty=0.3,
        frequency_penalty=0.4,
        logit_bias={4: 5.0},
        include_stop_str_in_output=True,
        stop=["zz"],
        regex="[0-9]+",
        logprobs=True,
        top_logprobs=5,
        prompt_logprobs=True,
    )
    obj, params = _as_sglang(generate_body("r", PROMPT, s), tokenizer)
    assert (obj.return_logprob, obj.top_logprobs_num, obj.logprob_start_len) == (True, 5, 0)
    assert (params.min_p, params.regex, params.no_stop_trim) == (pytest.approx(0.1), "[0-9]+", True)
    assert params.logit_bias == {"4": 5.0} and params.stop_strs == ["zz"]
    assert {f for f, _ in needed_features(s)} <= set(UNIFIED_FEATURES)
    # min_tokens with a schema (the router refuses min_tokens with any grammar, so separately).
    s2 = _sampling(min_tokens=2, stop_token_ids=[3], json_schema=SCHEMA)
    _, params = _as_sglang(generate_body("r", PROMPT, s2), tokenizer)
    assert (params.min_new_tokens, params.json_schema, params.stop_token_ids) == (2, SCHEMA, {3})


def test_a_pairs_prefill_is_asked_for_the_prompts_logprobs_and_its_decode_is_not(tokenizer: Any) -> None:
    # SGLang's decode never sends the prompt's logprobs (its output streamer skips them in decode mode):
    # the pair's prefill answers them, and both compute the first token's alternatives.
    s = _sampling(logprobs=True, top_logprobs=4, prompt_logprobs=True)
    bootstrap = ("127.0.0.1", 7000, 42)
    prefill, _ = _as_sglang(generate_body("p", PROMPT, s, stream=False, bootstrap=bootstrap), tokenizer)
    decode, _ = _as_sglang(
        generate_body("d", PROMPT, s, bootstrap=bootstrap, with_prompt_logprobs=False), tokenizer
    )
    assert (prefill.return_logprob, prefill.top_logprobs_num, prefill.logprob_start_len) == (True, 4, 0)
    assert (decode.return_logprob, decode.top_logprobs_num, decode.logprob_start_len) == (True, 4, -1)
    assert decode.bootstrap_room == prefill.bootstrap_room == 42
    assert {f for f, _ in needed_features(s)} <= set(PAIR_FEATURES)
    # The prompt's logprobs alone still ask SGLang for logprobs: without return_logprob its scheduler
    # drops logprob_start_len (0.5.23 scheduler.py L3256, 0.5.17 L2542).
    alone = _sampling(prompt_logprobs=True)
    prefill, _ = _as_sglang(generate_body("p", PROMPT, alone, stream=False, bootstrap=bootstrap), tokenizer)
    decode, _ = _as_sglang(
        generate_body("d", PROMPT, alone, bootstrap=bootstrap, with_prompt_logprobs=False), tokenizer
    )
    assert (prefill.return_logprob, prefill.logprob_start_len) == (True, 0)
    assert (decode.return_logprob, decode.logprob_start_len) == (False, -1)


def _entries(vals: list[Any], ids: list[Any]) -> list[Any]:
    """`TokenizerManager.detokenize_logprob_tokens` without text: `(logprob, token_id, None)` per token
    (0.5.23 tokenizer_manager.py L3098-3116, 0.5.17 the same method); a position without values is None
    (`detokenize_top_logprobs_tokens`, L3118-3136)."""
    return [(v, i, None) for v, i in zip(vals, ids, strict=True)]


def _meta(
    prompt: tuple[list[Any], list[Any]] | None,
    prompt_top: tuple[list[Any], list[Any]] | None,
    out: tuple[list[Any], list[Any]],
    out_top: tuple[list[Any], list[Any]] | None,
    finished: bool,
) -> dict[str, Any]:
    """meta_info as `TokenizerManager.add_logprob_to_meta_info` fills it (0.5.23 tokenizer_manager.py
    L2840-2970, 0.5.17 L2481-2590: the same keys): `input_token_logprobs`, `output_token_logprobs`
    cumulative; with top_logprobs_num > 0 also `input_top_logprobs` and `output_top_logprobs`, one list of
    alternatives per position. The scheduler's values (`logprob_result_processor`
    `_process_input_token_logprobs` / `_process_input_top_logprobs`) start the prompt with None: its
    first token has no logprob. The event crosses as JSON, so tuples arrive as lists."""
    meta: dict[str, Any] = {
        "id": "r",
        "finish_reason": {"type": "length", "length": 3} if finished else None,
        "input_token_logprobs": _entries(*prompt) if prompt else [],
        "output_token_logprobs": _entries(*out),
        "output_token_logprobs_length": len(out[0]),
    }
    if out_top is not None:
        meta["input_top_logprobs"] = (
            [_entries(v, i) if v else None for v, i in zip(*prompt_top, strict=True)] if prompt_top else []
        )
        meta["output_top_logprobs"] = [_entries(v, i) if v else None for v, i in zip(*out_top, strict=True)]
    result: dict[str, Any] = json.loads(json.dumps(meta))
    return result


def test_top_and_prompt_logprobs_parse_from_sglangs_meta_info() -> None:
    prompt = ([None, -1.0, -2.0, -3.0], PROMPT)
    prompt_top = ([None, [-0.5, -1.0], [-0.25, -2.0], [-0.1, -3.0]], [None, [11, 6], [12, 7], [13, 8]])
    deltas = Deltas()
    meta = _meta(prompt, prompt_top, ([-0.7], [40]), ([[-0.7, -0.9]], [[40, 41]]), False)
    first = deltas.next({"text": "a", "output_ids": [40], "meta_info": meta})
    assert first.token_ids == [40] and first.logprobs == [pytest.approx(-0.7)]
    assert [list(t.token_ids) for t in first.top_logprobs] == [[40, 41]]
    assert first.prompt_logprobs is not None
    assert list(first.prompt_logprobs.logprobs) == [-1.0, -2.0, -3.0]  # prompt tokens 1.. under those before
    tops = first.prompt_logprobs.top_logprobs
    assert [list(t.token_ids) for t in tops] == [[11, 6], [12, 7], [13, 8]]
    assert list(tops[0].logprobs) == [-0.5, -1.0]
    # The next events are cumulative: only the new tokens' alternatives, the prompt's never again.
    out = ([-0.7, -0.25, -0.5], [40, 50, 60])
    out_top = ([[-0.7, -0.9], [-0.25, -4.0], [-0.5, -5.0]], [[40, 41], [50, 51], [60, 61]])
    last = deltas.next(
        {"text": "abc", "output_ids": out[1], "meta_info": _meta(prompt, prompt_top, out, out_top, True)}
    )
    assert last.token_ids == [50, 60] and last.text == "bc"
    assert [list(t.token_ids) for t in last.top_logprobs] == [[50, 51], [60, 61]]
    assert [list(t.logprobs) for t in last.top_logprobs] == [[-0.25, -4.0], [-0.5, -5.0]]
    assert last.prompt_logprobs is None and last.finish == types_pb2.FINISH_REASON_LENGTH


def test_without_logprob_controls_the_answer_parses_as_before() -> None:
    # logprob_start_len -1 (the default): no prompt positions; top_logprobs_num 0: no top keys.
    delta = Deltas().next(
        {"text": "a", "output_ids": [40], "meta_info": _meta(None, None, ([-0.7], [40]), None, False)}
    )
    assert delta.logprobs == [pytest.approx(-0.7)]
    assert delta.top_logprobs == [] and delta.prompt_logprobs is None
