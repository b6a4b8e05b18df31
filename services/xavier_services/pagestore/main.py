"""``xavier-pagestore``: the HiCache L3 page store (DRAM arena over NIXL, leases over gRPC)."""

from __future__ import annotations

import argparse
import sys

from xavier_core.runtime import run_service, serve
from xavier_core.runtime.config import ConfigError, add_common_args, config_from_args, exit_on_config_error
from xavier_services.pagestore.config import PageStoreConfig
from xavier_services.pagestore.servicer import PageStoreServicer


def main(argv: list[str] | None = None) -> int:
    """Parses flags, loads config (``[pagestore]``) and serves until SIGTERM."""
    parser = argparse.ArgumentParser(prog="xavier-pagestore", description="Xavier page store")
    add_common_args(parser)
    parser.add_argument("--arena-bytes", type=int, default=None, help="DRAM arena size in bytes")
    args = parser.parse_args(argv)
    try:
        config = config_from_args(PageStoreConfig, args, {"pagestore.arena_bytes": args.arena_bytes})
    except ConfigError as err:
        exit_on_config_error(err)

    async def run() -> int:
        servicer = PageStoreServicer(config.pagestore)
        return await serve(
            config,
            service_name="pagestore",
            register=servicer.register,
            on_start=servicer.start,
            on_stop=servicer.stop,
        )

    return run_service(run)


if __name__ == "__main__":
    sys.exit(main())
