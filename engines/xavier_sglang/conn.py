"""SGLang's KV manager, sender, receiver and bootstrap server for `--disaggregation-transfer-backend xavier`.

Imported only by the plugin's `get_kv_class` hook, inside an SGLang process. The classes subclass
`sglang.srt.disaggregation.common.conn`'s, as SGLang's own backends do, so every `isinstance` and type
expectation of the scheduler holds; but they do not run those bases' constructors (ZMQ sockets, an HTTP
bootstrap server, heartbeats to it): the Xavier directory replaces all of that. The manager lives in
`manager`, room logic in `rooms`, `reader` and `hub`; this module only adapts SGLang's calling
conventions, which differ by release:

- the sender's constructor: 0.5.17 passes `dest_tp_ranks, pp_rank`, 0.5.23 does not;
- the receiver's `send_metadata`: 0.5.23 adds `destination` (only device destinations are supported);
- 0.5.23's deferred decode KV release: `supports_deferred_decode_kv_release`, the manager's
  `is_abort_release_safe(room, acks)` and the receiver's `is_abort_release_safe()` / `abort_notified`.

The variant matching the installed SGLang is chosen when this module is imported (by inspecting the base
classes), so `inspect.signature` of ours equals SGLang's.
"""
# mypy: disable-error-code="misc"
# (SGLang ships no type information: its bases are `Any` to mypy.)

from __future__ import annotations

import inspect
import time
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import BaseKVReceiver, BaseKVSender, KVPoll, KVTransferMetric
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer, CommonKVReceiver, CommonKVSender

from .manager import XavierKVManager, XavierTransferError
from .reader import ReaderRoom
from .rooms import RoomFailure, SourceRoom

__all__ = [
    "XavierKVBootstrapServer",
    "XavierKVManager",
    "XavierKVReceiver",
    "XavierKVSender",
    "XavierTransferError",
]

_SENDER_TAKES_RANKS = "dest_tp_ranks" in inspect.signature(BaseKVSender.__init__).parameters
_RECEIVER_HAS_DESTINATION = "destination" in inspect.signature(BaseKVReceiver.send_metadata).parameters
if _RECEIVER_HAS_DESTINATION:
    from sglang.srt.disaggregation.base.conn import KVTransferDestination

    _DEVICE: Any = KVTransferDestination.DEVICE


class XavierKVSender(CommonKVSender):
    """The prefill side of one request: publishes its pages (and aux slot) once the last chunk is sent."""

    def _setup(self, mgr: XavierKVManager, bootstrap_addr: str, bootstrap_room: int) -> None:
        # CommonKVSender.__init__ is not called (bootstrap-server registration); see the module docstring.
        self.kv_mgr = mgr
        self.bootstrap_room = int(bootstrap_room)
        self.bootstrap_server_url = bootstrap_addr
        self.aux_index: int | None = None
        self.num_kv_indices = 0
        self.curr_idx = 0
        self.conclude_state: int | None = None
        self.init_time = time.time()
        self._transfer_num_kv_indices = 0
        self._transfer_num_state_indices = 0
        self.room = SourceRoom(mgr.hub, self.bootstrap_room)
        mgr.update_status(self.bootstrap_room, KVPoll.Bootstrapping)

    if _SENDER_TAKES_RANKS:

        def __init__(
            self,
            mgr: XavierKVManager,
            bootstrap_addr: str,
            bootstrap_room: int,
            dest_tp_ranks: list[int],
            pp_rank: int,
            req_has_disagg_prefill_dp_rank: bool = False,
        ) -> None:
            self._setup(mgr, bootstrap_addr, bootstrap_room)

    else:

        def __init__(
            self,
            mgr: XavierKVManager,
            bootstrap_addr: str,
            bootstrap_room: int,
            req_has_disagg_prefill_dp_rank: bool = False,
        ) -> None:
            self._setup(mgr, bootstrap_addr, bootstrap_room)

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self.num_kv_indices = int(num_kv_indices)
        self.aux_index = None if aux_index is None else int(aux_index)
        self.room.init(self.num_kv_indices, self.aux_index)

    def send(
        self,
        kv_indices: Any,
        state_indices: list[Any] | None = None,
        num_kv_tokens: int | None = None,
    ) -> None:
        if state_indices and any(s is not None and len(s) for s in state_indices):
            # Refused at start (no state buffers); a room that still carries some fails, SGLang goes on.
            self.room.fail(RoomFailure("INVALID_ARGUMENT", "state buffers are not supported"))
            return
        pages = np.asarray(kv_indices)
        self.curr_idx += int(pages.size)
        self._transfer_num_kv_indices += int(pages.size)
        self.room.send(pages)

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        state = int(self.room.poll())
        self.kv_mgr.update_status(self.bootstrap_room, state)
        if state in (KVPoll.Success, KVPoll.Failed):
            self.conclude_state = state
            if state == KVPoll.Failed and self.room.failure is not None:
                self.kv_mgr.record_failure(self.bootstrap_room, str(self.room.failure))
        return state

    def failure_exception(self) -> None:
        failure = self.room.failure or RoomFailure("UNKNOWN", "the transfer failed")
        raise XavierTransferError(self.bootstrap_room, failure)

    def get_transfer_metric(self) -> Any:
        return KVTransferMetric(
            transfer_total_bytes=self._transfer_num_kv_indices * self.kv_mgr.kv_item_lens_sum
        )

    def abort(self) -> None:
        # Not Failed yet: the room stays Transferring while a WRITE of it may still read its pages, and
        # SGLang frees them when poll() says Failed.
        self.room.abort("aborted by SGLang")
        self.kv_mgr.record_failure(self.bootstrap_room, "Aborted by AbortReq.")

    def clear(self) -> None:
        self.room.clear()
        self.kv_mgr.request_status.pop(self.bootstrap_room, None)
        self.kv_mgr.failure_records.pop(self.bootstrap_room, None)
        self.kv_mgr.req_to_decode_prefix_len.pop(self.bootstrap_room, None)


class XavierKVReceiver(CommonKVReceiver):
    """The decode side of one request: reserves, begins the transfer, READs aux then KV, completes."""

    def __init__(self, mgr: XavierKVManager, bootstrap_addr: str, bootstrap_room: int | None = None) -> None:
        # CommonKVReceiver.__init__ is not called (ZMQ to the bootstrap server); see the module docstring.
        if bootstrap_room is None:
            raise ValueError("the xavier backend needs a bootstrap_room (the Xavier room id)")
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room)
        self.conclude_state: int | None = None
        self.require_staging = False
        self.init_time: float | None = None
        self.abort_notified = False
        self.bootstrap_infos: list[tuple[str, int]] = []
        self.room = ReaderRoom(mgr.hub, self.bootstrap_room)
        mgr.readers[self.bootstrap_room] = self.room
        mgr.update_status(self.bootstrap_room, KVPoll.Bootstrapping)

    def init(self, prefill_dp_rank: int) -> None:
        prefill = self.kv_mgr.prefill_peer(self.bootstrap_addr)
        self.room.init(prefill)
        if prefill is not None:
            self.bootstrap_infos = [(prefill.peer_id, prefill.epoch)]
        else:
            self.conclude_state = KVPoll.Failed

    def _send(self, kv_indices: Any, aux_index: int | None, state_indices: list[Any] | None) -> None:
        if state_indices and any(s is not None and len(s) for s in state_indices):
            self.room.fail(RoomFailure("INVALID_ARGUMENT", "state buffers are not supported"))
            return
        self.init_time = time.time()
        self.room.send_metadata(np.asarray(kv_indices), None if aux_index is None else int(aux_index))

    if _RECEIVER_HAS_DESTINATION:

        def send_metadata(
            self,
            kv_indices: Any,
            aux_index: int | None = None,
            state_indices: list[Any] | None = None,
            decode_prefix_len: int | None = None,
            destination: Any = _DEVICE,
        ) -> None:
            if destination != _DEVICE:  # the manager says supports_host_destination = False
                self.room.fail(RoomFailure("INVALID_ARGUMENT", "only device KV destinations are supported"))
                return
            self._send(kv_indices, aux_index, state_indices)

    else:

        def send_metadata(
            self,
            kv_indices: Any,
            aux_index: int | None = None,
            state_indices: list[Any] | None = None,
            decode_prefix_len: int | None = None,
        ) -> None:
            self._send(kv_indices, aux_index, state_indices)

    def poll(self) -> int:
        state = int(self.room.poll())
        self.kv_mgr.update_status(self.bootstrap_room, state)
        if state == KVPoll.Failed:
            self.conclude_state = state
            if self.room.prefill_gone and self.room.prefill is not None:
                self.kv_mgr.forget_prefill(self.bootstrap_addr, self.room.prefill)
        elif state == KVPoll.Success:
            self.conclude_state = state
        return state

    def failure_exception(self) -> None:
        failure = self.room.failure or RoomFailure(
            "PEER_UNAVAILABLE", f"no prefill registered at {self.bootstrap_addr} in the Xavier directory"
        )
        raise XavierTransferError(self.bootstrap_room, failure)

    def abort(self) -> None:
        # conclude_state = Failed only makes SGLang keep polling this receiver; poll() stays
        # Transferring until no WRITE of the prefill can land in its pages, and only then says Failed.
        self.room.abort("aborted by SGLang")
        self.abort_notified = True
        self.conclude_state = KVPoll.Failed

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        if not self.abort_notified:
            self.abort()

    def is_abort_release_safe(self) -> bool:
        return self.room.release_safe()

    def clear(self) -> None:
        self.room.clear()
        self.kv_mgr.request_status.pop(self.bootstrap_room, None)
        self.kv_mgr.failure_records.pop(self.bootstrap_room, None)


class XavierKVBootstrapServer(CommonKVBootstrapServer):
    """The prefill's bootstrap server: nothing to serve, since peers meet through the directory. It keeps
    SGLang's start-up and shutdown calls working and names the address the prefill advertises."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port

    def run(self) -> None:
        """Nothing to run."""

    def close(self) -> None:
        """Nothing to stop."""

    def poll(self) -> int:
        return int(KVPoll.Success)
