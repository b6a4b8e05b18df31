"""A real etcd server for tests (Debian's ``etcd-server``, installed by scripts/setup.sh).

Its data lives in /dev/shm where there is one (fsync is what makes a disk-backed etcd slow on a shared
machine; the tests are about ordering and failover, not durability of the host's disk). ``restart``
stops it (SIGKILL: a crash, not a clean shutdown) and starts it again on the same ports and data.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from xavier_core.runtime.tls import DevCertificates

ETCD = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
NO_ETCD = "etcd is not installed (scripts/setup.sh installs Debian's etcd-server; apt was unavailable here)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Etcd:
    """One single-member etcd on two free loopback ports."""

    def __init__(self, workdir: Path, tls: DevCertificates | None = None) -> None:
        if ETCD is None:
            pytest.skip(NO_ETCD)
        base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else workdir
        self.data = Path(tempfile.mkdtemp(prefix="xavier-etcd-", dir=base))
        self.log_path = workdir / f"etcd-{uuid.uuid4().hex[:6]}.log"
        self.client_port, self.peer_port = _free_port(), _free_port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.tls = tls
        """With it, clients must use https and present a certificate of the same CA."""
        self.start()

    def start(self) -> None:
        url = f"{'https' if self.tls else 'http'}://{self.endpoint}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        args = [
            str(ETCD), "--name", "t", "--data-dir", str(self.data),
            "--listen-client-urls", url, "--advertise-client-urls", url,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"t={peer}", "--log-level", "error",
        ]  # fmt: skip
        if self.tls is not None:
            args += ["--cert-file", str(self.tls.cert_file), "--key-file", str(self.tls.key_file),
                     "--trusted-ca-file", str(self.tls.ca_file), "--client-cert-auth"]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited:\n{self.log_path.read_text(errors='replace')}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.client_port)) == 0:
                    return
            time.sleep(0.05)
        raise TimeoutError(f"etcd not listening:\n{self.log_path.read_text(errors='replace')}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def restart(self) -> None:
        self.kill()
        self.start()

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.data, ignore_errors=True)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    server = Etcd(tmp_path_factory.mktemp("etcd"))
    yield server
    server.close()


def etcd_env(server: Etcd, prefix: str | None = None) -> dict[str, str]:
    """Environment for a directory process on ``server`` (a fresh key prefix unless given)."""
    return {
        "XAVIER_DIRECTORY__BACKEND": "etcd",
        "XAVIER_DIRECTORY__ETCD_ENDPOINTS": f'["{server.endpoint}"]',
        "XAVIER_DIRECTORY__ETCD_PREFIX": prefix or f"/t/{uuid.uuid4().hex}/",
    }
