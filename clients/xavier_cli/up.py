"""`xavier up`: the whole mesh on this machine as child processes, until Ctrl-C or SIGTERM.

A service that dies is restarted with backoff while the rest keep serving; `xavier up` exits on Ctrl-C /
SIGTERM (0) or when one service exhausts its restarts (1)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from xavier_cli.sglang_up import (
    add_sglang_args,
    native_wiring,
    replica_config,
    router_config,
    shares_a_gpu,
)
from xavier_cli.supervisor import Child, GaveUp, Keeper, RestartPolicy, Supervisor

if TYPE_CHECKING:
    from xavier_core.runtime.identity import Identity
    from xavier_core.runtime.tls import DevCertificates

DEFAULT_GRPC = "127.0.0.1:50051"
DEFAULT_HTTP = "127.0.0.1:8000"


def cache_dir() -> Path:
    """`$XAVIER_CACHE_DIR`, else `~/.cache/xavier`."""
    return Path(os.environ.get("XAVIER_CACHE_DIR") or Path.home() / ".cache" / "xavier")


def default_model(say: Callable[[str], None]) -> Path:
    """The embedded default checkpoint, made on first use (written aside, then renamed into place)."""
    path = cache_dir() / "models" / "tiny-qwen2"
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return path
    say(f"making the default tiny checkpoint in {path} (first use)")
    from xavier_core.engine.tiny import make_tiny  # torch: only when needed

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-qwen2-", dir=path.parent))
    make_tiny(tmp, "qwen2")
    try:
        tmp.rename(path)
    except OSError:  # another `xavier up` made it first
        pass
    return path


def state_file(grpc_address: str) -> Path:
    """Where a running `xavier up` leaves its endpoints for `xavier status` (one file per router address)."""
    return cache_dir() / "up" / (grpc_address.replace(":", "_").replace("/", "_") + ".json")


def add_up_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: embedded tiny)")
    p.add_argument(
        "--mode",
        choices=["pd", "colocated", "native"],
        default="pd",
        help="default routing mode (native: SGLang's own NIXL P/D, --engine sglang only)",
    )
    p.add_argument("--prefill", type=int, default=None, help="prefill replicas (pd default 1)")
    p.add_argument("--decode", type=int, default=None, help="decode replicas (pd default 1)")
    p.add_argument("--unified", type=int, default=None, help="unified replicas (colocated default 1)")
    p.add_argument("--grpc", default=DEFAULT_GRPC, metavar="HOST:PORT", help="router gRPC address")
    p.add_argument("--http", default=DEFAULT_HTTP, metavar="HOST:PORT", help="OpenAI HTTP address")
    p.add_argument(
        "--device", default="cpu", help="cpu, cuda[:N], or cuda to spread engines over every visible GPU"
    )
    p.add_argument(
        "--compute", choices=["model", "null"], default="model", help="engine compute (null: no model math)"
    )
    p.add_argument("--workdir", type=Path, default=None, help="ready files and logs (default: a temp dir)")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext gRPC: anyone who reaches a port can register, evict or impersonate a peer "
        "(default: mTLS, a throwaway CA, one certificate per service naming its identity)",
    )
    p.add_argument("--tls", action="store_true", help=argparse.SUPPRESS)  # the default; kept for scripts
    p.add_argument("--ready-file", type=Path, default=None, help="write the endpoints here once up (JSON)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for every service")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=RestartPolicy.max_restarts,
        help="restarts of one service within --restart-window before xavier up gives up (0: never restart)",
    )
    p.add_argument(
        "--restart-window",
        type=float,
        default=RestartPolicy.window_seconds,
        help="seconds (see --max-restarts)",
    )
    p.add_argument(
        "--restart-backoff",
        type=float,
        default=RestartPolicy.backoff_seconds,
        help="seconds before the first restart; doubles per restart in the window, at most 10",
    )
    p.add_argument(
        "--pagestore",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start one page store and point every prefill/unified engine at it (default: on)",
    )
    p.add_argument(
        "--peer-sessions",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the router carries its calls to each peer that declares call sessions on one stream "
        "(router peer_sessions; default: on)",
    )
    p.add_argument(
        "--router-workers",
        type=int,
        default=1,
        metavar="N",
        help="router processes sharing its gRPC and HTTP addresses, each about one core (router workers; "
        "default: 1)",
    )
    p.add_argument(
        "--share-prefixes",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="unified replicas copy a stored prefix straight from the pool of the replica that wrote it, "
        "where that one still holds it, instead of reading the store (handoff.share_prefixes; default: off)",
    )
    p.add_argument(
        "--pagestore-listen", default="127.0.0.1:0", metavar="HOST:PORT", help="page store address"
    )
    p.add_argument(
        "--pagestore-arena-bytes",
        type=int,
        default=None,
        metavar="BYTES",
        help="the page store's DRAM arena (its pagestore.arena_bytes; default: its config's, 256 MiB)",
    )
    add_sglang_args(p)


class _Stop:
    def __init__(self) -> None:
        self.requested = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True


def _counts(args: argparse.Namespace) -> tuple[int, int, int]:
    if args.mode in ("pd", "native"):
        return (
            1 if args.prefill is None else args.prefill,
            1 if args.decode is None else args.decode,
            args.unified or 0,
        )
    return args.prefill or 0, args.decode or 0, 1 if args.unified is None else args.unified


def _count_problem(mode: str, prefill: int, decode: int, unified: int) -> str:
    """Why these replica counts cannot serve `mode` ("" when they can). Prefills and decodes come
    together: one without the other would start and never serve a request."""
    if (
        prefill + decode + unified == 0
        or (mode == "pd" and (prefill == 0 or decode == 0))
        or (mode == "colocated" and unified == 0)
    ):
        return "pd mode needs --prefill and --decode >= 1; colocated needs --unified >= 1"
    if prefill and not decode:
        return f"--prefill {prefill} needs --decode >= 1: a prefill hands its KV to a decode"
    if decode and not prefill:
        return f"--decode {decode} needs --prefill >= 1: a decode takes its KV from a prefill"
    return ""


def run_up(args: argparse.Namespace) -> int:
    """Starts directory → peers (loading models in parallel) → router; stops them all on a signal."""
    stop = _Stop()
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    t0 = time.monotonic()

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {msg}", flush=True)

    prefill, decode, unified = _counts(args)
    problem = _count_problem(args.mode, prefill, decode, unified)
    if problem:
        print(f"xavier up: {problem}", file=sys.stderr)
        return 2
    for flag, address in (
        ("--grpc", args.grpc),
        ("--http", args.http),
        ("--pagestore-listen", args.pagestore_listen),
    ):
        taken = _taken(address)
        if taken:
            print(
                f"xavier up: {address} cannot be bound ({taken}); is another xavier up running? "
                f"Choose another with {flag} HOST:PORT",
                file=sys.stderr,
            )
            return 2
    problem = _sglang_problem(args, prefill, decode, unified)
    if problem:
        print(f"xavier up: {problem}", file=sys.stderr)
        return 2
    sglang = args.engine == "sglang"
    native = native_wiring() if args.mode == "native" else None
    use_store = args.pagestore and (not sglang or args.sglang_hicache)
    model = (args.model or default_model(say)).resolve()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="xavier-up-"))
    workdir.mkdir(parents=True, exist_ok=True)
    # The engine binaries take engine.compute from the environment; the directory and router have no
    # `engine` section, so they ignore the variable.
    env = {"XAVIER_ENGINE__COMPUTE": args.compute}
    if not args.peer_sessions:  # the router's `peer_sessions`; the other services have no such key
        env["XAVIER_PEER_SESSIONS"] = "false"
    if args.share_prefixes:
        if sglang or not use_store:
            print(
                "xavier up: --share-prefixes is for reference-engine replicas with the page store",
                file=sys.stderr,
            )
            return 2
        env["XAVIER_HANDOFF__SHARE_PREFIXES"] = "true"  # read by the engines' `handoff` section alone
    if args.insecure and args.tls:
        print("xavier up: --tls and --insecure contradict each other", file=sys.stderr)
        return 2
    certs = None if args.insecure else MeshCertificates(workdir / "tls")
    if certs is None:
        say("WARNING: --insecure: plaintext gRPC, no identities; anyone who reaches a port owns the mesh")
    sup = Supervisor(workdir, env=env, env_for=certs.env if certs is not None else None)
    code = 0
    state: Path | None = None
    try:
        directory = sup.start("directory", "xavier-directory", ["--listen", "127.0.0.1:0"], stage=0)
        first = [directory]
        if use_store:
            # Stage 0 like the directory: it outlives the engines that write to it.
            first.append(sup.start("pagestore", "xavier-pagestore", _store_args(args), stage=0))
        say(f"starting {' and '.join(c.name for c in first)}")
        if not sup.wait_ready(first, 60, lambda: stop.requested, _progress(say), _ready(say)):
            return 0
        store = first[1].address if use_store else ""
        common = ["--model", str(model), "--directory", directory.address, "--listen", "127.0.0.1:0"]
        devices = _devices(args.device)
        peers: list[Child] = []
        in_turn = sglang and shares_a_gpu(args, prefill + decode + unified)
        if in_turn:
            say("SGLang replicas share a GPU: each starts once the previous one is ready (its KV pool sized)")
        for role, n in (("prefill", prefill), ("decode", decode), ("unified", unified)):
            for i in range(n):
                binary = "xavier-prefill" if role == "prefill" else "xavier-decode"
                extra = ["--role", role] if role != "prefill" else []
                name = f"{role}-{i}"
                if sglang:
                    path = replica_config(args, workdir, name, role, len(peers), store, native)
                    extra += ["--config", str(path)]
                elif store:  # a decode writes its answers' pages through, the others prompts' too
                    extra += ["--pagestore", store]
                device = devices[len(peers) % len(devices)]
                args_ = [*common, "--device", device, "--peer-id", name, *extra]
                if in_turn and peers:
                    if not sup.wait_ready(
                        peers[-1:], args.timeout, lambda: stop.requested, _progress(say), _ready(say)
                    ):
                        return 0
                peers.append(sup.start(name, binary, args_, stage=1))
        say(f"loading {model.name} in {len(peers)} engine process(es): {', '.join(c.name for c in peers)}")
        if not sup.wait_ready(
            [c for c in peers if not c.info],
            args.timeout,
            lambda: stop.requested,
            _progress(say),
            _ready(say),
        ):
            return 0
        router = sup.start(
            "router",
            "xavier-router",
            [
                "--model",
                str(model),
                "--directory",
                directory.address,
                "--listen",
                args.grpc,
                "--http",
                args.http,
                "--mode",
                args.mode,
                "--workers",
                str(args.router_workers),
                *(["--config", str(router_config(workdir, native))] if native is not None else []),
            ],
            stage=2,
        )
        say("starting router")
        if not sup.wait_ready([router], 60, lambda: stop.requested, _progress(say), _ready(say)):
            return 0
        endpoints = {
            "grpc": router.address,
            "http": router.info.get("http", ""),
            "directory": directory.address,
            "pagestore": store,
            "mode": args.mode,
            "model": str(model),
            "workdir": str(workdir),
            "pid": os.getpid(),
            **({"client_tls": certs.client()} if certs is not None else {}),
        }
        engine = " on SGLang" if sglang else ""
        print(f"\nXavier is up ({args.mode}{engine}, {model.name}).", flush=True)
        print(f'  gRPC    {endpoints["grpc"]}   (xavier generate --address {endpoints["grpc"]} "Hello")')
        print(f"  OpenAI  http://{endpoints['http']}/v1")
        print(
            "  metrics "
            + ", ".join(f"{c.name} http://{c.metrics}/metrics" for c in sup.children if c.metrics)
        )
        if store:
            print(f"  store   {store}   (xavier status --address {endpoints['grpc']} --pagestore {store})")
        print(f"  logs    {workdir}\nPress Ctrl-C to stop.", flush=True)
        state = state_file(router.address)
        for path in (args.ready_file, state):
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_text(json.dumps(endpoints) + "\n")
                os.replace(tmp, path)
        keeper = Keeper(sup, _policy(args, say), say)
        while not stop.requested:
            keeper.tick()
            time.sleep(0.2)
    except GaveUp as exc:
        print(f"xavier up: {exc}", file=sys.stderr)
        code = 1
    except (RuntimeError, TimeoutError) as exc:
        print(f"xavier up failed: {exc}", file=sys.stderr)
        code = 1
    finally:
        say("stopping")
        sup.stop_all()
        if args.ready_file is not None:
            args.ready_file.unlink(missing_ok=True)
        if state is not None:
            state.unlink(missing_ok=True)
        say("stopped")
    return code


def _taken(address: str) -> str:
    """Why `address` (HOST:PORT) cannot be bound now, or "" (port 0 always can)."""
    import socket

    host, _, port = address.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return ""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]") or "0.0.0.0", int(port)))
        except OSError as exc:
            return exc.strerror or str(exc)
    return ""


def _sglang_problem(args: argparse.Namespace, prefill: int, decode: int, unified: int) -> str:
    """Why the flags cannot make an SGLang mesh ("" when they can)."""
    if args.engine != "sglang":
        if args.mode == "native":
            return "--mode native runs SGLang's own P/D: add --engine sglang"
        given = [flag for flag, value in _sglang_only(args) if value]
        if given:  # ignored, they would leave the mesh other than asked (on the CPU, say)
            return (
                f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for SGLang replicas: add "
                "--engine sglang (the reference engine takes its GPUs from --device cuda or cuda:N)"
            )
        return ""
    if args.mode == "native" and (prefill != 1 or decode != 1 or unified):
        return "--mode native serves one SGLang prefill and one decode (--prefill 1 --decode 1)"
    if args.compute != "model":
        return "--compute null is the reference engine's; SGLang always runs the model"
    if args.sglang_hicache and not args.pagestore:
        return "--sglang-hicache needs the page store (drop --no-pagestore)"
    if args.sglang_hicache and args.sglang_hicache_file:
        return "--sglang-hicache and --sglang-hicache-file choose HiCache's L3 twice: pick one"
    return ""


def _sglang_only(args: argparse.Namespace) -> list[tuple[str, object]]:
    """The flags only SGLang replicas read, each with whether it was given."""
    return [
        ("--sglang-command", args.sglang_command),
        ("--sglang-arg", args.sglang_arg),
        ("--gpus", args.gpus),
        ("--gpu-assign", args.gpu_assign != "base-gpu-id"),
        ("--sglang-hicache", args.sglang_hicache),
        ("--sglang-hicache-file", args.sglang_hicache_file),
    ]


def _policy(args: argparse.Namespace, say: Callable[[str], None]) -> RestartPolicy:
    policy = RestartPolicy(
        max_restarts=max(0, args.max_restarts),
        window_seconds=args.restart_window,
        backoff_seconds=args.restart_backoff,
        ready_timeout_seconds=args.timeout,
    )
    say(
        f"supervising: a service that dies is restarted (at most {policy.max_restarts} times in "
        f"{policy.window_seconds:.0f}s)"
    )
    return policy


def _progress(say: Callable[[str], None]) -> Callable[[Child, float], None]:
    def note(child: Child, elapsed: float) -> None:
        say(f"  {child.name}: still starting ({elapsed:.0f}s)")

    return note


def _ready(say: Callable[[str], None]) -> Callable[[Child], None]:
    def note(child: Child) -> None:
        metrics = f", metrics {child.metrics}" if child.metrics else ""
        say(f"  {child.name} ready at {child.address} ({time.monotonic() - child.started:.1f}s{metrics})")

    return note


def _devices(device: str) -> list[str]:
    """`cuda` spreads engine processes round-robin over the visible GPUs (prefill-0 on one, decode-0 on the
    next, so a two-GPU host runs P/D GPU to GPU); anything else pins every engine to that device."""
    if device != "cuda":
        return [device]
    import torch

    count = torch.cuda.device_count()
    return [f"cuda:{i}" for i in range(count)] or ["cuda:0"]


class MeshCertificates:
    """The throwaway CA of one `xavier up` and a certificate per service, issued on first use: the
    child named `prefill-0` is identity prefill/prefill-0, `router` router/router, and so on (see
    ``xavier_core.runtime.identity``). The CA key lives only in this process."""

    def __init__(self, directory: Path) -> None:
        from xavier_core.runtime.tls import DevCa

        self._ca = DevCa(directory)
        self._issued: dict[str, DevCertificates] = {}

    def _files(self, name: str, identity: Identity) -> DevCertificates:
        if name not in self._issued:
            self._issued[name] = self._ca.issue(name, identity)
        return self._issued[name]

    def env(self, child: str) -> dict[str, str]:
        """The ``[tls]`` section of the service `child`, as environment."""
        from xavier_core.runtime.identity import Identity

        role = child.rsplit("-", 1)[0] if child.rsplit("-", 1)[-1].isdigit() else child
        return self._files(child, Identity(role, child)).settings().env()

    def client(self) -> dict[str, str]:
        """The CLI's certificate (identity client/cli), for the state file."""
        from xavier_core.runtime.identity import Identity

        files = self._files("client", Identity("client", "cli"))
        return {
            "ca_file": str(files.ca_file),
            "cert_file": str(files.cert_file),
            "key_file": str(files.key_file),
        }


def _store_args(args: argparse.Namespace) -> list[str]:
    """The page store's command line: its address, and its arena when `--pagestore-arena-bytes` sets it
    (a flag of its own: the engines read the `pagestore` settings section too, as clients)."""
    out = ["--listen", args.pagestore_listen]
    if args.pagestore_arena_bytes is not None:
        out += ["--arena-bytes", str(args.pagestore_arena_bytes)]
    return out
