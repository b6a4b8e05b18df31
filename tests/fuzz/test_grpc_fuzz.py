"""Hypothesis-generated RouterService requests (random field values, and raw bytes with invalid UTF-8):
never UNKNOWN or INTERNAL, no crash, nothing leaked."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st
from xavier.v1 import router_service_pb2 as rpb

from tests.cli.mesh import Mesh
from tests.fuzz.conftest import OUTCOMES, TRIED, assert_nothing_leaked
from tests.fuzz.strategies import fuzz, generate_requests, raw_generate_requests, string_field

pytestmark = pytest.mark.integration
_SERVICE = "/xavier.v1.RouterService/"
_BAD = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED}


@pytest.fixture(scope="module")
def channel(mesh: Mesh) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(mesh.grpc) as ch:
        yield ch


def _generate(channel: grpc.Channel, payload: bytes) -> grpc.StatusCode:
    call = channel.unary_stream(_SERVICE + "Generate", response_deserializer=rpb.GenerateResponse.FromString)
    try:
        for _ in call(payload, timeout=60):
            pass
    except grpc.RpcError as err:
        code: grpc.StatusCode = err.code()  # type: ignore[attr-defined]
        assert code not in _BAD, (code, err.details())  # type: ignore[attr-defined]
        OUTCOMES[f"grpc {code.name}"] += 1
        return code
    OUTCOMES["grpc OK"] += 1
    return grpc.StatusCode.OK


def _unary(channel: grpc.Channel, method: str, payload: bytes) -> grpc.StatusCode:
    call = channel.unary_unary(_SERVICE + method)
    try:
        call(payload, timeout=30)
    except grpc.RpcError as err:
        code: grpc.StatusCode = err.code()  # type: ignore[attr-defined]
        assert code not in _BAD, (method, code, err.details())  # type: ignore[attr-defined]
        OUTCOMES[f"grpc {code.name}"] += 1
        return code
    OUTCOMES["grpc OK"] += 1
    return grpc.StatusCode.OK


@fuzz(180)
@given(req=generate_requests())
def test_generate_with_random_fields(channel: grpc.Channel, req: rpb.GenerateRequest) -> None:
    TRIED["grpc Generate fields"] += 1
    _generate(channel, req.SerializeToString())


@fuzz(100)
@given(raw=raw_generate_requests())
def test_generate_with_raw_bytes(channel: grpc.Channel, raw: bytes) -> None:
    TRIED["grpc Generate raw bytes"] += 1
    _generate(channel, raw)


@fuzz(100)
@given(
    method=st.sampled_from(["Abort", "ListModels", "GetClusterStatus"]),
    raw=st.one_of(
        st.binary(max_size=64),
        st.text(max_size=200).map(lambda t: string_field(1, t.encode())),
        st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80"]).map(lambda b: string_field(1, b)),
    ),
)
def test_other_rpcs_with_raw_bytes(channel: grpc.Channel, method: str, raw: bytes) -> None:
    TRIED["grpc other RPCs"] += 1
    _unary(channel, method, raw)


def test_invalid_utf8_and_unknown_mode_are_invalid_argument(channel: grpc.Channel) -> None:
    TRIED["grpc targeted"] += 2
    good = rpb.GenerateRequest(text="Hello")
    good.sampling.max_tokens = 2
    bad_utf8 = good.SerializeToString() + string_field(2, b"\xff\xfe")
    assert _generate(channel, bad_utf8) == grpc.StatusCode.INVALID_ARGUMENT
    good.mode = 99  # type: ignore[assignment]
    assert _generate(channel, good.SerializeToString()) == grpc.StatusCode.INVALID_ARGUMENT


def test_native_mode_on_a_router_without_it_is_a_failed_precondition(channel: grpc.Channel) -> None:
    TRIED["grpc targeted"] += 1
    req = rpb.GenerateRequest(text="Hello", mode=rpb.ROUTING_MODE_NATIVE)
    req.sampling.max_tokens = 1
    assert _generate(channel, req.SerializeToString()) == grpc.StatusCode.FAILED_PRECONDITION


def test_nothing_leaked_after_grpc_fuzz(mesh: Mesh) -> None:
    assert_nothing_leaked(mesh)
