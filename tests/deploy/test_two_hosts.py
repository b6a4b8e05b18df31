"""The mesh split across two "hosts": two network namespaces of this machine joined by a veth pair.

Host A runs the directory and the prefill; host B the decode and the router, and the client runs in B
too. Each namespace has only its loopback and its end of the veth, so every gRPC call between the two
halves and the KV pages themselves cross the veth link. UCX is held to TCP (``UCX_TLS=tcp`` on the veth
device): the two processes share a kernel, and without that UCX could move the pages through shared
memory instead. The layout is docs/deploy.md's, shrunk onto one machine.

Needs root and ``ip netns`` (iproute2); skips saying so where the machine does not allow it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from xavier_core.engine.tiny import make_tiny

pytestmark = pytest.mark.integration

IP = shutil.which("ip")


def _sh(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(IP), *args], capture_output=True, text=True, timeout=30, check=False)


@dataclass
class Hosts:
    a: str
    b: str
    dev_a: str
    dev_b: str
    addr_a: str
    addr_b: str


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    if IP is None or os.geteuid() != 0:
        pytest.skip("two-host test needs root and iproute2's `ip netns`")
    tag = secrets.token_hex(3)
    net = 16 + secrets.randbelow(200)
    h = Hosts(f"xa{tag}", f"xb{tag}", f"va{tag}", f"vb{tag}", f"10.251.{net}.1", f"10.251.{net}.2")
    made = _sh("netns", "add", h.a)
    if made.returncode != 0:
        pytest.skip(f"this machine does not allow network namespaces: {made.stderr.strip()}")
    try:
        steps = [
            ("netns", "add", h.b),
            ("link", "add", h.dev_a, "type", "veth", "peer", "name", h.dev_b),
            ("link", "set", h.dev_a, "netns", h.a),
            ("link", "set", h.dev_b, "netns", h.b),
            ("-n", h.a, "addr", "add", f"{h.addr_a}/24", "dev", h.dev_a),
            ("-n", h.b, "addr", "add", f"{h.addr_b}/24", "dev", h.dev_b),
            ("-n", h.a, "link", "set", h.dev_a, "up"),
            ("-n", h.b, "link", "set", h.dev_b, "up"),
            ("-n", h.a, "link", "set", "lo", "up"),
            ("-n", h.b, "link", "set", "lo", "up"),
        ]
        for step in steps:
            out = _sh(*step)
            if out.returncode != 0:
                pytest.skip(f"cannot wire two namespaces (ip {' '.join(step)}): {out.stderr.strip()}")
        yield h
    finally:
        _sh("netns", "del", h.a)
        _sh("netns", "del", h.b)


class Procs:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, ns: str, name: str, binary: str, args: list[str], env: dict[str, str]) -> str:
        ready = self.workdir / f"{name}.ready"
        log = open(self.workdir / f"{name}.log", "wb")
        exe = str(Path(sys.executable).parent / binary)
        self.procs[name] = subprocess.Popen(
            [str(IP), "netns", "exec", ns, exe, "--ready-file", str(ready), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
        deadline = time.monotonic() + 120
        while not ready.exists():
            if self.procs[name].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start:\n{self.log(name)}")
            time.sleep(0.05)
        address: str = json.loads(ready.read_text())["address"]
        return address

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


CLIENT = """
import sys
import grpc
from xavier.v1 import decode_service_pb2 as dec, decode_service_pb2_grpc as dec_grpc
from xavier_client import Client
with Client(sys.argv[1], timeout=60) as c:
    for i in range(4):
        out = c.generate(f"two hosts {i}", max_tokens=6, temperature=0.0, mode="pd")
        assert out.completion_tokens == 6 and out.mode == "pd", out
with grpc.insecure_channel(sys.argv[2]) as ch:
    stats = dec_grpc.DecodeServiceStub(ch).GetDecodeStats(dec.GetDecodeStatsRequest(), timeout=10)
t = stats.transfer
print(f"transfers={t.transfers} bytes={t.bytes} failures={t.failures}")
"""


def test_pd_mesh_across_two_network_namespaces(hosts: Hosts, tmp_path: Path) -> None:
    model = make_tiny(tmp_path / "tiny-qwen2", "qwen2")
    procs = Procs(tmp_path)
    try:
        directory = procs.start(
            hosts.a, "directory", "xavier-directory", ["--listen", f"{hosts.addr_a}:0"], {}
        )

        def peer_env(dev: str, addr: str) -> dict[str, str]:
            return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": dev, "XAVIER_PEER__ADVERTISE_HOST": addr}

        common = ["--model", str(model), "--directory", directory, "--device", "cpu"]
        procs.start(
            hosts.a, "prefill", "xavier-prefill",
            [*common, "--peer-id", "prefill-a", "--listen", f"{hosts.addr_a}:0"],
            peer_env(hosts.dev_a, hosts.addr_a),
        )  # fmt: skip
        decode = procs.start(
            hosts.b, "decode", "xavier-decode",
            [*common, "--peer-id", "decode-b", "--role", "decode", "--listen", f"{hosts.addr_b}:0"],
            peer_env(hosts.dev_b, hosts.addr_b),
        )  # fmt: skip
        router = procs.start(
            hosts.b, "router", "xavier-router",
            ["--model", str(model), "--directory", directory, "--listen", f"{hosts.addr_b}:0",
             "--http", "", "--mode", "pd"],
            {},
        )  # fmt: skip
        out = subprocess.run(
            [str(IP), "netns", "exec", hosts.b, sys.executable, "-c", CLIENT, router, decode],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert out.returncode == 0, out.stdout + out.stderr + procs.log("decode") + procs.log("prefill")
        # Every request's pages crossed the link: one NIXL read each, from host A's prefill.
        counts = dict(kv.split("=") for kv in out.stdout.split())
        assert int(counts["transfers"]) == 4 and int(counts["bytes"]) > 0 and counts["failures"] == "0"
        # Host A cannot be reached from this (the root) namespace at all: the halves really are apart.
        probe = (
            subprocess.run(["ping", "-c1", "-W1", hosts.addr_a], capture_output=True, timeout=10, check=False)
            if shutil.which("ping")
            else None
        )
        assert probe is None or probe.returncode != 0
    finally:
        procs.stop()
