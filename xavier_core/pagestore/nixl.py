"""NIXL for the page store: one agent per side, READs and WRITEs of raw descriptor rows.

The transfer package's `NixlAgent` pairs pages of two identical pools; the store's arena is laid out
differently from a replica's pool (segment-major chunks, see `layout`), so the page store posts its own
rows (arena address, local address, nbytes) in either direction through `RawAgent.read(..., op=...)`.
Both sides run without NIXL's progress thread: the store polls while any lease is live, the client polls
its transfer.

UCX's TCP segments are 256 KiB (`TCP_SEGMENT_BYTES`) where UCX's default is 8 KiB: the store's agent
sends and receives them (`STORE_UCX_ENV`), a client's receives them and sends 8 KiB ones
(`CLIENT_UCX_ENV`). Where UCX cannot copy between the two processes with CMA (`process_vm_readv`, which a
container's seccomp profile may forbid), a READ goes over TCP as a request per segment answered by the
store's worker, and 8 KiB segments left a store READ at under half a WRITE's rate
(`docs/results/pagestore-cpu-tcp-segments.json`). A receiver must take the largest segment its peer
sends (a larger one aborts its process inside UCX), so a client declares what it receives when it asks
for the store's endpoint and the store turns away one that cannot take its segments (a client of
xavier.v1.0 declares nothing: 8 KiB); a client's own 8 KiB segments suit any store.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

from xavier_core.transfer.common.buffers import KvBuffer
from xavier_core.transfer.common.errors import PeerError
from xavier_core.transfer.nixl._raw import MemType, RawAgent, XferState
from xavier_core.transfer.nixl.agent import check_buffers, register_buffers
from xavier_core.transfer.nixl.xfer import Transfer

Op = Literal["READ", "WRITE"]

TCP_SEGMENT_BYTES = 256 << 10
"""The UCX TCP segment size the store sends in and clients receive (see the module docstring)."""
UCX_DEFAULT_SEGMENT_BYTES = 8 << 10
"""UCX's own TCP segment size: what a client of xavier.v1.0 receives and what every client sends."""
STORE_UCX_ENV = {"UCX_TCP_TX_SEG_SIZE": str(TCP_SEGMENT_BYTES), "UCX_TCP_RX_SEG_SIZE": str(TCP_SEGMENT_BYTES)}
CLIENT_UCX_ENV = {"UCX_TCP_RX_SEG_SIZE": str(TCP_SEGMENT_BYTES)}


class PageAgent(RawAgent):
    """A `RawAgent` that also posts WRITEs; every call is serialised by `lock`."""

    def __init__(
        self,
        name: str,
        buffers: Sequence[KvBuffer],
        ucx_env: Mapping[str, str],
        *,
        backend: str = "UCX",
    ) -> None:
        super().__init__(name, False, backend, ucx_env=ucx_env)
        self.lock = threading.RLock()
        self.mem: MemType = check_buffers(buffers, "local")
        self.buffers = tuple(buffers)
        self._reg: object | None = register_buffers(self, buffers, self.mem)
        self._metadata = super().metadata()

    def metadata(self) -> bytes:
        return self._metadata

    def post(
        self, op: Op, rows: npt.NDArray[np.uint64], remote_name: str, timeout_s: float, notif: bytes = b""
    ) -> Transfer:
        """Posts one transfer of `rows` (remote DRAM address, local address, nbytes) and returns it."""
        dev = np.zeros(rows.shape[0], dtype=np.uint64)
        local = np.ascontiguousarray(np.stack((rows[:, 1], rows[:, 2], dev), axis=1))
        remote = np.ascontiguousarray(np.stack((rows[:, 0], rows[:, 2], dev), axis=1))
        with self.lock:
            try:
                handle, state = self.read(local, self.mem, remote, "DRAM", remote_name, notif, op=op)
            except Exception as exc:
                raise PeerError(f"{op} to {remote_name!r} failed: {type(exc).__name__}: {exc}") from exc
            xfer = Transfer(
                self,
                self.lock,
                handle,
                int(rows[:, 2].sum()),
                rows.shape[0],
                timeout_s,
                lambda _x: None,
            )
            xfer._settle(state)
            return xfer

    def progress(self) -> None:
        """Drives passive-side progress (the store calls this while clients may read or write its arena)."""
        with self.lock:
            self.notifs()

    def close(self) -> None:
        with self.lock:
            if self._reg is not None:
                try:
                    self.deregister(self._reg)
                finally:
                    self._reg = None


def wait(xfer: Transfer, poll_s: float = 0.0002) -> XferState:
    """Polls `xfer` until it ends (its own timeout cancels it); blocking, so run it off the event loop."""
    while (state := xfer.poll()) == "PROC":
        time.sleep(poll_s)
    return state
