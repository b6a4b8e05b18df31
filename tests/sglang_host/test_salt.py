"""A request's cache salt reaches the hosted SGLang in the field its release honours, or the request is
refused with CACHE_SALT_UNSUPPORTED naming the release (services around the SGLang stand-in, which
reports the release it is told to in `/server_info` and records the salt fields it was sent)."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from xavier.v1 import decode_service_pb2 as dpb
from xavier.v1 import decode_service_pb2_grpc, types_pb2
from xavier_services.sglang_host.salt import SaltField, lora_refusal, salt_support

from tests.sglang_host.conftest import Start, ready_info, standin_state
from xavier_core.runtime import from_rpc_error

pytestmark = pytest.mark.integration

HICACHE = {"XAVIER_SGLANG__HICACHE": "true", "XAVIER_PAGESTORE__ADDRESS": "127.0.0.1:9"}


@pytest.mark.parametrize(
    ("release", "storage", "field"),
    [
        ("0.5.23", False, SaltField.CACHE_SALT),
        ("0.5.23", True, SaltField.CACHE_SALT),
        ("0.5.24.post1", True, SaltField.CACHE_SALT),
        ("0.5.17", False, SaltField.EXTRA_KEY),
        ("0.5.17", True, None),
        ("0.5.20", True, None),
        ("0.5.14", False, None),
        ("", False, None),
        ("dev", True, None),
    ],
)
def test_the_salt_field_follows_the_release(release: str, storage: bool, field: SaltField | None) -> None:
    support = salt_support(release, storage=storage)
    assert support.field is field
    body: dict[str, object] = {}
    if field is None:
        from xavier_core.runtime.errors import FailedPrecondition

        with pytest.raises(FailedPrecondition) as err:
            support.apply(body, "tenant")
        assert err.value.reason == "CACHE_SALT_UNSUPPORTED"
        assert err.value.metadata["release"] == (release or "unknown") and err.value.metadata["why"]
    else:
        support.apply(body, "tenant")
        assert body == {field.value: "tenant"}
    support.apply(body := {}, "")  # no salt: nothing to isolate, nothing refused
    assert body == {}


def test_lora_with_hicache_storage_needs_a_release_that_keys_it() -> None:
    lora = ["--enable-lora", "--lora-paths=a=/l/a"]
    assert "0.5.23" in lora_refusal("0.5.17", storage=True, extra_args=lora)
    assert lora_refusal("0.5.23", storage=True, extra_args=lora) == ""
    assert lora_refusal("0.5.17", storage=False, extra_args=lora) == ""
    assert lora_refusal("0.5.17", storage=True, extra_args=["--mem-fraction-static", "0.5"]) == ""


def _generate(address: str, salt: str) -> list[int]:
    with grpc.insecure_channel(address) as ch:
        stub = decode_service_pb2_grpc.DecodeServiceStub(ch)
        req = dpb.GenerateUnifiedRequest(
            request_id=f"s-{salt}", token_ids=[3, 4], sampling=types_pb2.SamplingParams(max_tokens=2),
            cache_salt=salt,
        )  # fmt: skip
        return [t for m in stub.GenerateUnified(req, timeout=30) for t in m.delta.token_ids]


@pytest.mark.parametrize(
    ("release", "env", "sent"),
    [("0.5.23", HICACHE, {"cache_salt": "tenant-a"}), ("0.5.17", {}, {"extra_key": "tenant-a"})],
)
def test_a_salt_reaches_sglang_in_the_field_of_its_release(
    start_sglang_peer: Start, tmp_path: Path, release: str, env: dict[str, str], sent: dict[str, str]
) -> None:
    unified = start_sglang_peer("unified", env={"XAVIER_STANDIN_VERSION": release, **env})
    url = ready_info(unified, tmp_path)["sglang_url"]
    assert len(_generate(unified.address, "tenant-a")) == 2
    assert standin_state(url)["last_salt"] == sent
    assert len(_generate(unified.address, "")) == 2
    assert standin_state(url)["last_salt"] == {}


@pytest.mark.parametrize(("release", "env"), [("0.5.17", HICACHE), ("none", {})])
def test_a_salted_request_is_refused_where_the_release_cannot_isolate_it(
    start_sglang_peer: Start, tmp_path: Path, release: str, env: dict[str, str]
) -> None:
    unified = start_sglang_peer("unified", env={"XAVIER_STANDIN_VERSION": release, **env})
    url = ready_info(unified, tmp_path)["sglang_url"]
    with pytest.raises(grpc.RpcError) as info:
        _generate(unified.address, "tenant-a")
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    err = from_rpc_error(info.value)  # type: ignore[arg-type]
    assert err.reason == "CACHE_SALT_UNSUPPORTED"
    assert err.metadata["release"] == ("unknown" if release == "none" else release)
    assert standin_state(url)["requests"] == 0  # never sent to SGLang unisolated
    assert len(_generate(unified.address, "")) == 2  # unsalted traffic is served


def test_lora_with_hicache_on_an_old_release_exits_2_naming_the_key(start_sglang_peer: Start) -> None:
    env = {
        **HICACHE,
        "XAVIER_STANDIN_VERSION": "0.5.17",
        "XAVIER_SGLANG__EXTRA_ARGS": json.dumps(["--enable-lora"]),
    }
    with pytest.raises(RuntimeError) as info:
        start_sglang_peer("unified", env=env, timeout=30)
    assert "exited with 2" in str(info.value) and "config error: sglang.hicache" in str(info.value)
