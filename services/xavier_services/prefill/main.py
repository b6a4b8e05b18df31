"""`xavier-prefill`: an engine in the prefill role."""

from __future__ import annotations

import sys

from xavier.v1 import prefill_service_pb2, prefill_service_pb2_grpc, types_pb2

from xavier_services.peer.main import peer_arg_parser, peer_config, run_peer
from xavier_services.prefill.servicer import PrefillServicer
from xavier_services.sglang_host.main import run_sglang_peer

SERVICE = prefill_service_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name


def main(argv: list[str] | None = None) -> int:
    parser = peer_arg_parser("xavier-prefill", "Xavier prefill service")
    config = peer_config(parser.parse_args(argv))
    if config.engine.kind == "sglang":
        return run_sglang_peer(config, types_pb2.ROLE_PREFILL, "prefill")
    return run_peer(
        config,
        types_pb2.ROLE_PREFILL,
        "prefill",
        SERVICE,
        PrefillServicer,
        prefill_service_pb2_grpc.add_PrefillServiceServicer_to_server,
    )


if __name__ == "__main__":
    sys.exit(main())
