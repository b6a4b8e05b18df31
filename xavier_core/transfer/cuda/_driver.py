"""The few CUDA driver calls torch does not expose: legacy IPC handles and peer access, through ctypes.

Loaded lazily from `libcuda.so.1` (the driver every CUDA process already has mapped), so nothing here
needs cuda-python. Every call acts on the calling thread's current context: callers make the context of
the device they mean current first (`current_device`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Iterator

from xavier_core.transfer.common.errors import TransferError

IPC_HANDLE_SIZE = 64  # CU_IPC_HANDLE_SIZE
_LAZY_ENABLE_PEER_ACCESS = 0x1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
_PEER_ACCESS_ALREADY_ENABLED = 704  # CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED


class CudaDriverError(TransferError):
    """A CUDA driver call failed (no driver, an invalid pointer or handle, or peer access refused)."""


class _IpcMemHandle(ctypes.Structure):
    # CUipcMemHandle is `char reserved[64]`; spelled as eight words because ctypes mis-describes a struct
    # holding an array when passing it by value (cuIpcOpenMemHandle then reads garbage: INVALID_VALUE).
    _fields_ = [(f"w{i}", ctypes.c_uint64) for i in range(IPC_HANDLE_SIZE // 8)]


class _Driver:
    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise CudaDriverError(f"the CUDA driver library is not available: {exc}") from exc
        self.lock = threading.Lock()
        c = ctypes
        # Declared signatures: ctypes must pass the 64-byte handle by value and 64-bit addresses whole.
        signatures: dict[str, list[type]] = {
            "cuGetErrorName": [c.c_int, c.POINTER(c.c_char_p)],
            "cuMemGetAddressRange_v2": [c.POINTER(c.c_uint64), c.POINTER(c.c_size_t), c.c_uint64],
            "cuIpcGetMemHandle": [c.POINTER(_IpcMemHandle), c.c_uint64],
            "cuIpcOpenMemHandle_v2": [c.POINTER(c.c_uint64), _IpcMemHandle, c.c_uint],
            "cuIpcCloseMemHandle": [c.c_uint64],
            "cuDeviceGet": [c.POINTER(c.c_int), c.c_int],
            "cuDevicePrimaryCtxRetain": [c.POINTER(c.c_void_p), c.c_int],
            "cuDevicePrimaryCtxRelease_v2": [c.c_int],
            "cuCtxEnablePeerAccess": [c.c_void_p, c.c_uint],
        }
        for name, argtypes in signatures.items():
            fn = getattr(self.lib, name)
            fn.argtypes = argtypes
            fn.restype = c.c_int

    def call(self, name: str, *args: object) -> None:
        rc = int(getattr(self.lib, name)(*args))
        if rc != 0:
            raise CudaDriverError(f"{name} failed: {self.error_name(rc)}")

    def error_name(self, rc: int) -> str:
        text = ctypes.c_char_p()
        if self.lib.cuGetErrorName(rc, ctypes.byref(text)) != 0 or text.value is None:
            return f"CUDA error {rc}"
        return f"{text.value.decode()} ({rc})"


@functools.cache
def _driver() -> _Driver:
    return _Driver()


@contextlib.contextmanager
def current_device(device: int) -> Iterator[None]:
    """Makes `device`'s primary context current on this thread (through torch, which owns it)."""
    import torch

    with torch.cuda.device(device):
        # A runtime call binds the primary context to this thread (the driver calls need it bound);
        # querying a stream is one that never blocks.
        torch.cuda.current_stream(device).query()
        yield


def allocation_range(ptr: int) -> tuple[int, int]:
    """(base, size) of the cudaMalloc allocation holding device address `ptr`."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _driver().call("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), ptr)
    return int(base.value), int(size.value)


def ipc_get_handle(base: int) -> bytes:
    """The IPC handle of the allocation starting at `base` (current context)."""
    handle = _IpcMemHandle()
    _driver().call("cuIpcGetMemHandle", ctypes.byref(handle), base)
    return bytes(handle)


def ipc_open(handle: bytes) -> int:
    """Maps another process's allocation into the current context; returns its base address here."""
    if len(handle) != IPC_HANDLE_SIZE:
        raise CudaDriverError(f"an IPC handle has {IPC_HANDLE_SIZE} bytes, not {len(handle)}")
    h = _IpcMemHandle()
    ctypes.memmove(ctypes.addressof(h), handle, IPC_HANDLE_SIZE)
    ptr = ctypes.c_uint64()
    _driver().call("cuIpcOpenMemHandle_v2", ctypes.byref(ptr), h, _LAZY_ENABLE_PEER_ACCESS)
    return int(ptr.value)


def ipc_close(ptr: int) -> None:
    _driver().call("cuIpcCloseMemHandle", ptr)


def enable_peer_access(accessor: int, owner: int) -> None:
    """Lets kernels running on device `accessor` read and write memory of device `owner` (idempotent)."""
    if accessor == owner:
        return
    drv = _driver()
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    with drv.lock:
        drv.call("cuDeviceGet", ctypes.byref(dev), owner)
        # Retained only to learn the handle: torch keeps the primary context alive, so release at once.
        drv.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        try:
            with current_device(accessor):
                rc = int(drv.lib.cuCtxEnablePeerAccess(ctx, 0))
        finally:
            drv.call("cuDevicePrimaryCtxRelease_v2", dev)
    if rc not in (0, _PEER_ACCESS_ALREADY_ENABLED):
        raise CudaDriverError(
            f"peer access from cuda:{accessor} to cuda:{owner} refused: {drv.error_name(rc)}"
        )
