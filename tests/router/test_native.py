"""Native mode against a protocol double of SGLang's P/D `/generate` bootstrap contract, and opt-in
against real SGLang servers (XAVIER_SGLANG_PREFILL_URL / XAVIER_SGLANG_DECODE_URL / XAVIER_SGLANG_MODEL)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
from xavier.v1 import types_pb2
from xavier_client import Client, UnavailableError
from xavier_services.router.config import NativeConfig
from xavier_services.router.native import native_flow
from xavier_services.router.request import Prepared

from tests.support.local_http import generate_server, stalled
from tests.support.procs import ServiceProc, start_service
from tests.support.sglang_double import SglangDouble
from xavier_core.engine.tiny import make_tiny
from xavier_core.runtime.errors import Unavailable

pytestmark = pytest.mark.integration


def _router(workdir: Path, model: Path, prefill: str, decode: str, name: str = "router") -> ServiceProc:
    env = {
        "XAVIER_NATIVE__PREFILL_URL": prefill,
        "XAVIER_NATIVE__DECODE_URL": decode,
        "XAVIER_NATIVE__BOOTSTRAP_HOST": "127.0.0.1",
        "XAVIER_NATIVE__BOOTSTRAP_PORT": "8998",
    }
    args = ["--model", str(model), "--mode", "native", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0"]
    return start_service("xavier-router", args, workdir, name=name, env=env, timeout=60)


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SglangDouble, ServiceProc]]:
    model = make_tiny(tmp_path_factory.mktemp("native-model"), "qwen2")
    with SglangDouble() as double:
        router = _router(tmp_path_factory.mktemp("native"), model, double.prefill_url, double.decode_url)
        try:
            yield double, router
        finally:
            router.stop()


def test_same_body_to_both_with_bootstrap(native: tuple[SglangDouble, ServiceProc]) -> None:
    double, router = native
    with Client(router.address) as client:
        res = client.generate("Hello there", max_tokens=5)
    assert res.mode == "native" and res.finish_reason == "length"
    assert res.completion_tokens == 5 and len(res.token_ids) == 5
    assert res.text == "".join(f"t{t} " for t in res.token_ids)
    pre, dec = double.state.prefill_bodies[-1], double.state.decode_bodies[-1]
    assert pre == dec
    assert 0 <= pre["bootstrap_room"] < 2**63
    assert (pre["bootstrap_host"], pre["bootstrap_port"]) == ("127.0.0.1", 8998)
    assert pre["sampling_params"]["max_new_tokens"] == 5 and pre["input_ids"]


def test_rooms_are_random_per_request(native: tuple[SglangDouble, ServiceProc]) -> None:
    double, router = native
    with Client(router.address) as client:
        for _ in range(3):
            client.generate("x y z", max_tokens=2)
    rooms = [b["bootstrap_room"] for b in double.state.decode_bodies[-3:]]
    assert len(set(rooms)) == 3


def test_streams_through_the_openai_front(native: tuple[SglangDouble, ServiceProc]) -> None:
    _, router = native
    http = json.loads((router.log_path.parent / "router.ready").read_text())["http"]
    oa = openai.OpenAI(base_url=f"http://{http}/v1", api_key="x", max_retries=0)
    chunks = list(oa.completions.create(model="", prompt="abc", max_tokens=4, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text.count("t") == 4 and chunks[-1].choices[0].finish_reason == "length"


def test_features_native_servers_do_not_declare_are_refused(native: tuple[SglangDouble, ServiceProc]) -> None:
    double, router = native
    http = json.loads((router.log_path.parent / "router.ready").read_text())["http"]
    sent = len(double.state.decode_bodies)
    for extra, param in (({"logprobs": 3}, "logprobs"), ({"echo": True, "logprobs": 1}, "echo")):
        oa = openai.OpenAI(base_url=f"http://{http}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as err:
            oa.completions.create(model="", prompt="Hello", max_tokens=2, extra_body=extra)  # type: ignore[call-overload]
        assert err.value.code == "UNSUPPORTED_PARAMETER" and err.value.param == param
    assert len(double.state.decode_bodies) == sent  # refused before either server was called


def test_client_cancel_reaches_the_decode_server(native: tuple[SglangDouble, ServiceProc]) -> None:
    double, router = native
    double.state.token_delay = 0.05
    before = double.state.disconnects
    try:
        with Client(router.address) as client:
            stream = client.generate_stream("cancel", max_tokens=200)
            for n, _ in enumerate(stream):
                if n == 2:
                    stream.cancel()
        deadline = time.monotonic() + 5
        while double.state.disconnects == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert double.state.disconnects == before + 1
    finally:
        double.state.token_delay = 0.0


def test_failed_prefill_ends_the_request_without_waiting_for_the_decode(
    native: tuple[SglangDouble, ServiceProc],
) -> None:
    double, router = native
    double.state.prefill_status = 503
    before, sent = double.state.waits_cancelled, len(double.state.decode_bodies)
    try:
        t0 = time.monotonic()
        with Client(router.address) as client, pytest.raises(UnavailableError) as info:
            client.generate("the prefill fails", max_tokens=4)
        # The decode double waits 5 s for a room that never fills; the router must not.
        assert time.monotonic() - t0 < 2.0
        assert info.value.reason == "NATIVE_UNAVAILABLE" and "503" in str(info.value)
        # Every decode request (the SDK retries UNAVAILABLE) was dropped too, none waited its 5 s out.
        tries = len(double.state.decode_bodies) - sent
        deadline = time.monotonic() + 5
        while double.state.waits_cancelled - before < tries and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tries >= 1 and double.state.waits_cancelled - before == tries
    finally:
        double.state.prefill_status = 200


def test_unreachable_native_servers_are_unavailable(
    tmp_path: Path, native: tuple[SglangDouble, ServiceProc]
) -> None:
    model = make_tiny(tmp_path / "m", "qwen2", layers=1)
    router = _router(tmp_path, model, "http://127.0.0.1:9", "http://127.0.0.1:9", name="router-dead")
    try:
        with Client(router.address) as client, pytest.raises(UnavailableError) as info:
            client.generate("hi", max_tokens=2)
        assert info.value.reason == "NATIVE_UNAVAILABLE"
    finally:
        router.stop()


@pytest.mark.skipif(
    not os.environ.get("XAVIER_SGLANG_DECODE_URL"), reason="real SGLang P/D servers not configured"
)
def test_against_real_sglang(tmp_path: Path) -> None:
    model = Path(os.environ["XAVIER_SGLANG_MODEL"])
    router = _router(
        tmp_path, model, os.environ["XAVIER_SGLANG_PREFILL_URL"], os.environ["XAVIER_SGLANG_DECODE_URL"]
    )
    try:
        with Client(router.address) as client:
            res = client.generate("The capital of France is", max_tokens=8)
        assert res.completion_tokens > 0 and res.finish_reason in ("stop", "length")
    finally:
        router.stop()


async def test_servers_that_do_not_answer_within_the_timeout_are_unavailable() -> None:
    """aiohttp ends a request past its total timeout with a bare TimeoutError: mapped, not INTERNAL."""
    cfg_prep = Prepared("r1", (1, 2), types_pb2.SamplingParams(max_tokens=2), 0, "")
    async with generate_server(stalled) as url, aiohttp.ClientSession() as session:
        with pytest.raises(Unavailable) as err:
            async for _ in native_flow(cfg_prep, NativeConfig(prefill_url=url, decode_url=url), session, 0.3):
                pass
    assert err.value.reason == "NATIVE_UNAVAILABLE" and "did not answer within" in err.value.message
