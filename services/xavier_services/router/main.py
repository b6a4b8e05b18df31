"""`xavier-router`: the public gRPC RouterService and the OpenAI-compatible HTTP front, one process.

    xavier-router --model DIR --directory HOST:PORT [--http HOST:PORT] [--mode auto|pd|colocated|native]
                  [--listen HOST:PORT] [--workers N] [--ready-file F] [--config F]

The ready file adds "http" (the HTTP front's address) to the runtime's {"address", "metrics", "pid"}, and
with several workers "workers" (each one's index, pid and metrics address; `router/workers.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from typing import Any

import grpc
from aiohttp import web
from xavier.v1 import router_service_pb2_grpc as rpb_grpc

from xavier_core.runtime import (
    ConfigError,
    ServerHandle,
    add_common_args,
    config_from_args,
    exit_on_config_error,
    parse_host_port,
    run_service,
    serve,
)
from xavier_core.runtime.channels import use_client_tls
from xavier_core.runtime.metrics import get_registry
from xavier_core.text.errors import ModelFilesError
from xavier_core.text.tokenizer import TextTokenizer
from xavier_services.router.config import RouterConfig
from xavier_services.router.core import Router
from xavier_services.router.http_errors import json_error_protocols
from xavier_services.router.http_guard import ConnectionGuard
from xavier_services.router.openai_http import OpenAiFront
from xavier_services.router.prompts import ModelInfo, PromptCache, PromptEncoder, load_model_info
from xavier_services.router.servicer import RouterServicer, TokenInterceptor
from xavier_services.router.workers import (
    Siblings,
    Workers,
    check_ports_free,
    join_lead,
    merged_registry,
    router_answer,
    share,
)

SERVICE = "xavier.v1.RouterService"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xavier-router", description=__doc__.split("\n\n")[0])
    add_common_args(p)
    p.add_argument(
        "--model", default=None, metavar="DIR", help="checkpoint with the tokenizer and chat template"
    )
    p.add_argument("--model-name", default=None, help="served model id (default: the directory name)")
    p.add_argument("--directory", default=None, metavar="HOST:PORT", help="directory service address")
    p.add_argument("--http", default=None, metavar="HOST:PORT", help='OpenAI HTTP address ("" disables)')
    p.add_argument("--mode", default=None, choices=["auto", "pd", "colocated", "native"])
    p.add_argument(
        "--workers", type=int, default=None, metavar="N", help="router processes on these addresses"
    )
    # A worker started by the lead of a router of several processes (`router/workers.py`).
    p.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-link", type=int, default=None, help=argparse.SUPPRESS)
    return p


def load(argv: Sequence[str] | None = None) -> tuple[RouterConfig, argparse.Namespace]:
    args = _parser().parse_args(argv)
    overrides = {
        "model": args.model,
        "model_name": args.model_name,
        "directory": args.directory,
        "http_listen": args.http,
        "default_mode": args.mode,
        "workers": args.workers,
    }
    try:
        config = config_from_args(RouterConfig, args, overrides)
    except ConfigError as err:
        exit_on_config_error(err)
    if config.model is None:
        exit_on_config_error(ConfigError([("model", "a model directory is required", "flag --model")]))
    return config, args


def load_model(config: RouterConfig) -> tuple[PromptEncoder, ModelInfo]:
    """Loads the tokenizer and the model facts (raises ModelFilesError)."""
    if config.model is None:
        raise ModelFilesError("no model directory configured")
    info = load_model_info(config.model, config.model_name, config.max_context)
    tokenizer = TextTokenizer.load(config.model)
    return PromptEncoder(tokenizer, PromptCache(config.prompt_cache_size, info.tokenizer_fingerprint)), info


async def run(config: RouterConfig, argv: Sequence[str] = (), worker_link: int | None = None) -> int:
    """Serves one router process: alone, as the lead of `config.workers` (starting the others with
    `argv`, its own command line), or as a worker holding `worker_link`, its link to the lead."""
    # The router dials the directory before serve() would set this: its [tls] serves both directions.
    use_client_tls(config.tls)
    lead = config.workers > 1 and worker_link is None
    if lead:
        try:
            check_ports_free(config)
        except ConfigError as err:
            exit_on_config_error(err)
    try:
        encoder, info = await asyncio.to_thread(load_model, config)
    except ModelFilesError as exc:
        exit_on_config_error(ConfigError([("model", str(exc), "flag --model")]))
    router = Router(share(config), encoder, info)
    siblings = Siblings(config.rpc_timeout_seconds) if config.workers > 1 else None
    workers = Workers(config, argv, siblings) if lead and siblings is not None else None
    runner: web.AppRunner | None = None
    http_server: asyncio.Server | None = None

    def register(server: grpc.aio.Server) -> Sequence[str]:
        rpb_grpc.add_RouterServiceServicer_to_server(RouterServicer(router, siblings), server)
        return [SERVICE]

    async def on_start(handle: ServerHandle) -> dict[str, Any]:
        router.start()
        if siblings is not None:
            siblings.local = router_answer(router)
        if worker_link is not None and siblings is not None:
            join_lead(worker_link, siblings, handle.request_stop)
        ready: dict[str, Any] = {}
        http_bound = ""
        if config.http_listen:
            ready["http"], http_bound = await start_http(router, config)
        if workers is not None:
            grpc_bound = f"{parse_host_port(config.listen)[0]}:{handle.port}"
            ready["workers"] = await workers.start(grpc_bound, http_bound)
            if handle.metrics is not None:  # one scrape of the lead sees every process
                handle.metrics.serve(merged_registry(get_registry(), workers.metrics))
        return ready

    async def start_http(router: Router, config: RouterConfig) -> tuple[str, str]:
        """Serves the OpenAI API; returns its address to show and the socket address as bound (the host
        as given, for the workers to bind the same one)."""
        nonlocal runner, http_server
        host, port = parse_host_port(config.http_listen)
        runner = web.AppRunner(OpenAiFront(router).app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        assert runner.server is not None
        guard = ConnectionGuard(
            json_error_protocols(runner.server),
            router.config.http_max_connections,
            config.http_header_timeout_seconds,
        )
        http_server = await asyncio.get_running_loop().create_server(
            guard, host.strip("[]") or None, port, reuse_address=True, reuse_port=config.workers > 1
        )
        bound = http_server.sockets[0].getsockname()[1]
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
        return f"{shown}:{bound}", f"{host}:{bound}"

    async def on_stop(handle: ServerHandle) -> None:
        # The workers drain while this process does: each has the same grace.
        stopping = asyncio.ensure_future(workers.stop(config.grace_seconds)) if workers else None
        if http_server is not None:
            http_server.close()
        if runner is not None:
            await runner.cleanup()
        await router.close()
        if stopping is not None:
            await stopping

    interceptors = [TokenInterceptor(config.bearer_token)] if config.bearer_token else []
    return await serve(
        config,
        service_name="router",
        register=register,
        on_start=on_start,
        on_stop=on_stop,
        interceptors=interceptors,
        reuse_port=config.workers > 1,
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    config, args = load(argv)
    return run_service(lambda: run(config, argv, args.worker_link))


if __name__ == "__main__":
    raise SystemExit(main())
