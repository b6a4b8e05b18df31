"""``xavier-directory``: peers, epochs, leases and P/D rooms.

In memory by default (soft state: peers re-register on restart, open rooms are lost); with
``[directory] backend = "etcd"`` the state lives in etcd and several directories serve one mesh.
"""

from __future__ import annotations

import argparse
import sys

from xavier_core.runtime import run_service, serve
from xavier_core.runtime.config import ConfigError, add_common_args, config_from_args, exit_on_config_error
from xavier_services.directory.config import DirectoryConfig
from xavier_services.directory.servicer import DirectoryServicer


def main(argv: list[str] | None = None) -> int:
    """Parses flags (``--config --listen --ready-file ...``), loads config and serves until SIGTERM."""
    parser = argparse.ArgumentParser(prog="xavier-directory", description="Xavier directory service")
    add_common_args(parser)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(DirectoryConfig, args)
    except ConfigError as err:
        exit_on_config_error(err)

    async def run() -> int:
        servicer = DirectoryServicer(config.directory)
        if config.directory.backend == "etcd":
            # Imported only here: the etcd client is needed only by directories that use it.
            from xavier_services.directory.etcd_servicer import EtcdDirectoryServicer

            servicer = EtcdDirectoryServicer(config.directory)
        return await serve(
            config,
            service_name="directory",
            register=servicer.register,
            on_start=servicer.start,
            on_stop=servicer.stop,
        )

    return run_service(run)


if __name__ == "__main__":
    sys.exit(main())
