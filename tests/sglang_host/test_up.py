"""`xavier up --engine sglang` in its three modes, with the SGLang stand-in as the launcher: the router
answers through SGLang pairs (pd), unified SGLang replicas (colocated) and SGLang's own P/D (native),
and each replica got the GPU and the flags its mode needs."""

from __future__ import annotations

import argparse
import json
import tomllib
from pathlib import Path

import httpx
import pytest
from xavier_cli.sglang_up import replica_config
from xavier_cli.up import add_up_args
from xavier_client import Client, TlsOptions
from xavier_services.sglang_host.config import SglangSection

from tests.cli.mesh import Mesh, start_up
from tests.sglang_host.conftest import STANDIN, standin_state
from tests.support.sglang_standin import next_token

pytestmark = pytest.mark.integration


def _expected(prompt: list[int], n: int) -> list[int]:
    out = [next_token(prompt[-1])]
    while len(out) < n:
        out.append(next_token(out[-1]))
    return out


def _up(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch, *flags: str, insecure: bool = True
) -> Mesh:
    monkeypatch.setenv("XAVIER_STANDIN_DIR", str(tmp_path / "rendezvous"))
    common = ["--engine", "sglang", "--model", str(tiny_model), "--sglang-command", STANDIN]
    return start_up(tmp_path, tmp_path / "cache", *common, *flags, timeout=120, insecure=insecure)


def _standin(mesh: Mesh, name: str) -> dict[str, object]:
    info = json.loads((mesh.workdir / f"{name}.ready").read_text())
    return standin_state(info["sglang_url"])


def _pair(mesh: Mesh) -> tuple[dict[str, object], dict[str, object], list[str], list[str]]:
    """The stand-in states of prefill-0 and decode-0, and their command lines."""
    prefill, decode = _standin(mesh, "prefill-0"), _standin(mesh, "decode-0")
    pargv, dargv = prefill["argv"], decode["argv"]
    assert isinstance(pargv, list) and isinstance(dargv, list)
    return prefill, decode, pargv, dargv


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _refuses_what_sglang_does_not_declare(mesh: Mesh, mode: str) -> None:
    """SGLang replicas declare what their `/generate` honours (`xavier_sglang.features`): the router
    refuses the rest per request, and the hosting service what SGLang would do otherwise, each with a
    400 naming the parameter as the client sent it; what they declare reaches SGLang's body."""
    refused: list[tuple[dict[str, object], str]] = [
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"min_tokens": 1, "stop": ["x"]}, "min_tokens"),
        ({"stop_token_ids": [4], "include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ]
    for extra, param in refused:
        body = {"prompt": [3, 4, 5], "max_tokens": 2, "xavier_mode": mode, **extra}
        r = httpx.post(f"http://{mesh.http}/v1/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "UNSUPPORTED_PARAMETER" and r.json()["error"]["param"] == param
    passed: list[tuple[dict[str, object], dict[str, object]]] = [
        (
            {"presence_penalty": 0.5, "frequency_penalty": -0.5},
            {"presence_penalty": 0.5, "frequency_penalty": -0.5},
        ),
        ({"logit_bias": {"5": 1}, "min_p": 0.25}, {"logit_bias": {"5": 1.0}, "min_p": 0.25}),
        ({"min_tokens": 1}, {"min_new_tokens": 1}),
        ({"stop": ["x"], "include_stop_str_in_output": True}, {"no_stop_trim": True, "stop": ["x"]}),
        ({"response_format": {"type": "json_object"}}, {"json_schema": '{"type": "object"}'}),
        ({"guided_regex": "[a-z]+"}, {"regex": "[a-z]+"}),
    ]
    # lm-eval's loglikelihood shape; a pair's prefill answers the prompt's logprobs (its decode is not
    # asked for them), its decode the alternatives.
    passed.append(({"logprobs": 2, "echo": True}, {"top_logprobs_num": 2, "logprob_start_len": 0}))
    names = ["prefill-0", "decode-0"] if mode == "pd" else ["unified-0", "unified-1"]
    for extra, want in passed:
        body = {"prompt": [3, 4, 5], "max_tokens": 2, "xavier_mode": mode, **extra}
        r = httpx.post(f"http://{mesh.http}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        got = [_standin(mesh, name)["last_sampling"] for name in names]
        assert any(want.items() <= g.items() for g in got if isinstance(g, dict)), (extra, got, r.text)
    lp = r.json()["choices"][0]["logprobs"]  # the echo: the prompt's tokens, then the output's
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3 + 2
    assert lp["token_logprobs"][0] is None and None not in lp["token_logprobs"][1:]
    assert all(len(top) >= 2 for top in lp["top_logprobs"][1:]), lp
    if mode == "pd":
        decode = _standin(mesh, "decode-0")["last_sampling"]
        assert (
            isinstance(decode, dict) and "logprob_start_len" not in decode and decode["top_logprobs_num"] == 2
        )


def test_up_pd(tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mesh = _up(
        tmp_path,
        tiny_model,
        monkeypatch,
        "--mode",
        "pd",
        "--gpus",
        "0,1",
        "--sglang-arg=--log-level",
        "--sglang-arg",
        "warning",
    )
    try:
        with Client(mesh.grpc) as client:
            out = client.generate([3, 4, 5], max_tokens=6, mode="pd", ignore_eos=True)
        assert out.token_ids == _expected([3, 4, 5], 6)
        prefill, decode, pargv, dargv = _pair(mesh)
        # The SGLang processes register under the replicas' names: a restarted replica keeps its id.
        assert prefill["env"]["XAVIER_SGLANG_PEER_ID"] == "prefill-0"  # type: ignore[index]
        assert decode["env"]["XAVIER_SGLANG_PEER_ID"] == "decode-0"  # type: ignore[index]
        assert _flag(pargv, "--base-gpu-id") == "0" and _flag(dargv, "--base-gpu-id") == "1"
        assert _flag(pargv, "--disaggregation-transfer-backend") == "xavier"
        assert _flag(pargv, "--log-level") == "warning"  # passed through
        assert _flag(pargv, "--api-key") != _flag(dargv, "--api-key")  # a key per replica
        _refuses_what_sglang_does_not_declare(mesh, "pd")
    finally:
        assert mesh.stop() == 0


def test_up_pd_over_mtls_hands_the_sglang_process_its_services_identity(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default mesh (mTLS, identities): the SGLang-hosting services register and serve, and the SGLang
    process each starts gets the service's own certificate for the plugin's directory calls."""
    mesh = _up(tmp_path, tiny_model, monkeypatch, "--mode", "pd", "--gpus", "0,1", insecure=False)
    try:
        tls = json.loads((tmp_path / "up.json").read_text())["client_tls"]
        opts = TlsOptions(Path(tls["ca_file"]), Path(tls["key_file"]), Path(tls["cert_file"]))
        with Client(mesh.grpc, tls=opts) as client:
            out = client.generate([3, 4, 5], max_tokens=4, mode="pd", ignore_eos=True)
        assert out.token_ids == _expected([3, 4, 5], 4)
        prefill, decode, _, _ = _pair(mesh)
        for state, name in ((prefill, "prefill-0"), (decode, "decode-0")):
            env = state["env"]
            assert isinstance(env, dict)
            assert env["XAVIER_TLS__CERT_FILE"].endswith(f"{name}-cert.pem")
            assert env["XAVIER_SGLANG_PEER_ID"] == name
    finally:
        assert mesh.stop() == 0


def test_up_starts_replicas_that_share_a_gpu_one_after_another(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang sizes its KV pool from the memory free when it starts: on one GPU the decode's SGLang starts
    only once the prefill's service is ready (its SGLang answered /health, its pool allocated)."""
    mesh = _up(tmp_path, tiny_model, monkeypatch, "--mode", "pd", "--gpus", "0,0")
    try:
        prefill, decode, pargv, dargv = _pair(mesh)
        assert _flag(pargv, "--base-gpu-id") == "0" and _flag(dargv, "--base-gpu-id") == "0"
        prefill_ready = (mesh.workdir / "prefill-0.ready").stat().st_mtime
        assert float(decode["started_at"]) >= prefill_ready > float(prefill["started_at"])  # type: ignore[arg-type]
        assert "share a GPU" in mesh.log.read_text()
        with Client(mesh.grpc) as client:
            out = client.generate([3, 4, 5], max_tokens=4, mode="pd", ignore_eos=True)
        assert out.token_ids == _expected([3, 4, 5], 4)
    finally:
        assert mesh.stop() == 0


def test_up_native(tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mesh = _up(
        tmp_path,
        tiny_model,
        monkeypatch,
        "--mode",
        "native",
        "--gpus",
        "1,0",
        "--gpu-assign",
        "visible-devices",
    )
    try:
        with Client(mesh.grpc) as client:
            out = client.generate([7, 8], max_tokens=5, mode="native", ignore_eos=True)
        assert out.token_ids == _expected([7, 8], 5)
        prefill, decode, pargv, dargv = _pair(mesh)
        assert _flag(pargv, "--disaggregation-transfer-backend") == "nixl"
        assert _flag(pargv, "--disaggregation-mode") == "prefill"
        assert int(_flag(pargv, "--disaggregation-bootstrap-port")) > 0
        assert _flag(pargv, "--api-key") == _flag(dargv, "--api-key")  # the router's one key
        assert prefill["env"] == {"CUDA_VISIBLE_DEVICES": "1"} and decode["env"] == {
            "CUDA_VISIBLE_DEVICES": "0"
        }
        assert prefill["bad_key"] == 0 and decode["requests"] == 1
    finally:
        assert mesh.stop() == 0


def test_up_colocated(tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mesh = _up(tmp_path, tiny_model, monkeypatch, "--mode", "colocated", "--unified", "2")
    try:
        with Client(mesh.grpc) as client:
            for i in range(4):
                out = client.generate([i + 1, 9], max_tokens=4, mode="colocated", ignore_eos=True)
                assert out.token_ids == _expected([i + 1, 9], 4)
        served = [_standin(mesh, f"unified-{i}")["requests"] for i in range(2)]
        assert sum(served) == 4  # type: ignore[arg-type]
        _refuses_what_sglang_does_not_declare(mesh, "colocated")
    finally:
        assert mesh.stop() == 0


def test_up_refuses_native_without_sglang(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError) as info:
        start_up(tmp_path, tmp_path / "cache", "--mode", "native", timeout=60)
    assert "--engine sglang" in str(info.value)


@pytest.mark.parametrize(
    "flags",
    [["--gpus", "0,1"], ["--sglang-arg=--tp", "--sglang-arg", "2"], ["--gpu-assign", "visible-devices"]],
)
def test_up_refuses_sglang_flags_without_sglang(tmp_path: Path, flags: list[str]) -> None:
    """Ignored, they would start a mesh other than the one asked for (a CPU mesh for `--gpus 0,1`)."""
    with pytest.raises(RuntimeError) as info:
        start_up(tmp_path, tmp_path / "cache", *flags, timeout=60).stop()  # started: stopped, then failed
    assert f"{flags[0].split('=')[0]} is for SGLang replicas: add --engine sglang" in str(info.value)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--mode", "colocated", "--prefill", "2"], "--prefill 2 needs --decode >= 1"),
        (["--mode", "colocated", "--decode", "1"], "--decode 1 needs --prefill >= 1"),
        (["--mode", "pd", "--decode", "0"], "pd mode needs --prefill and --decode >= 1"),
        (["--mode", "colocated", "--unified", "0", "--prefill", "1", "--decode", "1"], "colocated needs"),
    ],
)
def test_up_refuses_replicas_that_cannot_serve(tmp_path: Path, flags: list[str], says: str) -> None:
    """A prefill without a decode (or the reverse), or a default mode with no replica of its kind, would
    start and never serve."""
    with pytest.raises(RuntimeError) as info:
        start_up(tmp_path, tmp_path / "cache", *flags, timeout=60).stop()  # started: stopped, then failed
    assert says in str(info.value)


def test_up_chooses_hicaches_l3_once(tmp_path: Path, tiny_model: Path) -> None:
    parser = argparse.ArgumentParser()
    add_up_args(parser)
    args = parser.parse_args(["--engine", "sglang", "--mode", "colocated", "--sglang-hicache-file"])
    path = replica_config(args, tmp_path, "unified-0", "unified", 0, "", None)
    section = SglangSection(**tomllib.loads(path.read_text())["sglang"])
    assert section.hicache and section.hicache_backend == "file"  # SGLang's own L3, no page store
    with pytest.raises(RuntimeError) as info:
        flags = ["--engine", "sglang", "--mode", "colocated", "--model", str(tiny_model)]
        start_up(
            tmp_path, tmp_path / "cache", *flags, "--sglang-hicache", "--sglang-hicache-file", timeout=60
        )
    assert "pick one" in str(info.value)
