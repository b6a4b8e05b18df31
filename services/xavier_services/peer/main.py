"""Command line and process bootstrap shared by the prefill and decode binaries."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from xavier.v1 import types_pb2

from xavier_core.runtime import ServerHandle, run_service, serve
from xavier_core.runtime.config import ConfigError, add_common_args, config_from_args, exit_on_config_error
from xavier_services.peer.config import PeerServiceConfig
from xavier_services.peer.host import PeerHost, load_engine


def peer_arg_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_common_args(parser)
    parser.add_argument("--model", default=None, metavar="DIR", help="local Hugging Face checkpoint")
    parser.add_argument("--engine", default=None, choices=["reference", "sglang"], help="engine kind")
    parser.add_argument("--directory", default=None, metavar="HOST:PORT", help="directory address")
    parser.add_argument("--peer-id", default=None, help="stable peer id (kept across restarts)")
    parser.add_argument("--device", default=None, help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--page-size", type=int, default=None)
    parser.add_argument("--num-pages", type=int, default=None)
    parser.add_argument("--pagestore", default=None, metavar="HOST:PORT", help="page store address")
    return parser


def peer_config(args: argparse.Namespace) -> PeerServiceConfig:
    overrides = {
        "engine.model": args.model,
        "engine.kind": args.engine,
        "engine.device": args.device,
        "engine.dtype": args.dtype,
        "engine.page_size": args.page_size,
        "engine.num_pages": args.num_pages,
        "peer.directory": args.directory,
        "peer.peer_id": args.peer_id,
        "pagestore.address": args.pagestore,
    }
    try:
        config = config_from_args(PeerServiceConfig, args, overrides)
    except ConfigError as err:
        exit_on_config_error(err)
    if config.engine.model is None:
        exit_on_config_error(ConfigError([("engine.model", "a model directory is required", "flag --model")]))
    return config


def run_peer(
    config: PeerServiceConfig,
    role: types_pb2.Role.ValueType,
    service_name: str,
    full_service_name: str,
    make_servicer: Callable[[PeerHost], Any],
    add_to_server: Callable[[Any, grpc.aio.Server], None],
) -> int:
    """Loads the reference engine, then serves until SIGTERM: register → serve → drain → unregister.

    A binary whose config says `engine.kind = "sglang"` calls `sglang_host.main.run_sglang_peer` instead.
    """

    async def main() -> int:
        engine = await asyncio.to_thread(load_engine, config)
        host = PeerHost(config, role, engine)
        servicer = make_servicer(host)

        def register(server: grpc.aio.Server) -> Sequence[str]:
            add_to_server(servicer, server)
            return [full_service_name]

        async def on_start(handle: ServerHandle) -> dict[str, Any]:
            return await host.start(handle.port)

        async def on_stop(handle: ServerHandle) -> None:
            await servicer.drain()
            await host.stop()

        return await serve(
            config, service_name=service_name, register=register, on_start=on_start, on_stop=on_stop
        )

    return run_service(main)
