"""SGLang's KV manager, sender, receiver and bootstrap server for `--disaggregation-transfer-backend xavier`.

Imported only by the plugin's `get_kv_class` hook, inside an SGLang process. The classes subclass
`sglang.srt.disaggregation.common.conn`'s, as SGLang's own backends do, so every `isinstance` and type
expectation of the scheduler holds; but they do not run those bases' constructors (ZMQ sockets, an HTTP
bootstrap server, heartbeats to it): the Xavier directory replaces all of that. Room logic lives in
`rooms` and `hub`; this module only adapts SGLang's calling conventions, which differ by release:

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

import atexit
import concurrent.futures
import dataclasses
import inspect
import time
import weakref
from typing import Any

import numpy as np
import sglang
from sglang.srt.disaggregation.base.conn import BaseKVReceiver, BaseKVSender, KVPoll, KVTransferMetric
from sglang.srt.disaggregation.common.conn import (
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
    KVTransferError,
    PrefillServerInfo,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from xavier_core.contract import differing_fields

from .config import PoolShape, ProcessShape, XavierSettings, check_supported, contract_layout
from .hub import Hub
from .rooms import ReaderRoom, RoomFailure, SourceRoom

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


class XavierTransferError(KVTransferError):
    """SGLang's `KVTransferError` with the Xavier reason (`xavier_reason`) of the failed room."""

    def __init__(self, bootstrap_room: int, failure: RoomFailure) -> None:
        super().__init__(bootstrap_room, str(failure))
        self.xavier_reason = failure.code


class XavierKVManager(CommonKVManager):
    """One per SGLang scheduler process: checks the set-up, registers the buffers with NIXL and the
    process with the directory (role, epoch, contract fingerprint), and owns the rooms."""

    supports_deferred_decode_kv_release = True
    supports_host_destination = False
    supports_role_switch = False

    def __init__(
        self,
        args: Any,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ) -> None:
        # CommonKVManager.__init__ is not called: it binds ZMQ sockets and registers with an HTTP bootstrap
        # server, both replaced by the directory. The attributes SGLang's scheduler reads are set here.
        gpu_id = int(getattr(args, "gpu_id", 0) or 0)
        proc = ProcessShape.from_server_args(server_args, bool(is_mla_backend), sglang.__version__, gpu_id)
        pool = PoolShape.from_kv_args(args, proc.kv_device)
        check_supported(proc, pool)
        layout = contract_layout(
            proc, pool, model_name=str(getattr(server_args, "served_model_name", "") or "")
        )
        settings = XavierSettings.from_env(default_advertise=f"{proc.host}:{proc.bootstrap_port}")
        if disaggregation_mode == DisaggregationMode.PREFILL:
            role = types_pb2.ROLE_PREFILL
        elif disaggregation_mode == DisaggregationMode.DECODE:
            role = types_pb2.ROLE_DECODE
        else:
            raise ValueError(f"Unsupported DisaggregationMode: {disaggregation_mode}")
        self.kv_args = args
        self.kv_cache_dtype_str = pool.dtype
        self.kv_item_lens_sum = sum(b.bytes_per_page for b in pool.kv)
        self.state_item_lens_sum = 0
        self.is_mla_backend = bool(is_mla_backend)
        self.is_hybrid_mla_backend = False
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.enable_deferred_decode_kv_release = True
        self.enable_staging = False
        self.attn_tp_size, self.attn_tp_rank, self.attn_cp_size, self.attn_cp_rank = 1, 0, 1, 0
        self.attn_dp_size, self.attn_dp_rank, self.pp_size, self.pp_rank = 1, 0, 1, 0
        self.enable_all_cp_ranks_for_transfer = False
        self.is_dummy_cp_rank = False
        self.bootstrap_host, self.bootstrap_port = proc.host, proc.bootstrap_port
        self.request_status: dict[int, int] = {}
        self.failure_records: dict[int, str] = {}
        self.transfer_infos: dict[int, Any] = {}
        self.req_to_decode_prefix_len: dict[int, int] = {}
        self.prefill_info_table: dict[str, Any] = {}
        self.bootstrap_timeout = settings.bootstrap_timeout_s
        self.waiting_timeout = settings.waiting_timeout_s
        self._prefill_peers: dict[str, tuple[str, int]] = {}
        self._lookups: dict[str, concurrent.futures.Future[list[dpb.Peer]]] = {}
        self._readers: weakref.WeakValueDictionary[int, ReaderRoom] = weakref.WeakValueDictionary()
        self.hub = Hub(role, pool, layout, settings)
        # Unregister at exit so decodes see a stopped prefill at once, not after its lease.
        atexit.register(self.hub.close)

    # --- BaseKVManager ---------------------------------------------------------------------

    def register_to_bootstrap(self) -> None:
        """Nothing to do: the process registered with the Xavier directory when it was created."""

    def get_kv_replica_factor(self) -> int:
        return 1

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        return True

    def teardown(self) -> None:
        self.hub.close()

    # --- the decode's view of prefills ---------------------------------------------------

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Non-blocking: True once the prefill that serves `bootstrap_addr` is found in the directory
        (same role, same contract fingerprint, registered with that address). The first call starts the
        lookup; SGLang calls again at its retry interval."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        fut = self._lookups.get(bootstrap_addr)
        if fut is None:
            self._lookups[bootstrap_addr] = self.hub.submit(
                self.hub.client.list_peers(types_pb2.ROLE_PREFILL)
            )
            return False
        if not fut.done():
            return False
        del self._lookups[bootstrap_addr]
        if fut.exception() is not None:
            return False
        found = [p for p in fut.result() if p.address == bootstrap_addr]
        ours = [p for p in found if p.contract_fingerprint == self.hub.fingerprint]
        if found and not ours:
            # Like SGLang's own page-size / dtype checks here: a clear error instead of endless retries.
            fields = differing_fields(found[0].layout, self.hub.layout)
            raise RuntimeError(
                f"the prefill at {bootstrap_addr} serves another KV contract than this decode "
                f"(differing: {', '.join(fields) or 'contract_fingerprint'}); both must run the same model, "
                "dtype, page size and SGLang version"
            )
        if not ours:
            return False
        peer = max(ours, key=lambda p: p.epoch)
        self._prefill_peers[bootstrap_addr] = (peer.peer_id, int(peer.epoch))
        self.prefill_info_table[bootstrap_addr] = _prefill_info(
            self.kv_args.page_size, self.kv_cache_dtype_str
        )
        return True

    def prefill_peer(self, bootstrap_addr: str) -> tuple[str, int] | None:
        return self._prefill_peers.get(bootstrap_addr)

    def forget_prefill(self, bootstrap_addr: str) -> None:
        """Drops a prefill whose epoch ended, so the next request looks it up again."""
        self._prefill_peers.pop(bootstrap_addr, None)
        self.prefill_info_table.pop(bootstrap_addr, None)

    # --- 0.5.23 deferred decode KV release ------------------------------------------------

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        """True once no READ of the room can still write the decode's pages (Xavier's decode READs,
        so this is known locally and needs no acknowledgement from the prefill)."""
        reader = self._readers.get(bootstrap_room)
        return reader is None or reader.release_safe()

    def register_deferred_abort_room(self, bootstrap_room: int) -> int:
        return 0

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        """Nothing is tracked beyond the receiver itself."""

    # --- status table kept for SGLang code that reads it -----------------------------------

    def check_status(self, bootstrap_room: int) -> int:
        return self.request_status.get(bootstrap_room, int(KVPoll.Bootstrapping))

    def update_status(self, bootstrap_room: int, status: int) -> None:
        self.request_status[bootstrap_room] = status

    def record_failure(self, bootstrap_room: int, failure_reason: str) -> None:
        self.failure_records[bootstrap_room] = failure_reason


def _prefill_info(page_size: int, dtype: str) -> Any:
    """A `PrefillServerInfo` for a single-rank prefill, built from the fields this release declares."""
    values: dict[str, Any] = {
        "attn_tp_size": 1,
        "attn_cp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "page_size": page_size,
        "kv_cache_dtype": dtype,
        "follow_bootstrap_room": True,
        "target_tp_rank": 0,
        "target_tp_ranks": [0],
        "target_cp_ranks": [0],
        "target_pp_ranks": [0],
        "required_dst_info_num": 1,
        "required_prefill_response_num": 1,
    }
    names = {f.name for f in dataclasses.fields(PrefillServerInfo)}
    return PrefillServerInfo(**{k: v for k, v in values.items() if k in names})


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
        self.room.abort("aborted by SGLang")
        self.kv_mgr.record_failure(self.bootstrap_room, "Aborted by AbortReq.")
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        self.conclude_state = KVPoll.Failed

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
        mgr._readers[self.bootstrap_room] = self.room
        mgr.update_status(self.bootstrap_room, KVPoll.Bootstrapping)

    def init(self, prefill_dp_rank: int) -> None:
        prefill = self.kv_mgr.prefill_peer(self.bootstrap_addr)
        self.room.init(prefill)
        if prefill is not None:
            self.bootstrap_infos = [prefill]
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
            failure = self.room.failure
            if failure is not None and failure.code in (
                "PEER_UNAVAILABLE",
                "STALE_EPOCH",
                "ROOM_END_CAUSE_PEER_LOST",
            ):
                self.kv_mgr.forget_prefill(self.bootstrap_addr)
        elif state == KVPoll.Success:
            self.conclude_state = state
        return state

    def failure_exception(self) -> None:
        failure = self.room.failure or RoomFailure(
            "PEER_UNAVAILABLE", f"no prefill registered at {self.bootstrap_addr} in the Xavier directory"
        )
        raise XavierTransferError(self.bootstrap_room, failure)

    def abort(self) -> None:
        self.room.abort("aborted by SGLang")
        self.abort_notified = True
        self.conclude_state = KVPoll.Failed
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)

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
