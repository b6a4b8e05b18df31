"""`xavier-decode`: an engine in the decode role, or `--role unified` for an ordinary replica."""

from __future__ import annotations

import sys

from xavier.v1 import decode_service_pb2, decode_service_pb2_grpc, types_pb2

from xavier_services.decode.servicer import DecodeServicer
from xavier_services.peer.main import peer_arg_parser, peer_config, run_peer
from xavier_services.sglang_host.main import run_sglang_peer

SERVICE = decode_service_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name
ROLES = {"decode": types_pb2.ROLE_DECODE, "unified": types_pb2.ROLE_UNIFIED}


def main(argv: list[str] | None = None) -> int:
    parser = peer_arg_parser("xavier-decode", "Xavier decode (or unified) service")
    parser.add_argument("--role", choices=sorted(ROLES), default="decode")
    args = parser.parse_args(argv)
    config = peer_config(args)
    if config.engine.kind == "sglang":
        return run_sglang_peer(config, ROLES[args.role], args.role)
    return run_peer(
        config,
        ROLES[args.role],
        args.role,
        SERVICE,
        DecodeServicer,
        decode_service_pb2_grpc.add_DecodeServiceServicer_to_server,
    )


if __name__ == "__main__":
    sys.exit(main())
