"""Serving a prefill, decode or unified peer whose engine is an SGLang server (`engine.kind = "sglang"`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
from xavier.v1 import (
    decode_service_pb2,
    decode_service_pb2_grpc,
    prefill_service_pb2,
    prefill_service_pb2_grpc,
    types_pb2,
)

from xavier_core.runtime import ServerHandle, run_service, serve
from xavier_services.peer.config import PeerServiceConfig
from xavier_services.sglang_host.host import SglangHost
from xavier_services.sglang_host.servicer import SglangDecodeServicer, SglangPrefillServicer

_PREFILL = prefill_service_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name
_DECODE = decode_service_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name


def run_sglang_peer(config: PeerServiceConfig, role: types_pb2.Role.ValueType, service_name: str) -> int:
    """Starts SGLang, serves until SIGTERM (then stops SGLang) or until SGLang dies (exit code 1)."""

    async def main() -> int:
        host = SglangHost(config, role)

        def register(server: grpc.aio.Server) -> Sequence[str]:
            if role == types_pb2.ROLE_PREFILL:
                prefill_service_pb2_grpc.add_PrefillServiceServicer_to_server(
                    SglangPrefillServicer(host), server
                )
                return [_PREFILL]
            decode_service_pb2_grpc.add_DecodeServiceServicer_to_server(SglangDecodeServicer(host), server)
            return [_DECODE]

        async def on_start(handle: ServerHandle) -> dict[str, Any]:
            return await host.start(handle)

        async def on_stop(handle: ServerHandle) -> None:
            await host.stop()

        code = await serve(
            config, service_name=service_name, register=register, on_start=on_start, on_stop=on_stop
        )
        return 1 if host.failed else code

    return run_service(main)
