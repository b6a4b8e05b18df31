"""`xavier-pagestore`: the process that will host the HiCache L3 page store.

The store's contract is not in xavier.v1 yet: it comes with the store itself, as an additive service whose
gRPC messages carry keys, descriptors and leases while NIXL moves the page bytes. Until then the binary
starts, serves health (overall status SERVING) and reflection and stops cleanly, so deployments and `xavier
up` can already place it, and it says at start that it serves no xavier.v1 service.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc

from xavier_core.runtime import ServiceConfig, get_logger, run_service, serve
from xavier_core.runtime.config import ConfigError, add_common_args, config_from_args, exit_on_config_error

_log = get_logger("xavier.pagestore")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="xavier-pagestore", description="Xavier page store")
    add_common_args(parser)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(ServiceConfig, args)
    except ConfigError as err:
        exit_on_config_error(err)

    def register(server: grpc.aio.Server) -> Sequence[str]:
        _log.warning(
            "page store not built yet: serving health and reflection only, no xavier.v1 service",
            services=[],
        )
        return []

    async def run() -> int:
        return await serve(config, service_name="pagestore", register=register)

    return run_service(run)


if __name__ == "__main__":
    sys.exit(main())
