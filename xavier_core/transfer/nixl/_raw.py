"""Typed boundary over the untyped NIXL Python API.

NIXL ships as `nixl` (meta package), `nixl_cu12` or `nixl_cu13`; all expose the same `_api` module. Only
this file touches NIXL objects, so everything above it is checked by mypy.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any, Literal, cast

import numpy as np
import numpy.typing as npt

XferState = Literal["PROC", "DONE", "ERR"]
MemType = Literal["DRAM", "VRAM"]
Op = Literal["READ", "WRITE"]

_MODULES = ("nixl_cu12._api", "nixl._api", "nixl_cu13._api")


class NixlUnavailableError(ImportError):
    """No NIXL build can be imported in this environment."""


def _load_api() -> Any:
    errors: list[str] = []
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise NixlUnavailableError("NIXL is not installed (tried " + "; ".join(errors) + ")")


_ENV_LOCK = threading.Lock()
"""Held while an agent is created: its backend reads the process environment then, and `ucx_env` changes
it for that one creation."""


@contextlib.contextmanager
def _environment(overrides: Mapping[str, str]) -> Iterator[None]:
    """`os.environ` with `overrides` until the block ends, then as it was."""
    with _ENV_LOCK:
        before = {k: os.environ.get(k) for k in overrides}
        os.environ.update(overrides)
        try:
            yield
        finally:
            for key, value in before.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


class RawAgent:
    """A NIXL agent with typed methods; it adds no locking and no policy.

    `ucx_env`: UCX settings (`UCX_*` variables) of this agent's backend alone, over the process
    environment (whose other `UCX_*` variables, such as `UCX_TLS`, still apply)."""

    def __init__(
        self, name: str, progress_thread: bool, backend: str, ucx_env: Mapping[str, str] | None = None
    ) -> None:
        api = _load_api()
        config = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=[backend])
        with _environment(ucx_env or {}):
            self._agent: Any = api.nixl_agent(name, config)
        if backend not in self._agent.backends:
            raise RuntimeError(f"NIXL backend {backend!r} could not be created for agent {name!r}")
        self.name = name

    def register(self, regions: npt.NDArray[np.uint64], mem: MemType) -> object:
        return cast(object, self._agent.register_memory(regions, mem))

    def deregister(self, reg: object) -> None:
        self._agent.deregister_memory(reg)

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def add_remote(self, metadata: bytes) -> str:
        name = self._agent.add_remote_agent(metadata)
        # 1.5.1 returns bytes here while notification keys and every other call take str.
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_remote(self, name: str) -> None:
        self._agent.remove_remote_agent(name)

    def connect(self, remote_name: str) -> None:
        """Sets up the endpoint to a loaded remote agent now rather than at its first use."""
        self._agent.make_connection(remote_name)

    def read(
        self,
        local: npt.NDArray[np.uint64],
        local_mem: MemType,
        remote: npt.NDArray[np.uint64],
        remote_mem: MemType,
        remote_name: str,
        notif: bytes,
        op: Op = "READ",
    ) -> tuple[object, XferState]:
        """Creates and posts a READ (or, with `op`, a WRITE); returns the raw handle and the state
        `transfer` reported. A handle whose transfer could not be posted is released."""
        ldescs = self._agent.get_xfer_descs(local, local_mem)
        rdescs = self._agent.get_xfer_descs(remote, remote_mem)
        return self._post(self._agent.initialize_xfer(op, ldescs, rdescs, remote_name, notif))

    def prep(self, agent_name: str, table: npt.NDArray[np.uint64], mem: MemType) -> object:
        """A prepared descriptor list of `table` (rows: address, length, device id): local when
        `agent_name` is "", else of that remote agent's registered memory."""
        return cast(object, self._agent.prep_xfer_dlist(agent_name or "NIXL_INIT_AGENT", table, mem))

    def release_prepped(self, handle: object) -> None:
        self._agent.release_dlist_handle(handle)

    def read_prepped(
        self,
        op: Op,
        local: object,
        local_idx: npt.NDArray[np.int32],
        remote: object,
        remote_idx: npt.NDArray[np.int32],
        notif: bytes,
    ) -> tuple[object, XferState]:
        """Creates and posts a READ (or WRITE) of descriptors of two prepared lists, by index (NIXL
        merges consecutive ones contiguous on both sides); like `read` otherwise."""
        return self._post(self._agent.make_prepped_xfer(op, local, local_idx, remote, remote_idx, notif))

    def _post(self, handle: Any) -> tuple[object, XferState]:
        try:
            state = self._agent.transfer(handle)
        except BaseException:
            handle.release()
            raise
        return cast(object, handle), _state(state)

    def check(self, handle: object) -> XferState:
        return _state(self._agent.check_xfer_state(handle))

    def release(self, handle: object) -> None:
        self._agent.release_xfer_handle(handle)

    def notifs(self) -> dict[str, list[bytes]]:
        raw = self._agent.get_new_notifs()
        return {str(k): [bytes(m) for m in v] for k, v in raw.items()}

    def send_notif(self, remote_name: str, msg: bytes) -> None:
        self._agent.send_notif(remote_name, msg)


def _state(value: object) -> XferState:
    if value == "DONE":
        return "DONE"
    if value == "PROC":
        return "PROC"
    return "ERR"
