"""`xavier-pagestore`: the HiCache L3 page store.

The store's data path is part 6 of the plan; until it lands every RPC answers UNIMPLEMENTED with reason
NOT_IMPLEMENTED (never a fake success), while the process serves health, reflection and metrics.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import grpc
from xavier.v1 import page_store_service_pb2, page_store_service_pb2_grpc

from xavier_core.runtime import ServiceConfig, run_service, serve
from xavier_core.runtime.config import ConfigError, add_common_args, config_from_args, exit_on_config_error
from xavier_core.runtime.errors import Unimplemented

SERVICE = page_store_service_pb2.DESCRIPTOR.services_by_name["PageStoreService"].full_name


class PageStoreServicer(page_store_service_pb2_grpc.PageStoreServiceServicer):
    async def _unimplemented(self, request: Any, context: Any) -> Any:
        raise Unimplemented("the page store data path is not built yet", service=SERVICE)

    ExistsPages = GetPages = PutPages = GetPageStoreStats = _unimplemented


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="xavier-pagestore", description="Xavier page store")
    add_common_args(parser)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(ServiceConfig, args)
    except ConfigError as err:
        exit_on_config_error(err)

    def register(server: grpc.aio.Server) -> Sequence[str]:
        page_store_service_pb2_grpc.add_PageStoreServiceServicer_to_server(PageStoreServicer(), server)
        return [SERVICE]

    async def run() -> int:
        return await serve(config, service_name="pagestore", register=register)

    return run_service(run)


if __name__ == "__main__":
    sys.exit(main())
