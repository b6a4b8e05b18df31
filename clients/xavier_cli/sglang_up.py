"""`xavier up --engine sglang`: each engine service hosts an SGLang server, configured by a TOML file per
replica (the supervisor restarts a service with the same arguments, so a file keeps its SGLang port,
GPU and key across restarts).

Modes: pd (SGLang prefill + decode with the xavier transfer backend, paired by the router), colocated
(unified SGLang replicas), native (SGLang prefill + decode on SGLang's own NIXL backend, with a
bootstrap port and an API key; the router's native mode calls them over HTTP).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

__all__ = ["NativeWiring", "add_sglang_args", "native_wiring", "replica_config", "router_config"]


def add_sglang_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--engine", choices=["reference", "sglang"], default="reference", help="engine of every replica"
    )
    p.add_argument(
        "--sglang-command",
        default=None,
        metavar="CMD",
        help='SGLang launcher as a JSON list (default ["python", "-m", "sglang.launch_server"])',
    )
    p.add_argument(
        "--sglang-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an SGLang flag or value, repeatable (--sglang-arg=--mem-fraction-static --sglang-arg=0.5)",
    )
    p.add_argument(
        "--gpus",
        default="",
        metavar="LIST",
        help="GPU indices for the SGLang replicas, round-robin in start order (prefills, decodes, unified)",
    )
    p.add_argument(
        "--gpu-assign",
        choices=["base-gpu-id", "visible-devices"],
        default="base-gpu-id",
        help="how a replica gets its GPU: SGLang's --base-gpu-id, or CUDA_VISIBLE_DEVICES=<gpu>",
    )
    p.add_argument(
        "--sglang-hicache",
        action="store_true",
        help="HiCache on the page store for SGLang prefill/unified replicas (needs --pagestore)",
    )
    p.add_argument(
        "--sglang-hicache-file",
        action="store_true",
        help="HiCache on SGLang's own file backend (SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR), no page store",
    )


@dataclass(frozen=True)
class NativeWiring:
    """Native mode: where the SGLang servers listen, the prefill's bootstrap port and the shared key."""

    prefill_port: int
    decode_port: int
    bootstrap_port: int
    api_key: str


def _free_port() -> int:
    # SGLang takes port numbers, not sockets: picked once here so restarts keep them (a port taken in the
    # meantime makes SGLang exit, and the supervisor reports it).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def native_wiring() -> NativeWiring:
    return NativeWiring(_free_port(), _free_port(), _free_port(), secrets.token_hex(24))


def _gpus(args: argparse.Namespace) -> list[int]:
    try:
        return [int(g) for g in args.gpus.split(",") if g.strip()]
    except ValueError:
        raise ValueError(f"--gpus: expected indices like 0,1, got {args.gpus!r}") from None


def shares_a_gpu(args: argparse.Namespace, replicas: int) -> bool:
    """Whether two of the `replicas` SGLang replicas (in start order) get the same GPU. SGLang sizes its
    KV pool from the memory free when it starts, so replicas that share a GPU must start one after
    another: one that starts while its neighbour allocates finds no memory left for its pool. No
    `--gpus`: every replica is on the default GPU."""
    gpus = _gpus(args)
    if not gpus:
        return replicas > 1
    taken = [gpus[i % len(gpus)] for i in range(replicas)]
    return len(set(taken)) < len(taken)


def _write(path: Path, text: str) -> Path:
    # 0600: the file may carry the native servers' API key.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def replica_config(
    args: argparse.Namespace,
    workdir: Path,
    name: str,
    role: str,
    index: int,
    pagestore: str,
    native: NativeWiring | None,
) -> Path:
    """Writes the TOML of one SGLang replica (`index`: its place in start order, for the GPU)."""
    sglang: dict[str, object] = {"extra_args": list(args.sglang_arg)}
    if args.sglang_command:
        command = json.loads(args.sglang_command)
        if not isinstance(command, list) or not all(isinstance(c, str) for c in command):
            raise ValueError("--sglang-command: expected a JSON list of strings")
        sglang["command"] = command
    gpus = _gpus(args)
    if gpus:
        gpu = gpus[index % len(gpus)]
        if args.gpu_assign == "base-gpu-id":
            sglang["base_gpu_id"] = gpu
        else:
            sglang["cuda_visible_devices"] = str(gpu)
    if native is not None:
        sglang.update(
            transfer_backend="nixl",
            port=native.prefill_port if role == "prefill" else native.decode_port,
            bootstrap_port=native.bootstrap_port,
            api_key=native.api_key,
        )
    if args.sglang_hicache and pagestore and role != "decode":
        sglang["hicache"] = True
    if args.sglang_hicache_file and role != "decode":
        sglang.update(hicache=True, hicache_backend="file")
    lines = ["[engine]", 'kind = "sglang"', "", "[sglang]"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in sglang.items()]
    if pagestore and role != "decode":
        lines += ["", "[pagestore]", f"address = {json.dumps(pagestore)}"]
    return _write(workdir / f"{name}.toml", "\n".join(lines) + "\n")


def router_config(workdir: Path, native: NativeWiring) -> Path:
    """The router's `[native]` section for native mode."""
    text = "\n".join(
        [
            "[native]",
            f'prefill_url = "http://127.0.0.1:{native.prefill_port}"',
            f'decode_url = "http://127.0.0.1:{native.decode_port}"',
            'bootstrap_host = "127.0.0.1"',
            f"bootstrap_port = {native.bootstrap_port}",
            f'api_key = "{native.api_key}"',
        ]
    )
    return _write(workdir / "router.toml", text + "\n")
