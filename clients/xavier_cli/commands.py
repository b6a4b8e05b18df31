"""`xavier generate` and `xavier status`: thin wrappers over the client SDK."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from xavier.v1 import page_store_service_pb2 as spb
from xavier.v1 import page_store_service_pb2_grpc as spb_grpc
from xavier.v1 import router_service_pb2 as rpb
from xavier.v1 import types_pb2
from xavier_client import Client, Prompt, TlsOptions, XavierError, mode_name
from xavier_client._options import channel_credentials

from xavier_cli.up import DEFAULT_GRPC, state_file


def add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=os.environ.get("XAVIER_ADDRESS", DEFAULT_GRPC), help="router gRPC")
    p.add_argument("--token", default=os.environ.get("XAVIER_TOKEN"), help="bearer token")
    p.add_argument("--timeout", type=float, default=120.0, help="deadline in seconds")
    p.add_argument(
        "--ca",
        type=Path,
        default=None,
        help="CA bundle of a TLS mesh (none: the certificates of the xavier up at --address)",
    )
    p.add_argument("--cert", type=Path, default=None, help="client certificate for a TLS mesh")
    p.add_argument("--key", type=Path, default=None, help="private key of --cert")
    p.add_argument("--insecure", action="store_true", help="plaintext, even where xavier up runs TLS")


def tls_options(args: argparse.Namespace) -> TlsOptions | None:
    """mTLS for the mesh at --address: --ca/--cert/--key, else the client certificate that the `xavier
    up` serving that address recorded in its state file; None (plaintext) for an insecure mesh."""
    if args.insecure:
        return None
    if args.ca or args.cert or args.key:
        if not (args.ca and args.cert and args.key):
            raise SystemExit("error: --ca, --cert and --key go together")
        return TlsOptions(root_certificates=args.ca, certificate_chain=args.cert, private_key=args.key)
    try:
        tls = json.loads(state_file(args.address).read_text()).get("client_tls")
    except (OSError, ValueError):
        return None
    if not tls:
        return None
    return TlsOptions(
        root_certificates=Path(tls["ca_file"]),
        certificate_chain=Path(tls["cert_file"]),
        private_key=Path(tls["key_file"]),
    )


def _client(args: argparse.Namespace) -> Client:
    return Client(args.address, token=args.token, timeout=args.timeout, tls=tls_options(args))


def _say_error(err: XavierError, address: str) -> None:
    print(f"error: {err}", file=sys.stderr)
    if err.code == grpc.StatusCode.UNAVAILABLE:
        print(
            f"hint: nothing answers at {address}: is `xavier up` running (or pass --address)?",
            file=sys.stderr,
        )
    elif "Socket closed" in str(err) or "handshake" in str(err).lower():
        print(
            "hint: a TLS mesh needs --ca/--cert/--key (xavier up's are found by --address)", file=sys.stderr
        )


def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text (with --chat: one user message)")
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    p.add_argument(
        "--mode",
        choices=["pd", "colocated", "native"],
        default=None,
        help="routing mode (none: the router's)",
    )
    p.add_argument("--chat", action="store_true", help="send the prompt as one user chat turn")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (none: a random one)")
    p.add_argument("--verbose", "-v", action="store_true", help="print usage and timings")
    add_client_args(p)


def run_generate(args: argparse.Namespace) -> int:
    prompt: Prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    kw = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "seed": args.seed,
        "mode": args.mode,
    }
    try:
        with _client(args) as client:
            if args.stream:
                finish = None
                for chunk in client.generate_stream(prompt, **kw):
                    print(chunk.text, end="", flush=True)
                    finish = chunk.finish_reason or finish
                    if chunk.raw is not None and chunk.raw.HasField("usage") and args.verbose:
                        u, t = chunk.raw.usage, chunk.raw.timings
                        print(
                            f"\n[{mode_name(chunk.raw.mode)}] {u.prompt_tokens}+{u.completion_tokens} tok, "
                            f"ttft {t.time_to_first_token.ToTimedelta().total_seconds() * 1e3:.1f} ms",
                            file=sys.stderr,
                        )
                print()
            else:
                res = client.generate(prompt, **kw)
                print(res.text)
                if args.verbose:
                    print(
                        f"[{res.mode}] finish={res.finish_reason} tokens={res.prompt_tokens}+"
                        f"{res.completion_tokens} ttft={res.time_to_first_token * 1e3:.1f}ms "
                        f"total={res.total_time * 1e3:.1f}ms",
                        file=sys.stderr,
                    )
    except XavierError as err:
        _say_error(err, args.address)
        for key, value in sorted(err.metadata.items()):
            print(f"  {key}: {value}", file=sys.stderr)
        return 1
    return 0


def format_status(st: rpb.GetClusterStatusResponse) -> str:
    """A human table of the cluster status."""
    lines = [
        f"router: {st.requests_active} request(s) active, default mode "
        f"{mode_name(st.default_mode) or 'none (no peers)'}",
        f"{'PEER':<14}{'ROLE':<10}{'ADDRESS':<22}{'RUN':>5}{'WAIT':>6}{'FREE/TOTAL':>12}{'PINNED':>8}{'ROOMS':>7}",
    ]
    for p in st.peers:
        role = types_pb2.Role.Name(p.role).removeprefix("ROLE_").lower()
        e = p.engine
        if p.error:
            lines.append(f"{p.peer_id:<14}{role:<10}{p.address:<22}  error: {p.error}")
            continue
        lines.append(
            f"{p.peer_id:<14}{role:<10}{p.address:<22}{e.running:>5}{e.waiting:>6}"
            f"{f'{e.pages_free}/{e.pages_total}':>12}{e.pages_pinned:>8}{p.rooms_active:>7}"
        )
    r = st.rooms
    lines.append(
        f"rooms: {r.active} active, {r.opened} opened, {r.completed} completed, "
        f"{r.aborted} aborted, {r.expired} expired"
        if st.HasField("rooms")
        else "rooms: unknown (directory unreachable)"
    )
    return "\n".join(lines)


def add_status_args(p: argparse.ArgumentParser) -> None:
    add_client_args(p)
    p.add_argument(
        "--pagestore",
        default=os.environ.get("XAVIER_PAGESTORE", ""),
        metavar="HOST:PORT",
        help="also show this page store's stats (empty: the store of the `xavier up` serving --address)",
    )
    p.add_argument("--json", action="store_true", help="print peers and store stats as JSON")


def store_stats(address: str, timeout: float, tls: TlsOptions | None = None) -> spb.GetPageStoreStatsResponse:
    """The page store's stats; raises grpc.RpcError when it cannot answer."""
    creds = channel_credentials(tls, None)
    with grpc.secure_channel(address, creds) if creds is not None else grpc.insecure_channel(address) as ch:
        resp: spb.GetPageStoreStatsResponse = spb_grpc.PageStoreServiceStub(ch).GetPageStoreStats(
            spb.GetPageStoreStatsRequest(), timeout=timeout
        )
        return resp


def format_store(address: str, st: spb.GetPageStoreStatsResponse) -> str:
    """Human lines of the page store's stats: totals, then one line per namespace."""
    mib = 1 << 20
    lines = [
        f"pagestore {address}: {st.pages} page(s), {st.allocated_bytes / mib:.1f}/"
        f"{st.capacity_bytes / mib:.1f} MiB allocated, {st.leases} lease(s)",
    ]
    for n in st.namespaces:
        lines.append(
            f"  {n.contract_fingerprint[:12]} salt {n.salt_digest or '-':<16} pages {n.pages:>7} "
            f"hits {n.hits:>8} misses {n.misses:>8} evictions {n.evictions:>6} "
            f"checksum failures {n.checksum_failures}"
        )
    return "\n".join(lines)


def _up_store(address: str) -> str:
    """The page store of the `xavier up` on this machine whose router is `address`, if any."""
    try:
        return str(json.loads(state_file(address).read_text()).get("pagestore", ""))
    except (OSError, ValueError):
        return ""


def run_status(args: argparse.Namespace) -> int:
    try:
        with _client(args) as client:
            st = client.cluster_status()
    except XavierError as err:
        _say_error(err, args.address)
        return 1
    store: spb.GetPageStoreStatsResponse | None = None
    store_error = ""
    if not args.pagestore:
        args.pagestore = _up_store(args.address)
    if args.pagestore:
        try:
            store = store_stats(args.pagestore, min(args.timeout, 5.0), tls_options(args))
        except grpc.RpcError as err:
            store_error = f"{err.code().name}: {err.details()}"  # a down store is reported, not fatal
    if args.json:
        out: dict[str, Any] = MessageToDict(
            st, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        if args.pagestore:
            out["pagestore"] = {"address": args.pagestore, "error": store_error}
            if store is not None:
                out["pagestore"].update(
                    MessageToDict(
                        store, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
                    )
                )
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    print(format_status(st))
    if store is not None:
        print(format_store(args.pagestore, store))
    elif args.pagestore:
        print(f"pagestore {args.pagestore}: unreachable ({store_error})")
    return 0
