"""The SGLang command line a hosting service builds, and every option it refuses (naming the key)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from pydantic import ValidationError
from xavier.v1 import types_pb2
from xavier_services.peer.config import PeerServiceConfig
from xavier_services.sglang_host.child import SglangChild
from xavier_services.sglang_host.client import SglangHttp, http_error
from xavier_services.sglang_host.config import OWNED_FLAGS, SglangSection
from xavier_services.sglang_host.launch import Launch, LaunchSpec, build_launch

from tests.support.local_http import Handler, generate_server, stalled
from tests.support.sglang_standin import parser as standin_parser
from xavier_core.runtime.config import ConfigError, load_config
from xavier_core.runtime.errors import InvalidArgument, Unavailable


def _spec(model_dir: Path, role: types_pb2.Role.ValueType, **kw: object) -> LaunchSpec:
    base: dict[str, object] = {"advertise": "10.0.0.7:7201", "directory": "10.0.0.5:7100", "port": 31000}
    return LaunchSpec(**{"role": role, "model": model_dir, **base, **kw})  # type: ignore[arg-type]


@pytest.fixture
def model(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def _flags(launch: Launch) -> dict[str, str]:
    argv = launch.argv[3:]  # after "python -m sglang.launch_server"
    out: dict[str, str] = {}
    for i, token in enumerate(argv):
        if token.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            out[token] = "" if nxt.startswith("--") else nxt
    return out


def test_prefill_with_the_xavier_backend(model: Path) -> None:
    launch = build_launch(SglangSection(), _spec(model, types_pb2.ROLE_PREFILL))
    assert launch.argv[:3] == ["python", "-m", "sglang.launch_server"]
    flags = _flags(launch)
    assert flags["--model-path"] == str(model)
    assert flags["--host"] == "127.0.0.1" and flags["--port"] == "31000"
    assert flags["--disaggregation-mode"] == "prefill"
    assert flags["--disaggregation-transfer-backend"] == "xavier"
    assert flags["--api-key"] == launch.api_key and len(launch.api_key) >= 24
    assert "--disaggregation-bootstrap-port" not in flags  # peers meet through the directory
    assert "--disable-radix-cache" not in flags
    assert launch.env["SGLANG_PLUGINS"] == "xavier"
    assert launch.env["XAVIER_DIRECTORY"] == "10.0.0.5:7100"
    assert launch.env["XAVIER_SGLANG_ADVERTISE"] == "10.0.0.7:7201"
    assert "XAVIER_SGLANG_PEER_ID" not in launch.env  # none configured: the directory assigns one
    named = build_launch(SglangSection(), _spec(model, types_pb2.ROLE_PREFILL, peer_id="gpu-a-prefill-0"))
    assert named.env["XAVIER_SGLANG_PEER_ID"] == "gpu-a-prefill-0"
    assert launch.url == "http://127.0.0.1:31000"
    # A fresh key per start: a replica's key is no other's.
    assert build_launch(SglangSection(), _spec(model, types_pb2.ROLE_PREFILL)).api_key != launch.api_key


def test_decode_turns_radix_cache_off_and_unified_is_plain(model: Path) -> None:
    decode = _flags(build_launch(SglangSection(), _spec(model, types_pb2.ROLE_DECODE)))
    assert decode["--disaggregation-mode"] == "decode" and "--disable-radix-cache" in decode
    unified = build_launch(SglangSection(), _spec(model, types_pb2.ROLE_UNIFIED))
    assert not any(a.startswith("--disaggregation") for a in unified.argv)
    assert "SGLANG_PLUGINS" not in unified.env


def test_native_nixl_prefill_has_a_bootstrap_port_and_no_plugin(model: Path) -> None:
    cfg = SglangSection(transfer_backend="nixl", bootstrap_port=9100, api_key="k" * 30)
    launch = build_launch(cfg, _spec(model, types_pb2.ROLE_PREFILL))
    flags = _flags(launch)
    assert flags["--disaggregation-transfer-backend"] == "nixl"
    assert flags["--disaggregation-bootstrap-port"] == "9100"
    assert flags["--api-key"] == "k" * 30
    assert "SGLANG_PLUGINS" not in launch.env and "XAVIER_DIRECTORY" not in launch.env


def test_gpu_and_hicache(model: Path) -> None:
    cfg = SglangSection(base_gpu_id=1, cuda_visible_devices="2,3", hicache=True)
    launch = build_launch(cfg, _spec(model, types_pb2.ROLE_PREFILL, pagestore="10.0.0.6:7300"))
    flags = _flags(launch)
    assert flags["--base-gpu-id"] == "1" and launch.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert flags["--hicache-storage-backend"] == "dynamic" and "--enable-hierarchical-cache" in flags
    extra = json.loads(flags["--hicache-storage-backend-extra-config"])
    assert extra["interface_v1"] == 1 and extra["pagestore"] == "10.0.0.6:7300"
    assert extra["module_path"] == "xavier_sglang.hicache" and extra["class_name"] == "XavierHiCacheStorage"


def test_hicache_on_sglangs_file_backend_needs_no_store(model: Path) -> None:
    cfg = SglangSection(hicache=True, hicache_backend="file")
    flags = _flags(build_launch(cfg, _spec(model, types_pb2.ROLE_UNIFIED)))
    assert flags["--hicache-storage-backend"] == "file" and "--enable-hierarchical-cache" in flags
    assert "--hicache-storage-backend-extra-config" not in flags
    with pytest.raises(ValidationError, match="hicache_backend"):
        SglangSection(hicache=True, hicache_backend="mooncake")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("cfg", "kw", "key"),
    [
        (SglangSection(hicache=True), {"role": types_pb2.ROLE_DECODE, "pagestore": "h:1"}, "sglang.hicache"),
        (SglangSection(hicache=True), {"role": types_pb2.ROLE_PREFILL}, "pagestore.address"),
        (SglangSection(), {"role": types_pb2.ROLE_PREFILL, "directory": ""}, "peer.directory"),
        (SglangSection(), {"role": types_pb2.ROLE_DECODE, "port": 0}, "sglang.port"),
        (SglangSection(), {"role": types_pb2.ROLE_UNIFIED, "model": Path("/nonexistent")}, "engine.model"),
        (SglangSection(), {"role": types_pb2.ROLE_UNIFIED, "model": None}, "engine.model"),
        (SglangSection(), {"role": types_pb2.ROLE_DECODE, "peer_id": "a b"}, "peer.peer_id"),
        (SglangSection(), {"role": types_pb2.ROLE_PREFILL, "peer_id": "x" * 129}, "peer.peer_id"),
    ],
)
def test_refused_setups_name_the_key(
    model: Path, cfg: SglangSection, kw: dict[str, object], key: str
) -> None:
    rest = {k: v for k, v in kw.items() if k != "role"}
    spec = _spec(model, kw["role"], **rest)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument) as info:
        build_launch(cfg, spec)
    assert info.value.metadata["key"] == key


def _config_error(section: dict[str, object]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(PeerServiceConfig, None, {}, {"sglang": section})
    ((key, message, _source),) = info.value.issues
    return f"{key}: {message}"


@pytest.mark.parametrize("flag", sorted(OWNED_FLAGS))
def test_every_owned_flag_is_refused_in_extra_args(flag: str) -> None:
    error = _config_error({"extra_args": [flag, "1"]})
    assert error.startswith("sglang.extra_args") and flag in error


@pytest.mark.parametrize(
    "args",
    [
        ["--disaggregation-m", "prefill"],  # SGLang's argparse would expand the prefix
        ["--api-k=secret"],
        ["--port=30000"],
        ["-x"],
        ["value-first"],
        ["--"],
    ],
)
def test_abbreviations_and_malformed_extra_args_are_refused(args: list[str]) -> None:
    assert _config_error({"extra_args": args}).startswith("sglang.extra_args")


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"env": {"SGLANG_PLUGINS": "other"}}, "sglang.env"),
        ({"env": {"XAVIER_DIRECTORY": "x:1"}}, "sglang.env"),
        ({"command": []}, "sglang.command"),
        ({"cuda_visible_devices": "gpu0"}, "sglang.cuda_visible_devices"),
        ({"transfer_backend": "mooncake"}, "sglang.transfer_backend"),
        ({"port": 70000}, "sglang.port"),
        ({"api_key": "-starts-like-a-flag"}, "sglang.api_key"),
        ({"unknown": 1}, "sglang.unknown"),
    ],
)
def test_other_refused_settings_name_the_key(section: dict[str, object], key: str) -> None:
    assert _config_error(section).startswith(key)


def test_passed_through_args_are_kept_and_parse_as_sglang_would(model: Path) -> None:
    cfg = load_config(
        PeerServiceConfig,
        None,
        {},
        {"sglang": {"extra_args": ["--mem-fraction-static", "0.5", "--attention-backend=triton"]}},
    ).sglang
    launch = build_launch(cfg, _spec(model, types_pb2.ROLE_DECODE))
    assert launch.argv[-3:] == ["--mem-fraction-static", "0.5", "--attention-backend=triton"]
    # The stand-in's parser mirrors SGLang's for these flags (the real parser: tests/sglang).
    import os

    os.environ["SGLANG_PLUGINS"] = "xavier"
    try:
        args = standin_parser().parse_args(launch.argv[3:])
    finally:
        del os.environ["SGLANG_PLUGINS"]
    assert args.disaggregation_mode == "decode" and args.disable_radix_cache
    assert args.mem_fraction_static == 0.5


@pytest.mark.parametrize(
    ("status", "code", "reason"),
    [
        (400, "INVALID_ARGUMENT", "INVALID_REQUEST"),
        (401, "INTERNAL", "ENGINE_ERROR"),
        (429, "RESOURCE_EXHAUSTED", "ENGINE_QUEUE_FULL"),
        (503, "UNAVAILABLE", "PEER_UNAVAILABLE"),
        (500, "INTERNAL", "ENGINE_ERROR"),
    ],
)
def test_sglang_http_errors_map_to_statuses(status: int, code: str, reason: str) -> None:
    err = http_error(status, '{"error": {"message": "x"}}')
    assert err.code.name == code and err.reason == reason


async def test_child_output_is_copied_past_a_line_over_the_stream_limit() -> None:
    """A line longer than the pipe reader's limit must not stop the copy: an undrained pipe would block
    SGLang on its next write."""
    script = "import sys; sys.stdout.write('x' * 300_000 + '\\n'); print('after the long line', flush=True)"
    child = SglangChild(Launch([sys.executable, "-c", script], {}, "http://127.0.0.1:9", "key"))
    await child.start()
    assert await asyncio.wait_for(child.wait_exit(), 15) == 0  # else it blocks writing
    assert child.tail[-1] == "after the long line"


@contextlib.asynccontextmanager
async def _sglang_http(generate: Handler, timeout: float) -> AsyncIterator[SglangHttp]:
    """An `SglangHttp` over a local HTTP server whose /generate is `generate`."""
    async with generate_server(generate) as url:
        http = SglangHttp(url, "key", timeout)
        try:
            yield http
        finally:
            await http.close()


async def test_a_cumulative_event_longer_than_aiohttps_line_limit_is_read() -> None:
    """Events are cumulative: a long output's last event outgrows aiohttp's line reader (512 KiB)."""
    ids = list(range(200_000))  # ~1.3 MB of output_ids, one event

    async def generate(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        event = {"text": "ab", "output_ids": ids, "meta_info": {"finish_reason": {"type": "length"}}}
        await resp.write(f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode())
        return resp

    async with _sglang_http(generate, 30) as http:
        deltas = [d async for d in http.stream({"input_ids": [1]})]
    assert (
        len(deltas) == 1 and deltas[0].token_ids == ids and deltas[0].finish == types_pb2.FINISH_REASON_LENGTH
    )


async def test_a_request_past_the_request_timeout_is_unavailable() -> None:
    async with _sglang_http(stalled, 0.3) as http:
        for call in (http.generate({"input_ids": [1]}), _drain(http.stream({"input_ids": [1]}))):
            with pytest.raises(Unavailable) as err:
                await call
            assert err.value.reason == "PEER_UNAVAILABLE" and "request_timeout_seconds" in err.value.message


async def _drain(stream: AsyncIterator[object]) -> None:
    async for _ in stream:
        pass
